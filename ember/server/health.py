"""Probes and metrics: /health/live, /health/ready (and /health), /metrics, /version."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember.engine.async_engine import EngineState
from ember.server.state import server_state

router = APIRouter()


@router.get("/health/live")
async def live(request: Request) -> JSONResponse:
    """The process is up and its engine has not died (a loading engine is live). A dead
    engine answers 503 here, and the server exits soon after (server/serve.py)."""
    engine = server_state(request).engine
    if engine.state is EngineState.DEAD:
        return JSONResponse({"status": "dead", "error": repr(engine.error)}, status_code=503)
    return JSONResponse({"status": "live"})


@router.get("/health/ready")
@router.get("/health")
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded and warmed and the engine is making progress."""
    state = server_state(request)
    engine = state.engine
    if state.draining:
        status = "draining"
    elif engine.state is EngineState.LOADING:
        status = "loading"
    elif engine.state is not EngineState.READY:
        status = engine.state.value
    elif not engine.ready:
        status = "stalled"
    else:
        return JSONResponse({"status": "ready"})
    return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": "1"})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    registry = server_state(request).metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> JSONResponse:
    from ember import __version__
    return JSONResponse({"version": __version__})
