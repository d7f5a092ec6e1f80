"""The fleet: every replica, what the gateway knows of it, and the loops that keep it so.

* probes: `/health/ready` and `/metrics` of each replica every `probe_interval_s`; a replica
  that answers becomes ready, one that stops answering is ejected.
* KV events: each ready replica's `/kv/events` is polled with its cursor (kv_index.py). Its
  block keys are used only if it serves the model the gateway's tokenizer is for
  (`hash_model`); any other replica is routed on the text of the prompts sent to it.
* supervision: a local or Ray replica whose process died is marked dead and restarted with
  exponential backoff; one its launcher restarted itself at a new URL (Ray restarts an
  actor) keeps its id and is probed anew. Handles are awaited: none blocks the loop.
* choose/release: the decision and the in-flight count it raises, in one synchronous step.
* roles (disaggregated serving): a replica's role (both, prefill, decode) filters where a
  request may go; a local replica of a role is started by the launcher of that name.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from ember.config import ServerConfig
from ember.router.config import RouterConfig
from ember.router.kv_index import BlockIndex, TextIndex
from ember.router.metrics import RouterMetrics
from ember.router.policies import Candidate, Decision, Picker
from ember.router.replicas import Launcher, Replica, ReplicaHandle, ReplicaState

log = logging.getLogger(__name__)

MAX_RESTART_BACKOFF_S = 30.0
PORT_TAKEN = "address already in use"   # a replica's log line when its port was taken
PROBE_TIMEOUT_S = 2.0
SNAPSHOT_TIMEOUT_S = 30.0   # a snapshot lists a whole KV pool: up to megabytes of JSON
STARTING_PROBE_S = 0.1
REPLICA_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                  "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass(frozen=True)
class RouteKeys:
    """What the prefix policy knows of one request: its block keys (if the gateway has the
    tokenizer) and its text's chunk keys (for replicas without KV events)."""

    block_keys: dict[int, list[int]]   # block size -> keys of the prompt's full blocks
    text_keys: list[int]
    session_key: str | None = None
    counted: bool = True    # False: not a generation (/tokenize...), kept out of the stats


ROLES = ("prefill", "decode")   # a replica's part in disaggregated serving ("both": neither)


def launcher_name(group: str, role: str) -> str:
    """The launcher that starts a replica: its role's, for a primary one with a role."""
    return role if group == "primary" and role in ROLES else group


def replica_auth(server: ServerConfig) -> dict[str, str]:
    """The header of the gateway's own calls to replicas: they take the gateway's options,
    so any key the gateway accepts is one they accept (/kv/events is behind it)."""
    key = server.api_key or next((k.key for k in server.api_keys), None)
    return {"Authorization": f"Bearer {key}"} if key else {}


