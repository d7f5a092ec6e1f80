"""Which replica takes a request: pure functions over a snapshot of the candidates.

The gateway builds one `Candidate` per routable replica (its in-flight count, the replica's
own queue and KV usage, and how many leading blocks of this prompt it holds), calls `pick`,
and raises the chosen replica's in-flight count before anything else runs, so a burst of
decisions sees each other.
"""
from __future__ import annotations

import hashlib
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass

from ember.router.config import PrefixConfig


@dataclass(frozen=True)
class Candidate:
    id: str
    in_flight: int          # the gateway's requests on it
    waiting: int = 0        # its own queue (from its metrics)
    kv_usage: float = 0.0   # fraction of its KV cache in use
    matched_blocks: int = 0  # leading blocks of this prompt it holds


@dataclass(frozen=True)
class Decision:
    replica_id: str
    reason: str             # why: round_robin, least_load, session, prefix_hit, ...
    matched_blocks: int = 0


def saturated(c: Candidate, cfg: PrefixConfig) -> bool:
    return c.waiting > cfg.max_waiting or c.kv_usage > cfg.max_kv_usage


def least_load(cands: list[Candidate]) -> Decision:
    best = min(cands, key=lambda c: (c.in_flight + c.waiting, c.id))
    return Decision(best.id, "least_load", best.matched_blocks)


def round_robin(cands: list[Candidate], turn: int) -> Decision:
    chosen = sorted(cands, key=lambda c: c.id)[turn % len(cands)]
    return Decision(chosen.id, "round_robin", chosen.matched_blocks)


def session(cands: list[Candidate], key: str | None) -> Decision:
    """Rendezvous hashing on the session key: a session stays on its replica while that one
    is routable, and only the sessions of a replica that leaves move. No key: least load."""
    if not key:
        return Decision(least_load(cands).replica_id, "session_fallback")

    def weight(c: Candidate) -> bytes:
        return hashlib.blake2b(f"{key}\x00{c.id}".encode(), digest_size=8).digest()
    return Decision(max(cands, key=weight).id, "session")


def prefix(cands: list[Candidate], num_blocks: int, cfg: PrefixConfig,
           recent: Mapping[str, int] | None = None) -> Decision:
    """Cost = blocks still to prefill + load_weight x in-flight, over the replicas that pass
    the saturation filter (all of them, if none does) and the imbalance guards: in-flight
    counts, then `recent` (requests routed to each replica over the last decisions)."""
    pool = [c for c in cands if not saturated(c, cfg)]
    reason = "prefix"
    if not pool:
        pool, reason = cands, "all_saturated"
    guarded = _less_loaded(pool, {c.id: c.in_flight for c in pool}, cfg.imbalance_abs,
                           cfg.imbalance_rel)
    if guarded is not None:
        return _longest_prefix(guarded, "imbalance")
    if recent is not None:
        guarded = _less_loaded(pool, {c.id: recent.get(c.id, 0) for c in pool},
                               cfg.share_abs, cfg.share_rel)
        if guarded is not None:
            return _longest_prefix(guarded, "share_imbalance")

    def cost(c: Candidate) -> tuple[float, str]:
        return (num_blocks - c.matched_blocks) + cfg.load_weight * c.in_flight, c.id
    best = min(pool, key=cost)
    if reason == "prefix":
        reason = "prefix_hit" if best.matched_blocks else "prefix_miss"
    return Decision(best.id, reason, best.matched_blocks)


def _less_loaded(pool: list[Candidate], load: dict[str, int], over_abs: int,
                 over_rel: float) -> list[Candidate] | None:
    """Where max - min load > over_abs and max > over_rel x min: the candidates at or below
    the middle; else None."""
    low, high = min(load.values()), max(load.values())
    if high - low > over_abs and high > over_rel * low:
        return [c for c in pool if load[c.id] <= (high + low) / 2]
    return None


def _longest_prefix(pool: list[Candidate], reason: str) -> Decision:
    best = max(pool, key=lambda c: (c.matched_blocks, -c.in_flight, c.id))
    return Decision(best.id, reason, best.matched_blocks)


class Picker:
    """A policy by name, with the little state one keeps (round-robin's turn, the prefix
    policy's last decisions)."""

    def __init__(self, policy: str, cfg: PrefixConfig) -> None:
        self.policy = policy
        self.cfg = cfg
        self.turn = 0
        self.last: deque[str] = deque(maxlen=cfg.share_window)
        self.routed: Counter[str] = Counter()   # replica id -> its decisions among `last`

    def pick(self, cands: list[Candidate], num_blocks: int = 0,
             session_key: str | None = None) -> Decision:
        if not cands:
            raise ValueError("no candidate replica")
        if self.policy == "round-robin":
            self.turn += 1
            return round_robin(cands, self.turn - 1)
        if self.policy == "least-load":
            return least_load(cands)
        if self.policy == "session":
            return session(cands, session_key)
        decision = prefix(cands, num_blocks, self.cfg,
                          self.routed if self.cfg.share_window else None)
        self._note(decision.replica_id)
        return decision

    def _note(self, replica_id: str) -> None:
        if self.cfg.share_window == 0:
            return
        if len(self.last) == self.last.maxlen:
            gone = self.last[0]
            self.routed[gone] -= 1
            if not self.routed[gone]:
                del self.routed[gone]
        self.last.append(replica_id)
        self.routed[replica_id] += 1
