"""`ember bench peers`: repeats are pairs of fresh requests, run in alternating order, and
ember's ratio to a peer is taken within each pair."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ember.bench.peers import (Server, paired_ratios, parse_peers, repeat_args, run_order,
                               settle)


def test_each_repeat_has_its_own_seed_and_the_options_are_not_changed():
    args = argparse.Namespace(seed=7, concurrency=32)
    assert [repeat_args(args, r).seed for r in range(3)] == [7, 8, 9]
    assert repeat_args(args, 2).concurrency == 32 and args.seed == 7
    assert repeat_args(argparse.Namespace(seed=None), 3).seed is None


def test_the_order_alternates_so_neither_side_always_runs_first():
    names = ["ember", "vllm", "llama"]
    assert run_order(names, 0) == names
    assert run_order(names, 1) == ["llama", "vllm", "ember"]
    assert run_order(names, 2) == names


def test_ratios_are_taken_pair_by_pair_and_their_median_reported():
    runs = {"ember": [{"output_tok_per_s": 400.0}, {"output_tok_per_s": 300.0},
                      {"output_tok_per_s": 500.0}],
            "vllm": [{"output_tok_per_s": 200.0}, {"output_tok_per_s": 200.0},
                     {"output_tok_per_s": 200.0}]}
    paired = paired_ratios(runs)
    assert paired["vllm"]["ratios"] == [2.0, 1.5, 2.5]
    assert paired["vllm"]["median"] == 2.0 and "ember" not in paired


@pytest.mark.parametrize("specs", [["ember=serve --port {port}"],
                                   ["a=serve {port}", "a=other {port}"],
                                   ["no-command"]])
def test_a_peer_needs_a_name_of_its_own_and_a_command(specs):
    with pytest.raises(SystemExit, match="--peer-cmd"):
        parse_peers(specs)


SPIN_THEN_IDLE = """
import sys, time
n = 0
while n < 30_000_000:   # about a second of a core, then idle
    n += 1
open(sys.argv[1], "w").write("spun")
time.sleep(120)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux /proc")
def test_settle_waits_for_a_ready_server_still_at_work_to_go_idle(tmp_path):
    """A server that keeps a core busy after it is ready (as ember faulting its KV cache in)
    is waited for: settle returns once it has gone idle, not before; one that never does
    makes settle give up at its timeout."""
    marker = tmp_path / "spun"
    spinner = subprocess.Popen([sys.executable, "-c", SPIN_THEN_IDLE, str(marker)])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert settle([Server("spins", "", 0, spinner)], timeout_s=120, window_s=0.5)
        assert marker.read_text() == "spun"
        assert not settle([Server("busy", "", 0, busy)], timeout_s=2, window_s=0.5)
    finally:
        for p in (spinner, busy):
            p.kill()
            p.wait()
