"""The all-reduce's two transports (ember/distributed/allreduce.py) in real process groups.

Reference: the sum of known per-rank tensors, added in rank order 0..T-1 in float32 and
rounded once to the dtype, computed here; shared memory and gloo must both equal it bit for
bit, on every rank. Processes are spawned (gloo over a file store); a dead or silent peer
must make the survivor raise, never hang.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.distributed.allreduce import make_all_reduce
from ember.distributed.collectives import ShmSteps, gather_through_shm
from ember.kernels import build_cpu_ops

SLOT = 4096   # a small slot: float32 tensors above 1024 elements go in chunks
# (numel, dtype): 1 element up to several slots, and one above the default slot (1 MiB)
CASES = [(n, dtype) for dtype in (torch.float32, torch.bfloat16)
         for n in (1, 7, 576, 1024, 1025, 576 * 8, 576 * 32)]
LARGE = [(300_000, torch.float32), (600_001, torch.bfloat16)]
SEQUENCE = (1, 576, 3000)   # back-to-back calls cycle through these sizes (1, 1, 3 chunks)
CALLS = 300


@pytest.fixture(scope="module", autouse=True)
def kernels_built() -> None:
    build_cpu_ops()   # once here, not in every spawned rank; a failed build is a failure


def rank_tensor(rank: int, key: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s known input for case `key`: magnitudes from 1e-3 to 1e3, so that the
    order of addition shows in the rounding, and some subnormal values."""
    g = torch.Generator().manual_seed(7919 * key + rank)
    x = torch.randn(numel, generator=g) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
    x[::17] *= 1e-40
    return x.to(dtype)


def rank_order_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for part in parts[1:]:
        acc = acc + part.float()
    return acc.to(parts[0].dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int32 if a.dtype == torch.float32 else torch.int16
    return a.dtype == b.dtype and torch.equal(a.view(view), b.view(view))


def init_group(rank: int, world_size: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))


def reduce_cases(rank: int, world_size: int, store: str, out_dir: str) -> None:
    init_group(rank, world_size, store)
    shm = make_all_reduce(None, rank, world_size, "shm", slot_bytes=SLOT)
    transports = {"shm": shm, "shm_default_slot": make_all_reduce(None, rank, world_size, "shm"),
                  "gloo": make_all_reduce(None, rank, world_size, "gloo")}
    auto = make_all_reduce(None, rank, world_size, "auto")
    results: dict = {"auto": auto.kind}
    for key, (numel, dtype) in enumerate(CASES + LARGE):
        for name, all_reduce in transports.items():
            x = rank_tensor(rank, key, numel, dtype)
            all_reduce(x)
            results[name, key] = x
    for call in range(CALLS):
        x = rank_tensor(rank, 1000 + call, SEQUENCE[call % 3], torch.bfloat16)
        shm(x)
        results["sequence", call] = x
    fresh = make_all_reduce(None, rank, world_size, "shm", slot_bytes=SLOT)
    try:   # the ranks disagree on the size: each must say so
        fresh(torch.ones(576 + rank))
        results["mismatch"] = ""
    except RuntimeError as e:
        results["mismatch"] = str(e)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3, pytest.param(5, marks=pytest.mark.heavy)])
def test_shm_and_gloo_equal_the_rank_order_sum(tmp_path: Path, world_size: int) -> None:
    mp.spawn(reduce_cases, args=(world_size, str(tmp_path / "store"), str(tmp_path)),
             nprocs=world_size)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for key, (numel, dtype) in enumerate(CASES + LARGE):
        want = rank_order_sum([rank_tensor(r, key, numel, dtype) for r in range(world_size)])
        for rank, got in enumerate(results):
            for name in ("shm", "shm_default_slot", "gloo"):
                assert same_bits(got[name, key], want), f"{name} {numel} {dtype} rank {rank}"
    for call in range(CALLS):
        want = rank_order_sum([rank_tensor(r, 1000 + call, SEQUENCE[call % 3], torch.bfloat16)
                               for r in range(world_size)])
        assert all(same_bits(got["sequence", call], want) for got in results), f"call {call}"
    assert [got["auto"] for got in results] == ["shm"] * world_size
    for got in results:
        assert "same shapes" in got["mismatch"], got["mismatch"]
    if world_size >= 3:   # the inputs tell the orders apart: an unordered sum would fail
        key = CASES.index((576 * 32, torch.float32))
        parts = [rank_tensor(r, key, *CASES[key]) for r in range(world_size)]
        assert not same_bits(rank_order_sum(parts[::-1]), rank_order_sum(parts))