class Fleet:
    def __init__(self, config: RouterConfig, launchers: dict[str, Launcher]) -> None:
        self.config = config
        self.auth = replica_auth(config.server)
        self.launchers = launchers              # group -> launcher
        self.replicas: dict[str, Replica] = {}
        self.blocks: dict[str, BlockIndex] = {}
        self.texts: dict[str, TextIndex] = {}
        self.picker = Picker(config.policy, config.prefix)
        self.held = 0                           # requests waiting for a ready replica
        self.held_roles: Counter[str] = Counter()   # of them, those waiting for a role's
        self.metrics = RouterMetrics(self.snapshot, lambda: self.held)
        self.ready_event = asyncio.Event()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._restart_at: dict[str, float] = {}
        self._drains: set[asyncio.Task] = set()
        self._serial = 0
        self._poll_warned: set[tuple[str, str]] = set()   # (replica, status) already logged
        self.failures: dict[str, str] = {}   # group -> why its replicas are not started
        self.adapters: dict[str, str] = {}   # LoRA name -> path, loaded through the gateway
        self.hash_model: str | None = None   # the served model the gateway's tokenizer is for
        self._model_warned: set[str | None] = set()   # served models routed on text, said

    # -- membership -------------------------------------------------------------------------

    def snapshot(self) -> list[dict]:
        return [r.view() for r in self.replicas.values()]

    def add(self, replica: Replica) -> Replica:
        self.blocks[replica.id] = BlockIndex()
        self.texts[replica.id] = TextIndex(self.config.prefix.max_text_chunks)
        self.replicas[replica.id] = replica     # last: whoever finds it finds its indexes
        return replica

    def start_replica(self, group: str = "primary", role: str = "both") -> Replica | None:
        name = launcher_name(group, role)
        launcher = self.launchers.get(name)
        if launcher is None or name in self.failures:
            return None
        self._serial += 1
        replica_id = f"{name[0]}{self._serial}"
        handle = launcher.start(replica_id)
        if handle is None:
            return None
        log.info("replica %s starting at %s", replica_id, handle.url or "(not known yet)")
        return self.add(Replica(replica_id, handle, group, role))

    def remove(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self.blocks.pop(replica_id, None)
        self.texts.pop(replica_id, None)

    def group(self, name: str, states: tuple[ReplicaState, ...] | None = None,
              roles: tuple[str, ...] | None = None) -> list[Replica]:
        return [r for r in self.replicas.values() if r.group == name
                and (states is None or r.state in states)
                and (roles is None or r.role in roles)]

    def can_serve_soon(self, group: str = "primary", roles: tuple[str, ...] | None = None
                       ) -> bool:
        """A replica of `group` (in one of `roles`) is ready, starting, or can be started."""
        live = (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DEAD)
        names = {launcher_name(group, role) for role in roles or (*ROLES, "both")}
        return bool(self.group(group, live, roles)) or any(
            name in self.launchers and name not in self.failures for name in names)

    @property
    def disaggregated(self) -> bool:
        """Some primary replica prefills for others (or a launcher starts such replicas)."""
        return "prefill" in self.launchers or any(
            r.role == "prefill" for r in self.replicas.values() if r.group == "primary")

    # -- routing ----------------------------------------------------------------------------

    def busy(self, group: str, now: float, roles: tuple[str, ...] | None = None) -> bool:
        """Every replica of `group` that serves is busy (it answered 429: its queue is full)
        and none is starting: a request held now would only wait in front of full queues."""
        if self.group(group, (ReplicaState.STARTING,), roles):
            return False
        up = [r for r in self.group(group, roles=roles) if r.up(now)]
        return bool(up) and all(now < r.busy_until for r in up)

    def candidates(self, group: str, keys: RouteKeys, exclude: set[str], now: float,
                   roles: tuple[str, ...] | None = None) -> list[tuple[Replica, Candidate]]:
        out = []
        for r in self.replicas.values():
            if r.group != group or r.id in exclude or not r.routable(now) or \
                    (roles is not None and r.role not in roles):
                continue
            out.append((r, Candidate(r.id, r.in_flight, r.waiting, r.kv_usage,
                                     self._matched(r, keys, now))))
        return out

    def longest_cached(self, group: str, keys: RouteKeys, roles: tuple[str, ...]) -> int:
        """The most leading blocks of this prompt a routable replica of `roles` holds."""
        pairs = self.candidates(group, keys, set(), time.monotonic(), roles)
        return max((c.matched_blocks * (self.blocks[r.id].block_size or 0) for r, c in pairs
                    if self._hashable(r)), default=0)

    def _matched(self, r: Replica, keys: RouteKeys, now: float) -> int:
        if self.config.policy != "prefix":
            return 0
        index = self.blocks[r.id]
        if self._hashable(r) and index.block_size in keys.block_keys:
            return index.matched(keys.block_keys[index.block_size], now)
        return self.texts[r.id].matched(keys.text_keys)

    def _hashable(self, r: Replica) -> bool:
        """Whether the gateway hashes prompts as `r` does: it reports KV events, and for the
        model the gateway's tokenizer is for."""
        index = self.blocks[r.id]
        return (r.supports_events and index.block_size is not None
                and self.hash_model is not None and index.model == self.hash_model)

    def choose(self, group: str, keys: RouteKeys, exclude: set[str],
               roles: tuple[str, ...] | None = None) -> tuple[Replica, Decision] | None:
        """Pick a replica (of one of `roles`, if given) and count the request on it at once
        (no await in between)."""
        now = time.monotonic()
        pairs = self.candidates(group, keys, exclude, now, roles)
        if not pairs:
            return None
        by_id = {r.id: r for r, _ in pairs}
        num_blocks = max((len(k) for k in keys.block_keys.values()), default=0)
        decision = self.picker.pick([c for _, c in pairs], num_blocks, keys.session_key)
        replica = by_id[decision.replica_id]
        replica.in_flight += 1
        self._note_routed(replica, keys, now)
        if not keys.counted:
            return replica, decision
        self.metrics.decisions.labels(replica.id, decision.reason).inc()
        total = self._total_units(replica, keys)
        if total:
            self.metrics.overlap.labels(replica.id).observe(decision.matched_blocks / total)
        return replica, decision

    def _total_units(self, r: Replica, keys: RouteKeys) -> int:
        size = self.blocks[r.id].block_size
        if self._hashable(r) and size in keys.block_keys:
            return len(keys.block_keys[size])
        return len(keys.text_keys)

    def _note_routed(self, r: Replica, keys: RouteKeys, now: float) -> None:
        index = self.blocks[r.id]
        if index.block_size in keys.block_keys:
            index.note_routed(keys.block_keys[index.block_size],
                              now + self.config.prefix.routed_ttl_s)
        self.texts[r.id].insert(keys.text_keys)

    def release(self, replica: Replica) -> None:
        replica.in_flight = max(0, replica.in_flight - 1)

    def eject(self, replica: Replica, reason: str) -> None:
        """No new request goes to `replica` until a probe finds it ready again."""
        if replica.state is not ReplicaState.READY:
            return
        now = time.monotonic()
        if now >= replica.ejected_until:
            self.metrics.ejections.labels(replica.id, reason).inc()
            log.warning("replica %s ejected (%s)", replica.id, reason)
        replica.ejected_until = now + self.config.eject_s

    def needs_text_keys(self) -> bool:
        """Whether some replica is routed on text (no KV events, none polled yet, or keys
        the gateway cannot compute)."""
        return any(not self._hashable(r) for r in self.replicas.values())

    def block_sizes(self) -> set[int]:
        """The block sizes to hash prompts for: those of the replicas routed on blocks."""
        return {self.blocks[r.id].block_size for r in self.replicas.values()
                if self._hashable(r)}

    # -- background loops -------------------------------------------------------------------

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0))
        self._tasks = [asyncio.create_task(self._every(self.probe_interval, self.probe_all)),
                       asyncio.create_task(self._every(lambda: self.config.events_interval_s,
                                                       self.poll_events))]

    def probe_interval(self) -> float:
        """Faster while a replica starts: held requests wait on its first ready probe."""
        starting = any(r.state is ReplicaState.STARTING for r in self.replicas.values())
        return min(STARTING_PROBE_S, self.config.probe_interval_s) if starting \
            else self.config.probe_interval_s

    async def close(self, stop_replicas: bool = True) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if stop_replicas:
            await asyncio.gather(*(r.handle.stop() for r in list(self.replicas.values())))
            await asyncio.gather(*(_wait_or_kill(r) for r in list(self.replicas.values())))
        if self.session is not None:
            await self.session.close()

    async def _every(self, seconds: Callable[[], float], work: Callable) -> None:
        while True:
            try:
                await work()
            except Exception:  # a loop must outlive one bad round
                log.exception("fleet loop failed")
            await asyncio.sleep(seconds())

    async def probe_all(self) -> None:
        await self.supervise()
        replicas = [r for r in self.replicas.values() if r.url and r.state not in
                    (ReplicaState.STOPPED, ReplicaState.DEAD, ReplicaState.FAILED)]
        await asyncio.gather(*(self.probe(r) for r in replicas))
        if any(r.routable(time.monotonic()) for r in self.replicas.values()):
            self.ready_event.set()
        else:
            self.ready_event.clear()

    async def probe(self, r: Replica) -> None:
        ok = await self._get_ok(r.url + "/health/ready")
        if r.state is ReplicaState.DRAINING:
            return
        if ok and r.state is not ReplicaState.READY:
            await self.replay_adapters(r)
            await self.read_models(r)
            self.mark_ready(r)
        elif not ok and r.state is ReplicaState.READY:
            # an ejection runs its course even if the replica answers probes again: one
            # that fails requests while it looks healthy must not take new ones at once
            self.eject(r, "probe")
            self.blocks[r.id].reset()   # it may come back as a new process
        if ok:
            await self._read_gauges(r)

    async def replay_adapters(self, r: Replica) -> None:
        """Load on a replica that starts now every adapter loaded through the gateway, before
        it takes requests."""
        for name, path in list(self.adapters.items()):
            status, text = await self.call(r, "/v1/load_lora_adapter",
                                           json.dumps({"lora_name": name,
                                                       "lora_path": path}).encode(),
                                           {"content-type": "application/json"} | self.auth)
            if status != 200 and "is taken" not in text:   # taken: started with --lora
                log.warning("replica %s could not load adapter %s (%s): %s", r.id, name,
                            status, text[:300])

    async def read_models(self, r: Replica) -> None:
        """Learn from the replica's /v1/models how it pools embeddings and the digest of each
        adapter: what the gateway needs to hash prompts as the replica does. A server whose
        cards say neither (not ember) is routed on load for both."""
        try:
            async with self.session.get(r.url + "/v1/models", headers=self.auth,
                                        timeout=aiohttp.ClientTimeout(
                                            total=PROBE_TIMEOUT_S)) as resp:
                cards = (await resp.json())["data"] if resp.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError):
            return
        cards = [c for c in cards if isinstance(c, dict)]
        r.pooling = next((c.get("pooling") for c in cards if not c.get("parent")), None)
        r.adapters = {c["id"]: c["digest"] for c in cards
                      if c.get("parent") and isinstance(c.get("digest"), str)}

    def adapter_digest(self, model: str | None) -> str | None:
        """The digest of the adapter `model` names, as most ready replicas report it; None
        for the base model (or an adapter no replica reports)."""
        digests = Counter(r.adapters[model] for r in self.replicas.values()
                          if r.state is ReplicaState.READY and model in r.adapters)
        return digests.most_common(1)[0][0] if digests else None

    def caches_embeddings(self) -> bool:
        """Whether the ready replicas keep an embedding's prompt blocks: they pool by the
        last token (other poolings read every row, so they skip the prefix cache)."""
        ready = [r for r in self.replicas.values() if r.state is ReplicaState.READY]
        return bool(ready) and all(r.pooling == "last" for r in ready)

    async def call(self, r: Replica, path: str, raw: bytes, headers: dict[str, str]
                   ) -> tuple[int, str]:
        """POST `raw` to one replica: (status, body); status 502 when it cannot be reached."""
        try:
            async with self.session.post(r.url + path, data=raw, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=120)) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return 502, f"the replica could not be reached ({type(e).__name__})"

    def mark_ready(self, r: Replica) -> None:
        if r.state is ReplicaState.STARTING:
            r.ready_at, r.early_deaths = time.monotonic(), 0
            self.metrics.cold_start.observe(r.ready_at - r.started_at)
            log.info("replica %s ready after %.1f s", r.id, r.ready_at - r.started_at)
        r.state, r.ejected_until, r.busy_until = ReplicaState.READY, 0.0, 0.0
        self.ready_event.set()

    async def _get_ok(self, url: str) -> bool:
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(
                    total=PROBE_TIMEOUT_S)) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def _read_gauges(self, r: Replica) -> None:
        try:
            async with self.session.get(r.url + "/metrics", timeout=aiohttp.ClientTimeout(
                    total=PROBE_TIMEOUT_S)) as resp:
                text = await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "ember_load_phase_seconds":
                    r.load_phases[sample.labels["phase"]] = sample.value
                attr = REPLICA_GAUGES.get(sample.name)
                if attr is not None:
                    setattr(r, attr, int(sample.value) if attr != "kv_usage" else sample.value)
                    r.model_name = sample.labels.get("model_name", r.model_name)

    async def poll_events(self) -> None:
        if self.config.policy != "prefix":
            return
        ready = [r for r in self.replicas.values()
                 if r.state is ReplicaState.READY and r.supports_events]
        await asyncio.gather(*(self._poll(r) for r in ready))
        now = time.monotonic()
        for index in self.blocks.values():
            index.expire(now)

    async def _poll(self, r: Replica) -> None:
        index = self.blocks[r.id]
        for _ in range(4):  # a snapshot, then its events, or a long backlog: a few rounds
            timeout = PROBE_TIMEOUT_S if index.synced else SNAPSHOT_TIMEOUT_S
            try:
                async with self.session.get(f"{r.url}/kv/events?{index.query()}",
                                            headers=self.auth, timeout=aiohttp.ClientTimeout(
                                                total=timeout)) as resp:
                    if resp.status == 404:
                        r.supports_events = False
                        return
                    if resp.status != 200:
                        self._poll_failed(r, str(resp.status))
                        return
                    payload = await resp.json()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
                self._poll_failed(r, "timeout" if isinstance(e, asyncio.TimeoutError)
                                  else "error")
                return
            applied = index.apply(payload)
            if self.blocks.get(r.id) is index:   # not restarted meanwhile
                self._warn_unhashable(r)
            if applied and not payload.get("events") and "snapshot" not in payload:
                return

    def _warn_unhashable(self, r: Replica) -> None:
        """Say once per served model why its replicas are routed on text, not on their KV
        blocks."""
        model = self.blocks[r.id].model
        if self._hashable(r) or model in self._model_warned:
            return
        self._model_warned.add(model)
        served = repr(model) if model else "a model its /kv/events does not name"
        have = (f"a tokenizer for {self.hash_model!r}" if self.hash_model is not None
                else "no tokenizer")
        log.warning("replica %s serves %s and the gateway has %s, so it cannot hash prompts "
                    "as the replica does: the replicas of that model are routed on the text "
                    "of the prompts sent to them, not on the KV blocks they report; give "
                    "`ember route` that model's tokenizer with --tokenizer PATH (a .gguf file "
                    "or a Hugging Face folder; and --served-model-name %s if the file is named "
                    "otherwise)", r.id, served, have, model or "NAME")

    def _poll_failed(self, r: Replica, status: str) -> None:
        """Count it; say it once per replica and status (it repeats every poll)."""
        self.metrics.event_polls_failed.labels(r.id, status).inc()
        if (r.id, status) in self._poll_warned:
            return
        self._poll_warned.add((r.id, status))
        fix = ("; give the gateway the replicas' key (--api-key or --api-keys)"
               if status in ("401", "403") else "")
        log.warning("replica %s: GET /kv/events failed (%s), so only what the gateway sent it "
                    "is known of its cache%s", r.id, status, fix)

    async def supervise(self) -> None:
        """Mark replicas whose process died, and restart them with backoff; follow those
        their launcher restarted at a new URL. All at once: a slow handle delays no other."""
        watched = [r for r in self.replicas.values() if r.state not in
                   (ReplicaState.STOPPED, ReplicaState.DRAINING, ReplicaState.FAILED)]
        await asyncio.gather(*(self._supervise(r) for r in watched))

    async def _supervise(self, r: Replica) -> None:
        if r.state is ReplicaState.DEAD:
            if time.monotonic() >= self._restart_at.get(r.id, 0.0):
                await self._restart(r)
            return
        handle, url = r.handle, r.url
        alive = await handle.alive()
        if r.handle is not handle or r.state not in (ReplicaState.STARTING, ReplicaState.READY):
            return   # drained, stopped or restarted while it was asked
        if not alive:
            self._died(r, time.monotonic())
        elif url and r.url != url:
            self._moved(r, url)
        elif r.url != url:
            log.info("replica %s starting at %s", r.id, r.url)

    def _moved(self, r: Replica, old_url: str) -> None:
        """Its launcher restarted it by itself (Ray restarted its actor): a new server at a
        new URL. The replica keeps its id and starts over; requests still on the old URL
        finish there or, failing before their first byte, are retried elsewhere."""
        log.warning("replica %s restarted by its launcher: %s -> %s", r.id, old_url, r.url)
        self._renew(r, r.handle)

    def _died(self, r: Replica, now: float) -> None:
        r.state, r.last_exit = ReplicaState.DEAD, r.handle.exit_report()
        if r.ready_at is not None:
            delay = min(MAX_RESTART_BACKOFF_S, self.config.restart_backoff_s * 2 ** r.restarts)
            log.warning("replica %s died; restarting in %.1f s", r.id, delay)
        elif any(PORT_TAKEN in line.lower() for line in r.last_exit["log_tail"]):
            # its port was free when picked and taken before it bound: a new one, at once
            delay = 0.0
            log.warning("replica %s found its port taken; restarting on another", r.id)
        else:
            r.early_deaths += 1
            delay = min(MAX_RESTART_BACKOFF_S, self.config.restart_backoff_s * 2 ** r.restarts)
            log.warning("replica %s exited with status %s before it was ready; its last lines:"
                        "\n%s", r.id, r.last_exit["code"], "\n".join(r.last_exit["log_tail"]))
            if r.early_deaths >= self.config.max_early_deaths:
                self._give_up(r)
                return
        self._restart_at[r.id] = now + delay

    def _give_up(self, r: Replica) -> None:
        """Stop restarting `r`, and starting its group's replicas: they take the same
        options, so they would fail alike."""
        r.state = ReplicaState.FAILED
        last = r.last_exit["log_tail"][-1] if r.last_exit["log_tail"] else "no output"
        self.failures[launcher_name(r.group, r.role)] = (
            f"replica {r.id} exited {r.early_deaths} times in a row before it was ready "
            f"(status {r.last_exit['code']}: {last}); fix the options it was given and "
            "restart the gateway (GET /fleet has its last log lines)")
        name = launcher_name(r.group, r.role)
        log.error("giving up on the %s replicas: %s", name, self.failures[name])

    async def _restart(self, r: Replica) -> None:
        launcher = self.launchers.get(launcher_name(r.group, r.role))
        if launcher is None:
            return
        await r.handle.kill()   # whatever is left of it (a Ray actor outlives its server)
        if r.state is not ReplicaState.DEAD or self.replicas.get(r.id) is not r:
            return   # drained or removed meanwhile
        handle = launcher.start(r.id)
        if handle is None:
            return
        self._renew(r, handle)

    def _renew(self, r: Replica, handle: ReplicaHandle) -> None:
        """`r` starts over on `handle`, under its id, with nothing known of its cache."""
        r.handle, r.state, r.restarts = handle, ReplicaState.STARTING, r.restarts + 1
        r.started_at, r.in_flight = time.monotonic(), 0
        r.ejected_until = r.busy_until = 0.0
        r.ready_at, r.first_byte_at, r.load_phases = None, None, {}
        self.blocks[r.id] = BlockIndex()
        self.texts[r.id] = TextIndex(self.config.prefix.max_text_chunks)
        self.metrics.restarts.inc()

    def drain_soon(self, r: Replica) -> asyncio.Task:
        """Take `r` out of routing now, and drain and stop it in the background."""
        r.state = ReplicaState.DRAINING
        task = asyncio.create_task(self.drain(r))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return task

    async def drain(self, r: Replica, timeout_s: float = 600.0) -> None:
        """No new requests; the in-flight ones finish; then the replica stops."""
        r.state = ReplicaState.DRAINING
        deadline = time.monotonic() + timeout_s
        while r.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await r.handle.stop()
        await _wait_or_kill(r)
        r.state = ReplicaState.STOPPED
        self.remove(r.id)


async def _wait_or_kill(r: Replica, timeout_s: float = 30.0) -> None:
    """Give a stopped replica `timeout_s` to drain and exit, then kill it (at once if it
    never reported a URL: no request can be on it)."""
    deadline = time.monotonic() + timeout_s
    while r.url and await r.handle.alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await r.handle.kill()
