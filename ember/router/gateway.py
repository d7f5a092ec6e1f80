"""create_gateway(...): the OpenAI API in front of the fleet, plus its probes and admin.

    POST /v1/completions, /v1/chat/completions,   validated as `ember serve` validates them
         /v1/embeddings                           (same errors), then routed and forwarded
    GET  /v1/models, POST /tokenize, /detokenize  forwarded to a ready replica
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   on every replica
    GET  /health/live, /health/ready, /metrics
    GET  /fleet; POST /fleet/promote, /fleet/rollback (behind the API key, if any)
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember.config import ApiKey
from ember.errors import Overloaded
from ember.router.autoscale import Autoscaler
from ember.router.disagg import (DECODE, PREFILL, WHOLE, Aside, KeptLocal, Queue, Split,
                                 backed_up, unsupported)
from ember.router.fleet import Fleet, RouteKeys
from ember.router.metrics import ANONYMOUS
from ember.router.prompts import PromptKeys
from ember.router.proxy import CLIENT_CLOSED_REQUEST, HOP_HEADERS, Proxy
from ember.router.replicas import PromptBacklog, ReplicaState
from ember.router.rollout import Capture, Rollout
from ember.server.disconnect import unless_disconnected
from ember.server.errors import (ClientDisconnected, Unauthorized, error_body,
                                 install_error_handlers, read_body)
from ember.server.protocol import (ChatCompletionRequest, CompletionRequest, EmbeddingRequest,
                                   LoadLoraAdapterRequest, UnloadLoraAdapterRequest, parse_body)
from ember.server.tenants import match_key

NO_KEYS = RouteKeys({}, [], counted=False)


@dataclass
class Gateway:
    fleet: Fleet
    proxy: Proxy
    prompts: PromptKeys
    rollout: Rollout
    autoscalers: tuple[Autoscaler, ...]   # one per role of a disaggregated fleet
    keys: tuple[ApiKey, ...]           # every accepted key (none: no auth)
    aside: Aside                       # a disaggregated fleet's mode
    kept: KeptLocal = field(default_factory=lambda: KeptLocal(Counter(), PromptBacklog()))
    tenants: bool = False              # keys name tenants, whose prefixes are salted
    in_flight: int = 0
    stop_replicas: bool = True
    draining: bool = False             # stopping: not ready, in-flight requests finish
    # tasks no request awaits (shadow mirrors): the loop keeps only weak references to tasks
    background: set[asyncio.Task] = field(default_factory=set)

    def in_background(self, work: Coroutine) -> asyncio.Task:
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    def check_key(self, request: Request) -> ApiKey | None:
        if not self.keys:
            return None
        try:
            key = match_key(request.headers.get("authorization", ""), self.keys)
        except Unauthorized:   # counted: a plane sees a key it was not given sent to it
            self.fleet.metrics.rejected.labels("unauthorized").inc()
            raise
        return key if self.tenants else None

    def left(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def ready(self) -> bool:
        if self.draining:
            return False
        now = time.monotonic()
        # a disaggregated fleet serves while a decode replica does (it computes prompts
        # itself when no prefill replica answers)
        primaries = self.fleet.group("primary", roles=WHOLE if self.fleet.disaggregated
                                     else None)
        if any(r.up(now) for r in primaries):   # busy ones too: full is not broken
            return True
        live = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DEAD)
        return not any(r.state in live for r in primaries) and \
            self.fleet.can_serve_soon("primary")


def create_gateway(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gw.fleet.start()
        for autoscaler in gw.autoscalers:
            autoscaler.start()
        yield
        for autoscaler in gw.autoscalers:
            await autoscaler.stop()
        await gw.fleet.close(stop_replicas=gw.stop_replicas)

    app = FastAPI(title="ember route", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)

    @app.exception_handler(ClientDisconnected)
    async def client_left(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def guard(request: Request) -> None:
        request.state.tenant = gw.check_key(request)

    @app.post("/v1/completions", dependencies=[Depends(guard)])
    async def completions(request: Request) -> Response:
        return await route(gw, request, CompletionRequest, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=[Depends(guard)])
    async def chat(request: Request) -> Response:
        return await route(gw, request, ChatCompletionRequest, "/v1/chat/completions")

    @app.post("/tokenize", dependencies=[Depends(guard)])
    @app.post("/detokenize", dependencies=[Depends(guard)])
    async def passthrough(request: Request) -> Response:
        raw = await read_request(gw, request)
        return await gw.proxy.forward(request.url.path, raw, forwarded(request), NO_KEYS,
                                      "primary", False, time.monotonic(),
                                      tenant=tenant_name(request))

    @app.get("/v1/models", dependencies=[Depends(guard)])
    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(guard)])
    async def models(request: Request) -> Response:
        return await gw.proxy.forward(request.url.path, b"", forwarded(request), NO_KEYS,
                                      "primary", False, time.monotonic(), method="GET",
                                      tenant=tenant_name(request))

    @app.post("/v1/embeddings", dependencies=[Depends(guard)])
    async def embeddings(request: Request) -> Response:
        return await route(gw, request, EmbeddingRequest, "/v1/embeddings")

    _add_probes(app, gw)
    _add_admin(app, gw, guard)
    _add_adapters(app, gw, guard)
    return app


def _add_adapters(app: FastAPI, gw: Gateway, guard: Callable[[Request], Awaitable[None]]
                  ) -> None:
    """LoRA adapters, loaded on every replica; the fleet keeps the set and loads it on each
    replica that starts later (fleet.replay_adapters)."""
    @app.post("/v1/load_lora_adapter", dependencies=[Depends(guard)])
    async def load(request: Request) -> Response:
        raw = await read_request(gw, request)
        body = parse_body(raw, LoadLoraAdapterRequest, gw.fleet.config.server.max_json_depth)
        gw.fleet.adapters[body.lora_name] = body.lora_path   # replicas starting now get it
        answer, num_done = await on_every_replica(gw, "/v1/load_lora_adapter", raw,
                                                  forwarded(request))
        if answer.status_code != 200 and not num_done:
            gw.fleet.adapters.pop(body.lora_name, None)     # no replica took it
        await read_every_replicas_models(gw)                # the adapter's digest
        return answer

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(guard)])
    async def unload(request: Request) -> Response:
        raw = await read_request(gw, request)
        body = parse_body(raw, UnloadLoraAdapterRequest, gw.fleet.config.server.max_json_depth)
        gw.fleet.adapters.pop(body.lora_name, None)
        answer, _ = await on_every_replica(gw, "/v1/unload_lora_adapter", raw,
                                           forwarded(request))
        await read_every_replicas_models(gw)
        return answer


async def read_every_replicas_models(gw: Gateway) -> None:
    await asyncio.gather(*(gw.fleet.read_models(r) for r in gw.fleet.replicas.values()
                           if r.state is ReplicaState.READY))


async def on_every_replica(gw: Gateway, path: str, raw: bytes, headers: dict[str, str]
                           ) -> tuple[Response, int]:
    """POST to every ready replica at once; the answer, and how many replicas did it. 200
    when all answer 200; the replicas' own answer when all fail alike (a bad path is a 400
    everywhere); else 502 naming which replicas failed, and why."""
    replicas = [r for r in gw.fleet.replicas.values() if r.state is ReplicaState.READY]
    answers = await asyncio.gather(*(gw.fleet.call(r, path, raw, headers) for r in replicas))
    failed = {r.id: a for r, a in zip(replicas, answers) if a[0] != 200}
    done = [r.id for r in replicas if r.id not in failed]
    if not failed:
        return JSONResponse({"status": "ok", "replicas": done}), len(done)
    if not done and len(set(failed.values())) == 1:
        status, text = next(iter(failed.values()))
        return Response(text, status_code=status, media_type="application/json"), 0
    reasons = "; ".join(f"{rid}: {status} {text[:200]}" for rid, (status, text) in
                        failed.items())
    message = (f"done on {', '.join(done) or 'no replica'}, failed on {reasons}; fix what "
               "the failed replicas say and send the request again")
    return JSONResponse(error_body(502, message, "server_error"), status_code=502), len(done)


def _add_probes(app: FastAPI, gw: Gateway) -> None:
    @app.get("/health/live")
    async def live() -> JSONResponse:
        return JSONResponse({"status": "live"})

    @app.get("/health/ready")
    @app.get("/health")
    async def ready() -> JSONResponse:
        if gw.ready():
            return JSONResponse({"status": "ready"})
        failure = gw.fleet.failures.get("primary")
        return JSONResponse({"status": "no replica ready"} | ({"reason": failure} if failure
                                                             else {}),
                            status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gw.fleet.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)


def _add_admin(app: FastAPI, gw: Gateway, guard: Callable[[Request], Awaitable[None]]
               ) -> None:
    @app.get("/fleet", dependencies=[Depends(guard)])
    async def fleet() -> JSONResponse:
        return JSONResponse({"policy": gw.fleet.config.policy,
                             "replicas": gw.fleet.snapshot(),
                             "canary_percent": gw.rollout.canary_percent,
                             "shadow_percent": gw.rollout.shadow_percent,
                             "held": gw.proxy.held, "failures": gw.fleet.failures}
                            | ({"disaggregation": gw.aside.view()
                                | {"kept_local": gw.kept.view(time.monotonic())}}
                               if gw.fleet.disaggregated else {}))

    @app.post("/fleet/promote", dependencies=[Depends(guard)])
    async def promote() -> JSONResponse:
        return JSONResponse(await gw.rollout.promote(gw.fleet))

    @app.post("/fleet/rollback", dependencies=[Depends(guard)])
    async def rollback() -> JSONResponse:
        return JSONResponse(await gw.rollout.rollback(gw.fleet))


async def read_request(gw: Gateway, request: Request) -> bytes:
    """The request's body; a client that leaves before sending all of it is answered (to no
    one) 499 and counted as such, of no replica."""
    try:
        return await read_body(request, gw.fleet.config.server.max_body_bytes)
    except ClientDisconnected:
        gw.fleet.metrics.requests.labels("none", str(CLIENT_CLOSED_REQUEST),
                                         tenant_name(request)).inc()
        raise


def tenant_name(request: Request) -> str:
    """The tenant the request's key named (set by the guard), or anonymous."""
    tenant = getattr(request.state, "tenant", None)
    return tenant.tenant if tenant is not None else ANONYMOUS


