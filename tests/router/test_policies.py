"""Routing policies over fake replica snapshots: no process, no HTTP."""
from __future__ import annotations

from collections import Counter

from ember.router.config import PrefixConfig
from ember.router.policies import Candidate, Picker, prefix, round_robin, session

CFG = PrefixConfig()


def cands(*loads: int, matched: tuple[int, ...] = (), waiting: tuple[int, ...] = (),
          kv: tuple[float, ...] = ()) -> list[Candidate]:
    return [Candidate(f"r{i}", load, waiting[i] if waiting else 0, kv[i] if kv else 0.0,
                      matched[i] if matched else 0) for i, load in enumerate(loads)]


def test_round_robin_cycles_through_every_replica():
    picker = Picker("round-robin", CFG)
    got = [picker.pick(cands(0, 0, 0)).replica_id for _ in range(6)]
    assert got == ["r0", "r1", "r2", "r0", "r1", "r2"]
    assert round_robin(cands(5, 0), 1).reason == "round_robin"


def test_least_load_counts_in_flight_and_queue():
    picker = Picker("least-load", CFG)
    assert picker.pick(cands(3, 1, 2)).replica_id == "r1"
    assert picker.pick(cands(1, 1, waiting=(0, 4))).replica_id == "r0"


def test_session_is_sticky_and_moves_only_the_sessions_of_a_replica_that_left():
    three = cands(0, 0, 0)
    before = {f"user{i}": session(three, f"user{i}").replica_id for i in range(300)}
    assert all(session(three, k).replica_id == v for k, v in before.items())
    spread = Counter(before.values())
    assert set(spread) == {"r0", "r1", "r2"} and min(spread.values()) > 60
    two = [c for c in three if c.id != "r2"]
    after = {k: session(two, k).replica_id for k in before}
    moved = {k for k in before if before[k] != after[k]}
    assert moved == {k for k, v in before.items() if v == "r2"}


def test_session_without_a_key_falls_back_to_least_load():
    d = session(cands(4, 1), None)
    assert (d.replica_id, d.reason) == ("r1", "session_fallback")


def test_prefix_prefers_the_replica_holding_the_prompt():
    d = prefix(cands(2, 0, matched=(60, 0)), num_blocks=62, cfg=CFG)
    assert (d.replica_id, d.reason, d.matched_blocks) == ("r0", "prefix_hit", 60)


def test_prefix_weighs_load_against_blocks_to_prefill():
    # r0 holds 10 of 12 blocks but has 5 in flight: 2 + 4*5 = 22 > 12 + 0
    assert prefix(cands(5, 0, matched=(10, 0)), 12, CFG).replica_id == "r1"
    assert prefix(cands(1, 0, matched=(10, 0)), 12, CFG).replica_id == "r0"


def test_imbalance_guard_restricts_to_the_less_loaded_then_longest_prefix():
    # max - min = 12 > 8 and 14 > 1.5 * 2: r0 (the hot prefix) is out
    d = prefix(cands(14, 2, 3, matched=(60, 5, 20)), 62, CFG)
    assert (d.replica_id, d.reason) == ("r2", "imbalance")


def test_saturated_replicas_are_filtered_and_the_filter_fails_open():
    d = prefix(cands(0, 0, matched=(60, 0), waiting=(6, 0)), 62, CFG)
    assert d.replica_id == "r1"
    d = prefix(cands(0, 0, matched=(60, 0), kv=(0.9, 0.1)), 62, CFG)
    assert d.replica_id == "r1"
    d = prefix(cands(0, 0, matched=(60, 0), kv=(0.9, 0.95)), 62, CFG)
    assert (d.replica_id, d.reason) == ("r0", "all_saturated")


def test_a_burst_of_one_prefix_spreads_once_in_flight_is_raised_at_decision():
    """Each decision raises the chosen replica's count before the next one is taken (as the
    fleet does): a burst of 16 equal prompts starts on the replica with the prefix and
    overflows to the other once it is loaded, instead of all 16 landing on one."""
    loads = {"r0": 0, "r1": 0}
    matched = {"r0": 30, "r1": 0}
    picks = []
    for _ in range(16):
        snapshot = [Candidate(i, loads[i], 0, 0.0, matched[i]) for i in loads]
        d = prefix(snapshot, 32, CFG)
        loads[d.replica_id] += 1
        picks.append(d.replica_id)
    assert picks[0] == "r0" and "r1" in picks
    assert max(loads.values()) - min(loads.values()) <= CFG.imbalance_abs


def test_share_guard_spreads_tenants_that_all_sit_on_one_replica():
    """Few tenants whose prefixes all sit on r0, at a concurrency the in-flight guard never
    notices (in-flight equal): the share guard moves requests until the recent split is
    within its bounds, and takes the longest prefix among the less used replicas."""
    picker = Picker("prefix", CFG)
    picked = [picker.pick(cands(1, 1, matched=(10, 0)), num_blocks=12) for _ in range(256)]
    split = Counter(d.replica_id for d in picked)
    assert max(split.values()) / min(split.values()) <= 1.5   # the whole run's skew
    window = sorted(picker.routed.values())   # the last 64: one step (a decision in, an
    # older one out: 2) past the guard at most
    assert sum(window) == CFG.share_window
    assert window[1] - window[0] <= CFG.share_abs + 2 or \
        window[1] <= CFG.share_rel * window[0] + 2
    assert {d.reason for d in picked} == {"prefix_hit", "share_imbalance"}
    assert all(d.replica_id == "r1" for d in picked if d.reason == "share_imbalance")
    # among the less used replicas, the one holding more of the prompt
    shares = {"r0": 40, "r1": 10, "r2": 10}
    got = prefix(cands(1, 1, 1, matched=(9, 2, 5)), 12, CFG, shares)
    assert (got.replica_id, got.reason) == ("r2", "share_imbalance")


def test_share_guard_leaves_a_balanced_split_to_the_prefix_cost():
    got = prefix(cands(1, 1, matched=(0, 10)), 12, CFG, {"r0": 30, "r1": 34})
    assert (got.replica_id, got.reason) == ("r1", "prefix_hit")
    picker = Picker("prefix", PrefixConfig(share_window=0))   # off
    assert {picker.pick(cands(1, 1, matched=(10, 0)), 12).replica_id
            for _ in range(100)} == {"r0"}