def survive_a_lost_peer(rank: int, store: str, how: str, outcome) -> None:
    init_group(rank, 2, store)
    all_reduce = make_all_reduce(None, rank, 2, "shm", timeout_s=3.0)
    all_reduce(torch.ones(576))   # both ranks are in
    if rank == 1:
        if how == "exit":
            os._exit(0)            # gone without a word, as a crash
        if how == "close":
            all_reduce.close()
        time.sleep(600)            # silent: the test ends it
    errors = []
    for _ in range(2):             # the failure, then a refusal to go on
        try:
            all_reduce(torch.ones(576))
            errors.append("")
        except RuntimeError as e:
            errors.append(str(e))
    outcome.put(errors)


@pytest.mark.parametrize("how", ["exit", "stall", "close"])
def test_a_lost_peer_makes_the_survivor_raise(tmp_path: Path, how: str) -> None:
    ctx = mp.get_context("spawn")
    outcome = ctx.Queue()
    procs = [ctx.Process(target=survive_a_lost_peer, args=(r, str(tmp_path / "store"), how,
                                                           outcome)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        if how == "exit":
            procs[1].join(120)     # reaped: its pid is gone, as a crashed peer's would be
        errors = outcome.get(timeout=300)   # a hang fails here instead of stalling the suite
    finally:
        procs[1].kill()
        for p in procs:
            p.join(60)
    assert errors[0] and "rank 1" in errors[0], errors
    assert "failed before" in errors[1], errors


# -- rank 0's broadcast (the steps' plans) and gather (logits), through the same segment ----

BROADCAST_SIZES = (0, 1, SLOT - 1, SLOT, SLOT + 1, 3 * SLOT + 5)   # below, at, above a slot


def broadcast_bytes(call: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(31 * call + size)
    return torch.randint(0, 256, (size,), generator=g, dtype=torch.uint8)


# (rows, dtype) of rank 0's gather: none, one, and several chunks of rows (a row of the
# widest is 4000 bytes in float32: one row a slot), all interleaved with the calls above
GATHER_CASES = [(0, torch.float32), (1, torch.float32), (3, torch.bfloat16),
                (11, torch.float32), (11, torch.bfloat16)]


def gather_widths(world_size: int) -> list[int]:
    """Uneven widths, as the vocabulary's ranges are: rank r has 1000 - 7 r columns."""
    return [1000 - 7 * r for r in range(world_size)]


def broadcast_cases(rank: int, world_size: int, store: str, out_dir: str) -> None:
    init_group(rank, world_size, store)
    shm = make_all_reduce(None, rank, world_size, "shm", slot_bytes=SLOT)
    nothing = torch.empty(0, dtype=torch.uint8)
    results: dict = {}
    for call in range(CALLS):   # broadcasts and all-reduces interleaved, as steps make them
        size = BROADCAST_SIZES[call % len(BROADCAST_SIZES)]
        sent = broadcast_bytes(call, size) if rank == 0 else nothing
        results["bytes", call] = shm.handle.broadcast(sent, 60.0, 50.0).clone()
        x = rank_tensor(rank, 2000 + call, SEQUENCE[call % 3], torch.float32)
        shm(x)
        results["sum", call] = x
        rows, dtype = GATHER_CASES[call % len(GATHER_CASES)]
        widths = gather_widths(world_size)
        local = rank_tensor(rank, 3000 + call, rows * widths[rank], dtype)
        local = local.view(rows, widths[rank])
        out = torch.empty((rows, sum(widths)), dtype=dtype) if rank == 0 else \
            torch.empty((0, 0))
        shm.handle.gather(local, out, max(widths), 60.0, 50.0)
        results["gather", call] = out
    steps = ShmSteps(shm.handle, 60.0, owned=False)
    for i in range(20):   # pickles from ~100 bytes to several slots
        obj = {"step": i, "token_ids": list(range(i * 200))}
        results["object", i] = pass_step(steps, rank, obj)
    for wide in (False, True):   # a row of the widest within a slot (copied), or not (summed)
        widths = [w + (SLOT // 4 if wide else 0) for w in gather_widths(world_size)]
        gather = gather_through_shm(shm, rank, widths)
        local = rank_tensor(rank, 4000 + wide, 3 * widths[rank], torch.bfloat16)
        results["gather_through_shm", wide] = gather(local.view(3, widths[rank]))
    fresh = make_all_reduce(None, rank, world_size, "shm", slot_bytes=SLOT)
    try:   # rank 1 sends another dtype: rank 0 must say so
        local = torch.ones((2, 10), dtype=torch.bfloat16 if rank == 1 else torch.float32)
        out = torch.empty((2, 10 * world_size)) if rank == 0 else torch.empty((0, 0))
        fresh.handle.gather(local, out, 10, 60.0, 50.0)
        results["mismatch"] = ""
    except RuntimeError as e:
        results["mismatch"] = str(e)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_broadcast_and_gather_move_every_ranks_bytes_in_order(tmp_path: Path, world_size: int):
    mp.spawn(broadcast_cases, args=(world_size, str(tmp_path / "store"), str(tmp_path)),
             nprocs=world_size)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    for call in range(CALLS):
        want = broadcast_bytes(call, BROADCAST_SIZES[call % len(BROADCAST_SIZES)])
        want_sum = rank_order_sum([rank_tensor(r, 2000 + call, SEQUENCE[call % 3],
                                               torch.float32) for r in range(world_size)])
        for rank, got in enumerate(results):
            assert torch.equal(got["bytes", call], want), f"call {call} rank {rank}"
            assert same_bits(got["sum", call], want_sum), f"call {call} rank {rank}"
        rows, dtype = GATHER_CASES[call % len(GATHER_CASES)]
        widths = gather_widths(world_size)
        want_gather = torch.cat([rank_tensor(r, 3000 + call, rows * widths[r], dtype)
                                 .view(rows, widths[r]) for r in range(world_size)], dim=1)
        assert same_bits(results[0]["gather", call], want_gather), f"gather call {call}"
    for i in range(20):
        want = {"step": i, "token_ids": list(range(i * 200))}
        assert all(got["object", i] == want for got in results), i
    assert "rank 1 sent" in results[0]["mismatch"], results[0]["mismatch"]
    for wide in (False, True):
        widths = [w + (SLOT // 4 if wide else 0) for w in gather_widths(world_size)]
        want = torch.cat([rank_tensor(r, 4000 + wide, 3 * widths[r], torch.bfloat16)
                          .view(3, widths[r]) for r in range(world_size)], dim=1)
        if wide:   # a sum with zeros: the same values, but -0.0 becomes +0.0
            want = (want.float() + 0.0).to(torch.bfloat16)
        assert same_bits(results[0]["gather_through_shm", wide], want), wide
        assert all(got["gather_through_shm", wide].shape == (3, 0) for got in results[1:])


def pass_step(steps: ShmSteps, rank: int, obj: object) -> object:
    """Rank 0 sends `obj`, another rank receives what rank 0 sends; both return it."""
    if rank == 0:
        steps.send(obj)
        return obj
    return steps.receive()


def lose_a_broadcast_peer(rank: int, store: str, lost: int, how: str, outcome) -> None:
    """Rank `lost` goes (`how`) after one step; the other, rank 0 sending or rank 1 waiting
    for its next step (with no time limit, as an idle worker), must raise."""
    init_group(rank, 2, store)
    steps = ShmSteps(make_all_reduce(None, rank, 2, "shm", timeout_s=3.0).handle, 3.0,
                     owned=True)
    pass_step(steps, rank, "first")
    if rank == lost:
        if how == "exit":
            os._exit(0)
        if how == "close":
            steps.close()
        time.sleep(600)
    errors = []
    for _ in range(4):   # rank 0 writes on until a buffer the lost rank has not read
        try:
            pass_step(steps, rank, "next")
        except RuntimeError as e:
            errors.append(str(e))
    outcome.put(errors)


@pytest.mark.parametrize("lost,how", [(0, "exit"), (0, "close"), (1, "exit"), (1, "stall"),
                                      (1, "close")])
def test_a_lost_peer_ends_the_broadcast(tmp_path: Path, lost: int, how: str) -> None:
    ctx = mp.get_context("spawn")
    outcome = ctx.Queue()
    procs = [ctx.Process(target=lose_a_broadcast_peer,
                         args=(r, str(tmp_path / "store"), lost, how, outcome))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        errors = outcome.get(timeout=300)   # a hang fails here instead of stalling the suite
    finally:
        procs[lost].kill()
        for p in procs:
            p.join(60)
    assert errors and f"rank {lost}" in errors[0], errors
    assert all("failed before" in e for e in errors[1:]), errors