def forwarded(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in HOP_HEADERS}


async def route(gw: Gateway, request: Request, model: type, path: str) -> Response:
    """Validate (as the replica would), hash, pick, forward."""
    arrival = time.monotonic()
    server = gw.fleet.config.server
    tenant = tenant_name(request)
    gw.fleet.metrics.tenant_requests.labels(tenant).inc()   # where its inputs were processed
    raw = await read_request(gw, request)
    body = parse_body(raw, model, server.max_json_depth, server.max_n)
    embedding = isinstance(body, EmbeddingRequest)
    if embedding:
        body.inputs(server.max_embedding_inputs)
    else:
        body.check_supported()
    if gw.in_flight >= gw.fleet.config.max_in_flight:
        gw.fleet.metrics.rejected.labels("gateway_full").inc()
        raise Overloaded(f"the gateway has {gw.in_flight} requests in flight, its limit; "
                         "retry later")
    # an embedding pooled other than by its last token leaves no blocks to route to
    by_prefix = gw.fleet.config.policy == "prefix" and \
        (not embedding or gw.fleet.caches_embeddings())
    keys = gw.prompts.route_keys(body, request.state.tenant, gw.fleet.block_sizes(),
                                 request.headers, by_prefix, gw.fleet.needs_text_keys(),
                                 gw.fleet.adapter_digest(body.model))
    headers = forwarded(request)
    capture = None
    if not embedding and gw.rollout.shadow_wanted(gw.fleet):   # a shadow compares text
        capture = Capture()
        gw.in_background(gw.rollout.mirror(gw.fleet, path, raw, headers, capture))
    for autoscaler in gw.autoscalers:
        autoscaler.note_request()
    group = gw.rollout.group_for(gw.fleet)
    gw.in_flight += 1
    if not embedding and group == "primary" and gw.fleet.disaggregated:
        split = Split(gw.proxy, path, raw, headers, keys, arrival,
                      isinstance(body, ChatCompletionRequest), body.stream,
                      body.include_usage, gw.left, gw.in_background, tenant)
        return await unless_disconnected(request, route_split(gw, body, split))
    try:
        # until the first byte (all of a plain answer) a client that leaves cancels the
        # forward, which hangs up on the replica, so it aborts the request as a client's
        # leaving aborts it there; a stream after its first byte stops with its relay
        return await unless_disconnected(request, gw.proxy.forward(
            path, raw, headers, keys, group,
            not embedding and body.stream, arrival, capture, on_done=gw.left, tenant=tenant))
    except BaseException:
        gw.left()
        raise


