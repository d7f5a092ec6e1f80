"""A worker process of a model split over ranks: ranks 1..T*P-1
(ember/distributed/executor.py starts it).

It binds to its CPUs, builds its part of the model, says it is ready, joins the ranks'
group and then runs each step the driver broadcasts, until the driver says stop (None) or
goes away (a collective raises, and the process exits 1).
"""
from __future__ import annotations

import logging
import pickle
import sys
import traceback

from ember.distributed.collectives import (IDLE_WAIT, RankCollectives, join_groups, join_store,
                                           receive_object)
from ember.distributed.executor import WorkerPayload, pin_process
from ember.runner.runner import ModelRunner

log = logging.getLogger(__name__)


def main() -> None:
    payload: WorkerPayload = pickle.load(sys.stdin.buffer)
    rank = payload.rank
    logging.basicConfig(level=payload.log_level, stream=sys.stderr,
                        format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    pin_process(payload.cpus)
    store = join_store(payload.port, payload.world_size, IDLE_WAIT.total_seconds())
    collectives = RankCollectives()
    try:
        runner = payload.build(payload.setup, rank, collectives)
    except Exception as e:  # noqa: BLE001 - the driver reports it and fails the start
        log.error("loading failed", exc_info=e)
        store.set(f"error/{rank}", "".join(traceback.format_exception_only(e)).strip())
        sys.exit(1)
    store.set(f"ready/{rank}", "1")
    # waits as long as the driver may idle: the driver's own timeout bounds a step
    group, _ = join_groups(store, rank, payload.stage_size,
                           payload.world_size // payload.stage_size, IDLE_WAIT,
                           payload.all_reduce, payload.timeout_s, list(payload.vocab_widths),
                           collectives)
    try:
        serve_steps(group, runner)
    except Exception as e:  # noqa: BLE001 - the driver went away or a step failed
        log.error("stopping: %s", e)
        sys.exit(1)


def serve_steps(group, runner: ModelRunner) -> None:
    """Run the driver's steps until it broadcasts None."""
    while True:
        step = receive_object(group)
        if step is None:
            return
        runner.run_step(step)
