"""create_app(engine, config): the FastAPI app, with no module-level state.

The engine loads in its own thread once the app starts, so /health/live answers at once and
/health/ready says 503 until the model is loaded and warmed.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from ember.config import ServerConfig
from ember.engine.async_engine import AsyncEngine
from ember.server import adapters, embeddings, health, kv_events, kv_transfer, openai
from ember.server.errors import ClientDisconnected, install_error_handlers
from ember.server.metrics import ServerMetrics
from ember.server.state import ArrivalTime, ServerState, authenticate, guard

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    model_name = config.served_model_name or engine.model_name

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="ember", lifespan=lifespan, docs_url=None, redoc_url=None)
    tenants = tuple(dict.fromkeys(k.tenant for k in config.tenant_keys()))
    app.state.ember = ServerState(engine, config, model_name,
                                  ServerMetrics(engine, model_name, tenants))
    app.add_middleware(ArrivalTime)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def client_left(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    app.include_router(openai.router, dependencies=[Depends(guard)])
    app.include_router(kv_events.router, dependencies=[Depends(guard)])
    app.include_router(adapters.router, dependencies=[Depends(guard)])
    app.include_router(embeddings.router, dependencies=[Depends(guard)])
    app.include_router(kv_transfer.router, dependencies=[Depends(authenticate)])
    app.include_router(health.router)

    page = resources.files("ember.server").joinpath("static/index.html").read_text()

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page)

    return app