async def route_split(gw: Gateway, body: CompletionRequest | ChatCompletionRequest,
                      split: Split) -> Response:
    """A request to a disaggregated fleet: split between a prefill and a decode replica,
    unless a transfer cannot carry it, its uncached part is under --disagg-min-tokens, or
    every prefill replica is backed up past --disagg-max-prefill-backlog (then a decode
    replica computes it whole: moving a short prompt's KV costs more than computing it, and
    a long one waits less there; or any replica, while disaggregation steps aside)."""
    try:
        path = "unsupported" if unsupported(body) is not None else None
        if path is None:
            path = keep_local(gw, body, split)
        roles = gw.aside.route(eligible=path in (None, "kept_local_backlog"))
    except BaseException:
        split.on_done()
        raise
    if path is None:
        return await split.run()
    gw.fleet.metrics.disagg_requests.labels(path).inc()
    if path != "kept_local_backlog":
        return await split.whole(roles)
    tokens, computed = split.uncached_tokens, False
    gw.kept.backlog.add(tokens, time.monotonic())
    try:   # a stream's answer goes on: its prompt is computed once its first byte came
        answer = await split.whole(roles)
        computed = answer.status_code == 200
        return answer
    finally:
        gw.kept.backlog.remove(tokens, time.monotonic(), computed)


