"""create_control_app(controller): the control plane's HTTP face and the global endpoint.

    POST /control/planes          a plane's heartbeat (its first registers it): its capacity,
                                  load and fleets in; its desired fleets out (with tenants'
                                  keys, so it needs the plane token when one is set)
    GET  /control                 planes, deployments with their placement, recent events
    GET  /control/                a page drawing /control (planes as boxes, their replicas
                                  and traffic), polled every second
    POST /v1/chat/completions,    the tenant's key -> its regions -> routing.candidates ->
         /v1/completions          forwarded to that plane's fleet; retried on the next
                                  candidate before the first byte, never outside the list.
                                  Only the model is read here: the fleet's gateway validates
                                  the rest and its 4xx reaches the client as it is
    GET  /v1/models[/ID]          the models of the deployments the key's tenant may use
    GET  /health
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ember.config import ServerConfig
from ember.control.config import Tenant
from ember.control.controller import Controller, FleetReport, PlaneLive
from ember.control.placement import Deployment, Plane, place
from ember.control.routing import PlaneView, candidates
from ember.errors import ConfigError, InvalidRequest
from ember.router.proxy import (HOP_HEADERS, SSE_HEADERS, Attempt, kept_headers, read_first,
                                relay_stream)
from ember.server.errors import (NotFound, Unauthorized, Unavailable, error_body,
                                 install_error_handlers, read_body)
from ember.server.tenants import match_key

REGION_HEADER = "x-ember-region"


def create_control_app(ctl: Controller, check_every_s: float = 0.5,
                       server: ServerConfig | None = None, plane_token: str | None = None
                       ) -> FastAPI:
    """`plane_token`: the secret a heartbeat must carry as its bearer token (None: any)."""
    server = server or ServerConfig()
    session: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # no total timeout (a stream lasts as long as it generates) and no cap on pooled
        # connections: the fleets' gateways queue and refuse, not this hop
        session["s"] = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0))
        monitor = asyncio.create_task(_monitor(ctl, check_every_s))
        yield
        monitor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await monitor
        await session["s"].close()

    app = FastAPI(title="ember control", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.post("/control/planes")
    async def heartbeat(request: Request) -> JSONResponse:
        _check_plane_token(request, plane_token)
        plane, fleets, load = _parse_heartbeat(await read_body(request, server.max_body_bytes))
        return JSONResponse({"fleets": ctl.heard(plane, fleets, load)})

    @app.get("/control")
    async def control() -> JSONResponse:
        return JSONResponse(ctl.snapshot())

    page = resources.files("ember.control").joinpath("static/control.html").read_text()

    @app.get("/control/", include_in_schema=False)
    async def control_page() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    created = int(time.time())

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        names = tenant_models(ctl.config.deployments, _tenant(ctl, request))
        return JSONResponse({"object": "list",
                             "data": [_model_card(n, created) for n in names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> JSONResponse:
        if model_id not in tenant_models(ctl.config.deployments, _tenant(ctl, request)):
            raise NotFound(f"model {model_id!r} is not deployed where this key's requests "
                           "may be served; see /v1/models")
        return JSONResponse(_model_card(model_id, created))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward(ctl, session["s"], server, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await forward(ctl, session["s"], server, request, "/v1/chat/completions")

    return app


async def _monitor(ctl: Controller, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        why = ctl.due()
        if why:   # the solver takes up to its time limit: requests keep flowing meanwhile
            result = await asyncio.to_thread(place, ctl.problem(),
                                             time_limit_s=ctl.solve_time_limit_s)
            ctl.apply(result, why)


def _check_plane_token(request: Request, token: str | None) -> None:
    """A heartbeat's reply carries tenants' keys: only a plane holding the token gets one."""
    if token is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("missing or wrong plane token; start `ember plane` with "
                           "--token-file FILE holding the secret in `ember control "
                           "--plane-token-file`")


def _parse_heartbeat(raw: bytes) -> tuple[Plane, list[FleetReport], float]:
    try:
        b = json.loads(raw)
        plane = Plane(str(b["name"]), str(b["region"]), int(b["cores"]),
                      int(b["memory_mib"]), float(b.get("cost_per_hour", 1.0)),
                      bool(b.get("spot", False)))
        fleets = [FleetReport(str(f["deployment"]), str(f["model"]), str(f["url"]),
                              int(f["replicas"]), bool(f["ready"]))
                  for f in b.get("fleets", [])]
        return plane, fleets, float(b.get("load", 0.0))
    except (ValueError, KeyError, TypeError, ConfigError) as e:
        raise InvalidRequest(f"a heartbeat needs name, region, cores, memory_mib and fleets "
                             f"(each with deployment, model, url, replicas, ready): {e}"
                             ) from None


def _tenant(ctl: Controller, request: Request) -> Tenant | None:
    """The tenant whose key the request carries; None when no tenants are configured."""
    if not ctl.config.keys:
        return None
    key = match_key(request.headers.get("authorization", ""), ctl.config.keys)
    return ctl.config.tenants[key.tenant]


def tenant_models(deployments: tuple[Deployment, ...], tenant: Tenant | None) -> list[str]:
    """The models a tenant may ask for: those of the deployments allowed in one of its
    regions (every deployment's without tenants)."""
    regions = set(tenant.regions) if tenant is not None else set()
    return sorted({d.model for d in deployments
                   if not regions or not d.regions or regions & set(d.regions)})


def _model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "ember"}


