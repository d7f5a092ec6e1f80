"""Replicas that misbehave on purpose: ready to probes, then failing requests."""
from __future__ import annotations

import asyncio
import threading
import time

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse


class FakeReplica:
    """Answers probes as a healthy replica; `mode` says what a request gets: "status_500",
    or "break_stream" (two SSE chunks, then the connection drops)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.hits = 0
        app = FastAPI()

        @app.get("/health/ready")
        async def ready() -> JSONResponse:
            return JSONResponse({"status": "ready"})

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response("")

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete() -> Response:
            self.hits += 1
            if self.mode == "status_500":
                return JSONResponse({"error": {"message": "boom"}}, status_code=500)

            async def chunks():
                for i in range(2):
                    yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'.encode()
                    await asyncio.sleep(0.05)
                raise ConnectionResetError("the replica died mid-stream")
            return StreamingResponse(chunks(), media_type="text/event-stream")

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="critical", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