def keep_local(gw: Gateway, body: CompletionRequest | ChatCompletionRequest, split: Split
               ) -> str | None:
    """Why a request a transfer can carry goes whole to a decode replica (its path's
    label), or None: it is split. Sets the split's uncached tokens, its share of the
    backlog of the replica that computes it."""
    config = gw.fleet.config
    if not config.disagg_min_tokens and not config.disagg_max_prefill_backlog:
        return None
    num_tokens = gw.prompts.num_tokens(body)
    # the part a decode replica computes whole: what none of them holds
    local_tokens = num_tokens - gw.fleet.longest_cached("primary", split.keys, WHOLE)
    if config.disagg_min_tokens and local_tokens < config.disagg_min_tokens:
        gw.kept.counts["min_tokens"] += 1
        return "kept_local"
    split.uncached_tokens = num_tokens - gw.fleet.longest_cached("primary", split.keys,
                                                                 PREFILL)
    now = time.monotonic()
    prefill = [Queue(r.backlog.tokens, r.backlog.rate(now))
               for r in gw.fleet.group("primary", roles=PREFILL) if r.routable(now)]
    num_decode = sum(r.routable(now) for r in gw.fleet.group("primary", roles=DECODE))
    local = Queue(gw.kept.backlog.tokens / max(1, num_decode), gw.kept.backlog.rate(now))
    if backed_up(prefill, local, local_tokens, config.disagg_max_prefill_backlog):
        gw.kept.counts["prefill_backlog"] += 1
        split.uncached_tokens = local_tokens
        return "kept_local_backlog"
    return None
