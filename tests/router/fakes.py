"""Replicas that misbehave on purpose: ready to probes, then failing requests."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse

from ember.errors import EmberError, Overloaded, TooManySequences
from ember.server.errors import error_response
from tests.server.conftest import ThreadedServer


class RequestTimeout(EmberError):
    """What ember answers a request that ran past --request-timeout (the engine's own class
    needs torch)."""

    http_status = 504
    error_type = "timeout_error"


class FakeReplica(ThreadedServer):
    """Answers probes as a healthy replica (while `ready`); `mode` says what a request gets:
    "ok" (a one-word completion), "status_500",
    "request_timeout" (ember's 504 past --request-timeout, marked the request's own fault),
    "full" (ember's 429 of a full queue), "too_many" (ember's 429 of a request of more
    sequences than its queue takes, marked the request's own),
    or "break_stream" (two SSE chunks, then the connection drops)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.hits = 0
        self.ready = True
        app = FastAPI()

        @app.get("/health/ready")
        async def ready() -> JSONResponse:
            return JSONResponse({"status": "ready" if self.ready else "loading"},
                                status_code=200 if self.ready else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("")

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete() -> Response:
            self.hits += 1
            if self.mode == "ok":
                return JSONResponse({"choices": [{"index": 0, "text": "hi"}]})
            if self.mode == "status_500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)
            if self.mode == "request_timeout":
                return error_response(RequestTimeout("the request ran past its time limit"))
            if self.mode == "full":
                return error_response(Overloaded("the server has 4 sequences waiting and "
                                                 "takes at most 4; retry later"))
            if self.mode == "too_many":
                return error_response(TooManySequences("the server takes at most 4 sequences "
                                                       "waiting and this request adds 6"))

            async def chunks():
                for i in range(2):
                    yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode()
                    await asyncio.sleep(0.05)
                raise ConnectionResetError("the replica died mid-stream")
            return StreamingResponse(chunks(), media_type="text/event-stream")

        super().__init__(app, log_level="critical")   # its broken streams log errors
