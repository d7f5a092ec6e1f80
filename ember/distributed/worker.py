"""A worker rank of a model split over ranks: ranks 1..T*P-1, as a local process
(ember/distributed/executor.py starts it) or in a Ray actor (ray_executor.py).

It binds to its CPUs, builds its part of the model, says it is ready, joins the ranks'
group and then runs each step the driver broadcasts, until the driver says stop (None) or
goes away (a collective raises: a process exits 1, an actor's call fails).
"""
from __future__ import annotations

import json
import logging
import pickle
import sys
import traceback

import torch

from ember.distributed.collectives import (HOST, IDLE_WAIT, GlooSteps, RankCollectives,
                                           ShmSteps, join_groups, join_store)
from ember.distributed.executor import WorkerPayload, pin_process, received_step
from ember.runner.runner import ModelRunner

log = logging.getLogger(__name__)


def main() -> None:
    """A local worker process: its payload on stdin."""
    payload: WorkerPayload = pickle.load(sys.stdin.buffer)
    logging.basicConfig(level=payload.log_level, stream=sys.stderr,
                        format=f"rank {payload.rank}: %(levelname)s %(name)s: %(message)s")
    try:
        run_worker(payload, HOST)
    except Exception as e:  # noqa: BLE001 - the driver went away, a step or loading failed
        log.error("stopping: %s", e)
        sys.exit(1)


def run_worker(payload: WorkerPayload, host: str) -> None:
    """Load this rank's part and serve the driver's steps until it says stop; raises where
    loading (reported to the driver through the store first) or a step fails. `host`: this
    rank's address the other ranks reach it at."""
    rank = payload.rank
    if payload.cpus:
        pin_process(payload.cpus)
    else:
        torch.set_num_threads(payload.num_threads)
    store = join_store(payload.port, payload.world_size, IDLE_WAIT.total_seconds(),
                       payload.store_host)
    collectives = RankCollectives()
    try:
        runner = payload.build(payload.setup, rank, collectives)
    except Exception as e:
        log.error("loading failed", exc_info=e)
        store.set(f"error/{rank}", "".join(traceback.format_exception_only(e)).strip())
        raise
    if runner.kv_shared is not None:   # the driver maps this rank's KV cache
        store.set(f"kv/{rank}", json.dumps(runner.kv_shared.describe()))
    store.set(f"ready/{rank}", "1")
    # waits as long as the driver may idle: the driver's own timeout bounds a step
    steps, _ = join_groups(store, rank, payload.stage_size,
                           payload.world_size // payload.stage_size, IDLE_WAIT,
                           payload.all_reduce, payload.timeout_s, list(payload.vocab_widths),
                           collectives, host)
    serve_steps(steps, runner)


def serve_steps(steps: GlooSteps | ShmSteps, runner: ModelRunner) -> None:
    """Run the driver's steps until it sends None."""
    while True:
        step = steps.receive()
        if step is None:
            return
        runner.run_step(received_step(step))