def choose(ctl: Controller, model: str, tenant: Tenant | None, client_region: str | None
           ) -> list[PlaneView]:
    """The planes to try, best first: active fleets, then the deployments' standbys, so a
    request whose active planes all fail (one just died, not yet marked down) is served by
    a standby before its first byte. Both lists lie inside the tenant's regions."""
    regions = tenant.regions if tenant is not None else ()
    planes, why = candidates(ctl.views("active"), model, regions, client_region)
    standbys, _ = candidates(ctl.views("standby"), model, regions, client_region)
    planes += [p for p in standbys if p.name not in {a.name for a in planes}]
    if not planes:
        raise Unavailable(why)
    return planes


def requested_model(raw: bytes, deployments: tuple[Deployment, ...]) -> str:
    """The model a request body names (the only deployment's when it names none), or an
    InvalidRequest. The rest of the body is the fleet gateway's to validate."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("the JSON body nests too deeply") from None
    except ValueError as e:  # bad JSON, bad UTF-8, or an integer of over 4300 digits
        raise InvalidRequest(f"the body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string naming a model, not {model!r:.100}")
    models = sorted({d.model for d in deployments})
    model = model or (models[0] if len(models) == 1 else None)
    if model is None:
        raise InvalidRequest(f"give a model: one of {', '.join(models)}")
    return model


async def forward(ctl: Controller, session: aiohttp.ClientSession, server: ServerConfig,
                  request: Request, path: str) -> Response:
    tenant = _tenant(ctl, request)
    raw = await read_body(request, server.max_body_bytes)
    model = requested_model(raw, ctl.config.deployments)
    planes = choose(ctl, model, tenant, request.headers.get(REGION_HEADER))
    headers = {k: v for k, v in request.headers.items() if k.lower() in HOP_HEADERS}
    last: Attempt | None = None
    for view in planes:      # only the tenant's allowed planes: a retry never leaves them
        url = ctl.fleet_url(view.name, model)
        if url is None:
            continue
        live = ctl.live[view.name]
        live.in_flight += 1
        try:
            resp = await session.post(url + path, data=raw, headers=headers)
            first = await read_first(resp)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, Attempt) as e:
            live.in_flight -= 1
            last = e if isinstance(e, Attempt) else Attempt("connect")
            continue
        except BaseException:
            live.in_flight -= 1
            raise
        tenant_name = tenant.name if tenant is not None else "-"
        ctl.served[tenant_name, view.name] = ctl.served.get((tenant_name, view.name), 0) + 1
        return _answer(resp, first, live)
    reason = last.reason if last is not None else "no fleet URL"
    return Response(last.body if last is not None and last.body else json.dumps(error_body(
        503, f"every plane tried failed ({reason}); retry later",
        "unavailable_error")).encode(), status_code=last.status if last else 503,
        media_type="application/json", headers={"Retry-After": "1"})


def _answer(resp: aiohttp.ClientResponse, first: bytes, live: PlaneLive) -> Response:
    if resp.content_type != "text/event-stream":
        live.in_flight -= 1
        return Response(first, status_code=resp.status, media_type=resp.content_type,
                        headers=kept_headers(resp))
    return _Relay(resp, first, live)


class _Relay(StreamingResponse):
    """A fleet's stream relayed to the client. The fleet's response is closed and the
    plane's in-flight count dropped once, however the stream ends: also when the client
    left before it began, when the body's iterator never runs."""

    def __init__(self, resp: aiohttp.ClientResponse, first: bytes, live: PlaneLive) -> None:
        super().__init__(relay_stream(resp, first, None, _nothing), status_code=resp.status,
                         media_type="text/event-stream", headers=SSE_HEADERS)
        self.resp, self.live = resp, live

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.resp.close()
            self.live.in_flight -= 1


def _nothing() -> None:
    pass
