"""`ember bench peers`: repeats are pairs of fresh requests, run in alternating order, and
ember's ratio to a peer is taken within each pair."""
from __future__ import annotations

import argparse

import pytest

from ember.bench.peers import paired_ratios, parse_peers, repeat_args, run_order


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
