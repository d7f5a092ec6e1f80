"""The grammar compiler's bounds: a cache of at most N compiled grammars (least recently used
out first), a time limit per compile, shared compiles for one key, and a cap on queued work.

Reference: the behaviour of an LRU cache and of a deadline, on a fake compile function whose
progress the test controls (a gate), so nothing depends on how fast this machine is.
"""
from __future__ import annotations

import asyncio
import threading

import pytest

from ember.errors import InvalidRequest, Overloaded
from ember.sampling.grammar import BoundedCompiler


class FakeCompile:
    """Returns key * 10; blocks on `gate` when one is given; counts its calls."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls: list[int] = []
        self.started = threading.Event()

    def __call__(self, key: int) -> int:
        self.calls.append(key)
        self.started.set()
        if self.gate is not None:
            self.gate.wait(30)
        if key < 0:
            raise InvalidRequest("negative keys do not compile")
        return key * 10


def test_cache_keeps_the_most_recently_used():
    fn = FakeCompile()
    c = BoundedCompiler(fn, timeout_s=30, cache_size=3)
    assert [c.compile(k) for k in range(5)] == [0, 10, 20, 30, 40]
    assert len(c) == 3 and all(k in c for k in (2, 3, 4)) and 0 not in c
    assert c.compile(2) == 20 and fn.calls == [0, 1, 2, 3, 4]  # cached: no new compile
    assert c.compile(0) == 0 and fn.calls[-1] == 0             # evicted: compiled again
    assert len(c) == 3 and all(k in c for k in (4, 2, 0)) and 3 not in c  # 3 was least recent


def test_failures_are_not_cached():
    fn = FakeCompile()
    c = BoundedCompiler(fn, timeout_s=30, cache_size=3)
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="negative"):
            c.compile(-1)
    assert fn.calls == [-1, -1] and len(c) == 0


def test_a_compile_past_the_time_limit_is_refused_then_finishes_and_is_kept():
    gate = threading.Event()
    fn = FakeCompile(gate)
    c = BoundedCompiler(fn, timeout_s=0.01, cache_size=3)
    try:
        with pytest.raises(InvalidRequest, match=r"took longer than 0.01 s to compile; simplify"):
            c.compile(7, "JSON schema")
        with pytest.raises(InvalidRequest, match="JSON schema took longer"):
            asyncio.run(c.compile_async(7, "JSON schema"))
        # the second caller joined the compile already running
        assert fn.started.wait(30) and fn.calls == [7]
    finally:
        gate.set()
    c.timeout_s = 30
    assert c.compile(7) == 70 and fn.calls == [7]


def test_runaway_compiles_hold_only_the_compile_threads_and_queue_is_capped():
    gate = threading.Event()
    fn = FakeCompile(gate)
    c = BoundedCompiler(fn, timeout_s=0.01, cache_size=3, max_workers=1, max_pending=2)
    try:
        for key in (1, 2):
            with pytest.raises(InvalidRequest, match="took longer"):
                c.compile(key)
        with pytest.raises(Overloaded, match="2 grammars are compiling"):
            c.compile(3)
        # one worker: key 2 is still queued behind the runaway key 1
        assert fn.started.wait(30) and fn.calls == [1]
    finally:
        gate.set()
    c.timeout_s = 30
    assert [c.compile(k) for k in (1, 2, 3)] == [10, 20, 30] and fn.calls == [1, 2, 3]
