"""The gateway's settings: frozen dataclasses, checked when built (cli.py fills them).

Where the defaults come from:
* imbalance guard (max - min in-flight > 8 and max > 1.5x min): SGLang's cache-aware router
  balances by queue length when its absolute and relative thresholds are both passed; its
  relative threshold is 1.5, and 8 is a burst the size of one client's concurrency.
* share guard (over the last 64 decisions, max - min routed > 8 and max > 1.25x min):
  the in-flight guard never fires when the concurrency is below its absolute threshold, so
  with few tenants whole tenants piled onto one replica (a 24/41 split measured); routed
  counts catch that. 1.25 over a window keeps the whole run's split under 1.5.
* saturation filter (waiting > 5 or KV usage > 0.8): llm-d's endpoint picker defaults for its
  queue and KV-cache filters.
* load weight (one in-flight request costs as much as prefilling 4 blocks): one decoding
  request costs each step about a prompt chunk of 64 tokens, 4 blocks of 16, on ember's CPU
  kernels; it breaks ties between replicas that hold as much of the prompt.
* routed-block TTL (10 s): long enough to cover a replica's prefill and the next event poll.
* prefill backlog (2048 tokens): one core computes about 1,000 prompt tokens a second with
  ember's CPU kernels, so below 2,048 uncached tokens ahead a prompt waits about 2 s at most
  for a prefill replica, which keeps the decode replicas' streams clear of it; past that it
  goes to whichever side would compute it sooner, at the rates the gateway measures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ember.config import ServerConfig
from ember.errors import ConfigError

POLICIES = ("prefix", "round-robin", "least-load", "session")


@dataclass(frozen=True)
class PrefixConfig:
    imbalance_abs: int = 8
    imbalance_rel: float = 1.5
    share_window: int = 64          # recent decisions the share guard counts (0: no guard)
    share_abs: int = 8
    share_rel: float = 1.25
    max_waiting: int = 5
    max_kv_usage: float = 0.8
    load_weight: float = 4.0        # blocks to prefill that one in-flight request is worth
    routed_ttl_s: float = 10.0
    text_chunk_chars: int = 64      # the approximate tree's unit, for replicas without events
    max_text_chunks: int = 100_000  # per replica, oldest forgotten first

    def __post_init__(self) -> None:
        if self.imbalance_abs < 0 or self.imbalance_rel < 1:
            raise ConfigError("the imbalance guard needs imbalance_abs >= 0 and "
                              "imbalance_rel >= 1")
        if self.share_window < 0 or self.share_abs < 0 or self.share_rel < 1:
            raise ConfigError("the share guard needs share_window >= 0, share_abs >= 0 and "
                              "share_rel >= 1")
        if not 0 < self.max_kv_usage <= 1:
            raise ConfigError(f"max_kv_usage={self.max_kv_usage} must be in (0, 1]")
        if self.routed_ttl_s <= 0 or self.text_chunk_chars <= 0 or self.max_text_chunks <= 0:
            raise ConfigError("routed_ttl_s, text_chunk_chars and max_text_chunks must be "
                              "positive")


@dataclass(frozen=True)
class AutoscaleConfig:
    """Replicas follow the gateway's own counters: in-flight + queued requests per replica,
    averaged over `look_back_s`, against `target_ongoing` (Ray Serve's target_ongoing_requests
    idea)."""

    min_replicas: int = 1
    max_replicas: int = 1
    target_ongoing: float = 4.0
    look_back_s: float = 10.0
    scale_up_delay_s: float = 2.0
    scale_down_delay_s: float = 30.0
    scale_to_zero_after_s: float | None = None
    ttft_slo_s: float | None = None
    interval_s: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ConfigError(f"need 0 <= min_replicas ({self.min_replicas}) <= max_replicas "
                              f"({self.max_replicas})")
        if self.target_ongoing <= 0:
            raise ConfigError(f"target_ongoing={self.target_ongoing} must be positive")
        if self.min_replicas == 0 and self.scale_to_zero_after_s is None:
            raise ConfigError("--min-replicas 0 needs --scale-to-zero-after SECONDS")
        for name in ("look_back_s", "scale_up_delay_s", "scale_down_delay_s", "interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.max_replicas > self.min_replicas or self.min_replicas == 0


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "prefix"
    session_header: str = "x-session-id"  # the session policy's key, else the body's `user`
    max_tries: int = 3                  # per request, across replicas, before the first byte
    backoff_s: float = 0.05             # first retry's base delay; doubles, with full jitter
    probe_interval_s: float = 1.0
    events_interval_s: float = 0.25
    eject_s: float = 5.0                # a failed replica gets no new request this long
    max_queue: int = 512                # requests held waiting for a replica, then 503
    max_in_flight: int = 4096           # requests the gateway carries at once, then 429
    hold_timeout_s: float = 120.0       # how long a held request waits for a replica
    restart_backoff_s: float = 1.0      # a dead local replica's first restart delay; doubles
    max_early_deaths: int = 3           # exits in a row before ready, then no more restarts
    # one upstream request, end to end (None: no limit); past the replicas' own
    # --request-timeout, which answers the request's own 504 first
    replica_timeout_s: float | None = 600.0
    server: ServerConfig = field(default_factory=ServerConfig)  # listen, keys, body limits
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # disaggregated serving: each role's bounds (None: not a local disaggregated fleet), and
    # the shortest uncached prompt worth moving between replicas (0: every prompt is split),
    # and how long without such a prompt before whole requests may go to any replica (0: never)
    prefill_autoscale: AutoscaleConfig | None = None
    decode_autoscale: AutoscaleConfig | None = None
    disagg_min_tokens: int = 0
    disagg_idle_s: float = 30.0
    # while every prefill replica has at least this many uncached prompt tokens outstanding, a
    # prompt worth splitting goes whole to a decode replica if it would be computed sooner
    # there, at each side's measured rate (0: never)
    disagg_max_prefill_backlog: int = 2048

    def __post_init__(self) -> None:
        if self.disagg_min_tokens < 0:
            raise ConfigError(f"disagg_min_tokens={self.disagg_min_tokens} must be >= 0")
        if self.disagg_max_prefill_backlog < 0:
            raise ConfigError(f"disagg_max_prefill_backlog={self.disagg_max_prefill_backlog} "
                              "must be >= 0 (0: prompts wait for a prefill replica however "
                              "long its backlog)")
        if self.disagg_idle_s < 0:
            raise ConfigError(f"disagg_idle_s={self.disagg_idle_s} must be >= 0 (0: "
                              "disaggregation never steps aside)")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy {self.policy!r} is unknown; use one of "
                              f"{', '.join(POLICIES)}")
        if min(self.max_tries, self.max_queue, self.max_in_flight, self.max_early_deaths) < 1:
            raise ConfigError("max_tries, max_queue, max_in_flight and max_early_deaths must "
                              "be at least 1")
        for name in ("backoff_s", "probe_interval_s", "events_interval_s", "eject_s",
                     "hold_timeout_s", "restart_backoff_s", "replica_timeout_s"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
