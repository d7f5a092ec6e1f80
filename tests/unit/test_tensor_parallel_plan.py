"""How tensor and pipeline parallel split a model and a machine (ember/distributed/
parallel.py), against the split written out by hand; and the start-up errors that name the
numbers."""
from __future__ import annotations

import pickle
from dataclasses import fields, replace

import pytest
import torch

from ember.cli import build_parser, engine_config
from ember.config import EngineConfig, ModelConfig, ParallelConfig, parse_cpu_bind
from ember.distributed.executor import TokenWindow, received_step, step_message
from ember.distributed.parallel import (describe_shards, even_ranges, plan_shards, plan_stages,
                                        rank_cpus, ray_rank_cpus, split_heads)
from ember.errors import ConfigError
from ember.models.parallel import argmax_columns, pick_argmax
from ember.request import SHARE_KEYS, Request, SamplingParams, share_key
from ember.runner.inputs import micro_batches, prepare_inputs
from ember.runner.runner import ForwardStep, PipelineBubble
from ember.scheduler.output import ScheduledRequest, SchedulerOutput

SMOLLM = ModelConfig(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                     intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                     head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position_embeddings=8192, tie_word_embeddings=True)


def test_kv_heads_that_do_not_divide_are_held_by_the_ranks_on_both_sides_of_a_cut():
    # 3 KV heads cut at 1.5: KV head 1 (query heads 3-5) on both ranks
    assert split_heads(9, 3, 2) == [((0, 6), (0, 2)), ((3, 9), (1, 3))]
    # 5 over 3, cut at 5/3 and 10/3: heads 1 and 3 on two ranks each
    assert split_heads(10, 5, 3) == [((0, 4), (0, 2)), ((2, 8), (1, 4)), ((6, 10), (3, 5))]
    # dividing: a share each, none held twice
    assert split_heads(9, 3, 3) == [((0, 3), (0, 1)), ((3, 6), (1, 2)), ((6, 9), (2, 3))]
    assert split_heads(8, 4, 2) == [((0, 4), (0, 2)), ((4, 8), (2, 4))]


@pytest.mark.parametrize("kv_heads, ranks", [(3, 2), (5, 2), (5, 3), (5, 4), (7, 3)])
def test_each_request_attends_a_shared_kv_head_on_one_rank_and_the_ranks_even_out(kv_heads,
                                                                                   ranks):
    """Over every share key: each KV head attended for a request by exactly one of the
    ranks holding it (HeadShare.skip_bits), every rank attending K / T heads' worth on
    average (the cut's length), and no shares where the heads divide."""
    config = replace(SMOLLM, num_heads=2 * kv_heads, num_kv_heads=kv_heads)
    shares = [s.head_share() for s in plan_shards(config, ranks)]
    assert all(share is not None for share in shares)
    attended = [0] * ranks
    keys = range(0, SHARE_KEYS, 3)
    for key in keys:
        per_head = [0] * kv_heads
        for share in shares:
            bits = share.skip_bits(key)
            for i in range(share.kv_count):
                if not bits >> i & 1:
                    per_head[share.kv_first + i] += 1
                    attended[share.rank] += 1
        assert per_head == [1] * kv_heads
    assert [a / len(keys) for a in attended] == pytest.approx([kv_heads / ranks] * ranks,
                                                              rel=1e-3)
    assert all(s.head_share() is None for s in plan_shards(SMOLLM, 3))
    assert all(s.head_share() is None for s in plan_shards(SMOLLM, 4))   # (more ranks)


def test_a_requests_rank_for_the_shared_head_follows_its_prompt_alone():
    share = plan_shards(SMOLLM, 2)[1].head_share()
    first = Request("a", [5, 6, 7], SamplingParams(max_tokens=4), frozenset(), 4)
    again = Request("b", [5, 6, 7], SamplingParams(max_tokens=9), frozenset(), 9)
    assert first.share_key == again.share_key == share_key([5, 6, 7])
    # about half the prompts to each rank
    keys = [share_key([i, i + 1]) for i in range(2000)]
    assert 0.45 < sum(share.skip_bits(k) == 0 for k in keys) / len(keys) < 0.55


def test_more_ranks_than_kv_heads_replicate_a_kv_head_over_its_group():
    # 4 ranks over 3 groups of 3: group 0 split 2 + 1 over ranks 0-1, then a group a rank
    assert split_heads(9, 3, 4) == [((0, 2), (0, 1)), ((2, 3), (0, 1)), ((3, 6), (1, 2)),
                                    ((6, 9), (2, 3))]
    # every query head lands on exactly one rank, with its own KV head
    for q, kv in split_heads(12, 2, 5):
        assert all(h // 6 == kv[0] for h in range(*q)) and kv[1] - kv[0] == 1


def test_more_ranks_than_query_heads_is_an_error_naming_both():
    with pytest.raises(ConfigError, match="tensor_parallel_size=10 exceeds the model's 9 "
                                          "query heads"):
        split_heads(9, 3, 10)


def test_mlp_columns_and_vocabulary_split_in_whole_units():
    # 1536 columns = 48 units of 32 over 5 ranks, 49152 rows = 3072 units of 16: contiguous
    # and whole, however the heads weigh
    for shards in (plan_shards(SMOLLM, 5), plan_shards(replace(SMOLLM, num_heads=10,
                                                               num_kv_heads=5), 5)):
        for ranges, unit, total in (([s.intermediate for s in shards], 32, 1536),
                                    ([s.vocab for s in shards], 16, 49152)):
            assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]]
            assert ranges[-1][1] == total
            assert all((b - a) % unit == 0 and b > a for a, b in ranges)
    # heads even over 5 ranks: the even split, 10 + 10 + 10 + 9 + 9 units
    even = plan_shards(replace(SMOLLM, num_heads=10, num_kv_heads=5), 5)
    assert [b - a for a, b in (s.intermediate for s in even)] == [320, 320, 320, 288, 288]
    assert even_ranges(5, 2) == [(0, 3), (3, 5)]


def _reads(q_heads: int, kv_heads: int, columns: int, rows: int) -> int:
    """The default model's weights a rank reads per decoded token, written out: 30 layers of
    q + o (576 x 64 each per query head), k + v (576 x 64 each per KV head), gate + up +
    down (576 each per column), then 576 per output-projection row."""
    return 30 * (2 * 576 * 64 * q_heads + 2 * 576 * 64 * kv_heads + 3 * 576 * columns) + \
        576 * rows


def test_uneven_heads_get_columns_and_rows_that_even_out_each_ranks_reads():
    """10 query heads, 5 KV heads over 3 ranks: 4, 6 and 4 query heads (2, 3, 2 KV heads),
    so rank 1 takes the fewest MLP columns and the reads even out within a row unit; the
    default model over 2 ranks holds 6 query and 2 KV heads on each, and keeps the even
    split."""
    config = replace(SMOLLM, num_heads=10, num_kv_heads=5)
    shards = plan_shards(config, 3)
    reads = [_reads(q1 - q0, k1 - k0, c1 - c0, v1 - v0)
             for (q0, q1), (k0, k1), (c0, c1), (v0, v1)
             in ((s.q_heads, s.kv_heads, s.intermediate, s.vocab) for s in shards)]
    assert max(reads) - min(reads) <= 576 * 16
    columns = [b - a for a, b in (s.intermediate for s in shards)]
    assert columns[1] < columns[0] and columns[1] < columns[2]
    shards = plan_shards(SMOLLM, 2)
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]
    assert shards[0].max_vocab_rows == 24576
    assert _reads(6, 2, 768, 24576) == 71_663_616
    assert "rank 0: query heads 0-5, KV heads 0-1, MLP columns 0-767, vocabulary 0-24575, " \
        "71.7M parameters read a token; rank 1: query heads 3-8, KV heads 1-2, MLP columns " \
        "768-1535, vocabulary 24576-49151, 71.7M" in describe_shards(shards, SMOLLM)


def test_whole_groups_get_columns_and_rows_that_even_out_each_ranks_reads():
    """kv_head_split "groups" on the default model over 2 ranks: 6 + 3 query heads, 2 + 1
    KV heads, none shared. The even split (768 + 768 columns, 24,576 + 24,576 rows) has rank
    0 read 53% of the weights; moving 3 column units and 60 row units to rank 1 and back
    evens them exactly, at fewer weights a rank than the shared head's 71.7M."""
    assert split_heads(9, 3, 2, shared=False) == [((0, 6), (0, 2)), ((6, 9), (2, 3))]
    assert _reads(6, 2, 768, 24576) / (_reads(6, 2, 768, 24576) + _reads(3, 1, 768, 24576)) \
        == pytest.approx(0.533, abs=1e-3)
    shards = plan_shards(SMOLLM, 2, share_kv_heads=False)
    assert all(s.head_share() is None for s in shards)
    assert [s.intermediate for s in shards] == [(0, 672), (672, 1536)]
    assert [s.vocab for s in shards] == [(0, 25536), (25536, 49152)]
    assert _reads(6, 2, 672, 25536) == _reads(3, 1, 864, 23616) == 67_239_936
    assert "rank 1: query heads 6-8, KV heads 2, MLP columns 672-1535, vocabulary " \
        "25536-49151, 67.2M" in describe_shards(shards, SMOLLM)


def test_heads_split_evenly_keep_the_even_split():
    # the default model over 3 ranks: 3 query heads and a KV head each
    shards = plan_shards(SMOLLM, 3)
    assert [s.intermediate for s in shards] == [(0, 512), (512, 1024), (1024, 1536)]
    assert [s.vocab for s in shards] == [(0, 16384), (16384, 32768), (32768, 49152)]
    # 8 query heads over 4 KV heads, 2 ranks
    even = plan_shards(replace(SMOLLM, num_heads=8, num_kv_heads=4), 2)
    assert [s.intermediate for s in even] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in even] == [(0, 24576), (24576, 49152)]


def test_four_ranks_sharing_kv_heads_read_within_a_row_unit_of_each_other():
    """9 query heads over 4 ranks: 2, 1, 3, 3 query heads with a KV head each (rank 0 and 1
    share KV head 0), so rank 1 takes the most columns."""
    shards = plan_shards(SMOLLM, 4)
    reads = [_reads(q1 - q0, 1, c1 - c0, v1 - v0)
             for (q0, q1), (c0, c1), (v0, v1) in ((s.q_heads, s.intermediate, s.vocab)
                                                  for s in shards)]
    assert max(reads) - min(reads) <= 576 * 16   # one vocabulary unit
    columns = [b - a for a, b in (s.intermediate for s in shards)]
    assert columns[1] == max(columns) and columns[2] == columns[3] < columns[0]


def test_a_mixture_of_experts_keeps_the_even_split():
    moe = replace(SMOLLM, architecture="MixtralForCausalLM", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=1536)
    shards = plan_shards(moe, 2)
    assert [s.intermediate for s in shards] == [(0, 768), (768, 1536)]
    assert [s.vocab for s in shards] == [(0, 24576), (24576, 49152)]


def test_take_cuts_each_tensor_as_the_fused_model_needs():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=8,
                         intermediate_size=64, num_layers=1, num_heads=6, num_kv_heads=2,
                         head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                         max_position_embeddings=64, tie_word_embeddings=False)
    rank1 = plan_shards(config, 2)[1]   # query heads 3-5, KV head 1, columns 32-63
    w = {n: torch.randn(rows, 8) for n, rows in (("q", 12), ("k", 4), ("v", 4), ("gate", 64),
                                                 ("up", 64))}
    layer = "model.layers.0"
    assert torch.equal(rank1.take(f"{layer}.self_attn.q_proj.weight", w["q"]), w["q"][6:12])
    assert torch.equal(rank1.take(f"{layer}.self_attn.k_proj.weight", w["k"]), w["k"][2:4])
    o = torch.randn(8, 12)
    assert torch.equal(rank1.take(f"{layer}.self_attn.o_proj.weight", o), o[:, 6:12])
    down = torch.randn(8, 64)
    assert torch.equal(rank1.take(f"{layer}.mlp.down_proj.weight", down), down[:, 32:])
    # shipped fused (Phi-3): each part's rows, fused again as the unfused parts fuse
    fused_qkv = torch.cat([w["q"], w["k"], w["v"]])
    assert torch.equal(rank1.take(f"{layer}.self_attn.qkv_proj.weight", fused_qkv),
                       torch.cat([w["q"][6:12], w["k"][2:4], w["v"][2:4]]))
    fused = torch.cat([w["gate"], w["up"]])
    assert torch.equal(rank1.take(f"{layer}.mlp.gate_up_proj.weight", fused),
                       torch.cat([w["gate"][32:], w["up"][32:]]))
    norm = torch.randn(8)
    assert rank1.take(f"{layer}.input_layernorm.weight", norm) is norm


def test_cpus_split_evenly_or_as_bound():
    parallel = ParallelConfig(tensor_parallel_size=2)
    assert rank_cpus(parallel, [0, 1, 2, 3, 4], nodes=[]) == [(0, 1, 2), (3, 4)]   # one node
    bound = ParallelConfig(tensor_parallel_size=2, cpu_bind="4-5,7|0")
    assert rank_cpus(bound, list(range(8))) == [(4, 5, 7), (0,)]
    assert parse_cpu_bind("0|1") == [(0,), (1,)]


def test_more_ranks_than_cores_fail_naming_the_numbers():
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 needs a CPU core per rank, "
                                          r"and this process may run on 2 \(0-1\)"):
        rank_cpus(ParallelConfig(tensor_parallel_size=4), [0, 1])
    with pytest.raises(ConfigError, match=r"names CPUs \[9\]"):
        rank_cpus(ParallelConfig(tensor_parallel_size=2, cpu_bind="0|9"), [0, 1])


def test_ray_ranks_take_cpu_counts_not_this_hosts_cpus():
    """Under Ray a rank's bundle is a CPU count on whichever node Ray picks: this process's
    CPUs split among the ranks (at least one each, however few there are), or as given."""
    ray = ParallelConfig(tensor_parallel_size=2, distributed_executor="ray")
    assert ray_rank_cpus(ray, [0, 1, 2, 3, 4]) == [3, 2]
    assert ray_rank_cpus(replace(ray, tensor_parallel_size=3), [0, 1]) == [1, 1, 1]
    assert ray_rank_cpus(replace(ray, ray_cpus_per_rank=16), [0, 1]) == [16, 16]
    assert EngineConfig.from_options(tensor_parallel_size=2, pipeline_parallel_size=2,
                                     distributed_executor="ray").parallel.world_size == 4


def test_serve_takes_the_ray_executors_options():
    args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2",
                                      "--distributed-executor", "ray", "--ray-address",
                                      "10.0.0.1:6379", "--ray-cpus-per-rank", "16",
                                      "--ray-placement-timeout-s", "5"])
    parallel = engine_config(args).parallel
    assert (parallel.distributed_executor, parallel.ray_address, parallel.ray_cpus_per_rank,
            parallel.ray_placement_timeout_s) == ("ray", "10.0.0.1:6379", 16, 5.0)


def test_serve_takes_the_kv_head_split_and_refuses_others():
    for split in ("shared", "groups"):
        args = build_parser().parse_args(["serve", "--tensor-parallel-size", "2",
                                          "--kv-head-split", split])
        assert engine_config(args).parallel.kv_head_split == split
    assert ParallelConfig().kv_head_split == "shared"
    with pytest.raises(ConfigError, match="kv_head_split"):
        ParallelConfig(tensor_parallel_size=2, kv_head_split="halves")


@pytest.mark.parametrize("options, message", [
    (dict(ray_address="head:6379"), "ray_address: only the Ray executor uses them"),
    (dict(ray_cpus_per_rank=2), "ray_cpus_per_rank: only the Ray executor"),
    (dict(distributed_executor="ray", cpu_bind="0|1"), "give ray_cpus_per_rank"),
    (dict(distributed_executor="ray", ray_cpus_per_rank=0), "ray_cpus_per_rank=0 must be"),
    (dict(distributed_executor="ray", ray_placement_timeout_s=0),
     "ray_placement_timeout_s=0 must be positive"),
])
def test_ray_options_out_of_place_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(tensor_parallel_size=2, **options)


@pytest.mark.parametrize("spec, message", [("0|0", "more than one rank"), ("0-x", "not a CPU"),
                                           ("0", "CPUs for 1 ranks")])
def test_bad_cpu_binds_are_refused(spec, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(tensor_parallel_size=2, cpu_bind=spec)


def test_a_step_as_plain_data_builds_the_same_inputs():
    """What a worker receives (Requests cut to the step's tokens, drafts included) lays out
    the same tensors as the driver's plan."""
    request = Request("a", list(range(100, 140)), SamplingParams(), frozenset(), max_tokens=8)
    for token in (7, 8, 9):
        request.append_output(token)
    prompt = Request("b", list(range(300, 320)), SamplingParams(), frozenset(), max_tokens=8)
    plan = SchedulerOutput([ScheduledRequest(request, 42, 3, [3, 4, 5], True, (11, 12)),
                            ScheduledRequest(prompt, 16, 4, [6, 7], True)])
    message = pickle.loads(pickle.dumps(step_message(ForwardStep("forward", plan))))
    sent = received_step(message).plan
    a, b = (prepare_inputs(p, 16, torch.device("cpu")) for p in (plan, sent))
    assert a.input_ids.tolist() == [9, 11, 12, 316, 317, 318, 319] == b.input_ids.tolist()
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(a.attn.slot_mapping, b.attn.slot_mapping)
    assert TokenWindow(5, [1, 2, 3])[6:8] == [2, 3]
    for name in (f.name for f in fields(ScheduledRequest) if f.name != "request"):
        assert [getattr(s, name) for s in sent.scheduled] == \
            [getattr(s, name) for s in plan.scheduled], name   # every field travels


def test_stages_take_consecutive_layers_the_first_ones_more():
    stages = plan_stages(30, 4)
    assert [(s.first_layer, s.end_layer) for s in stages] == [(0, 8), (8, 16), (16, 23),
                                                             (23, 30)]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, False),
                                                          (False, False), (False, True)]
    assert stages[2].local_config(SMOLLM).num_layers == 7
    with pytest.raises(ConfigError, match="pipeline_parallel_size=31 exceeds the model's 30 "
                                          "layers"):
        plan_stages(30, 31)


def test_a_stage_holds_its_layers_renumbered_and_only_its_ends():
    first, middle, last = plan_stages(30, 3)
    assert first.local_name("model.layers.9.mlp.down_proj.weight", tied=True) == \
        "model.layers.9.mlp.down_proj.weight"
    assert middle.local_name("model.layers.9.mlp.down_proj.weight", tied=True) is None
    assert middle.local_name("model.layers.12.self_attn.q_proj.bias", tied=True) == \
        "model.layers.2.self_attn.q_proj.bias"
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    assert [s.local_name(embed, tied=False) for s in (first, middle, last)] == \
        [embed, None, None]
    assert [s.local_name(embed, tied=True) for s in (first, middle, last)] == \
        [embed, None, embed]                  # a tied head reads the embedding
    assert [s.local_name(head, tied=False) for s in (first, middle, last)] == [None, None, head]
    assert middle.local_name("model.norm.weight", tied=True) == "model.norm.weight"


def test_a_stages_layer_kinds_follow_the_whole_models_layers():
    gemma = replace(SMOLLM, sliding_window=8, sliding_layers=(True, False, True),
                    num_layers=3, dense_mlp_layers=(2,))
    last = plan_stages(3, 2)[1].local_config(gemma)
    assert (last.num_layers, last.sliding_layers, last.dense_mlp_layers) == (1, (True,), (0,))


def test_ranks_go_stage_by_stage_one_core_each_unless_oversubscribed():
    layout = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert rank_cpus(layout, list(range(8))) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 x pipeline_parallel_size=2 "
                                          r"= 4 ranks needs a CPU core per rank, and this "
                                          r"process may run on 2 \(0-1\)"):
        rank_cpus(layout, [0, 1])
    shared = replace(layout, oversubscribe=True)
    assert rank_cpus(shared, [0, 1]) == [(0,), (1,), (0,), (1,)]
    with pytest.raises(ConfigError, match="CPUs for 2 ranks, tensor_parallel_size=2 x "
                                          "pipeline_parallel_size=2 = 4"):
        ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, cpu_bind="0|1")


def test_what_ranks_cannot_run_yet_fails_before_anything_starts():
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2 does not run with "
                                          "--device cuda"):
        EngineConfig.from_options(pipeline_parallel_size=2, device="cuda")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 does not run with "
                                          "device='cuda'"):
        EngineConfig.from_options(tensor_parallel_size=2, device="cuda")
    # what runs on every rank: int8 prompt matmuls calibrate on each
    # (tests/reference/test_parallel_int8.py), the self-draft runs each rank's part of its
    # layers (test_parallel_spec.py), a role moves every rank's KV (test_disaggregated_parallel)
    for layout in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2),
                   dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        for option in (dict(prefill_matmul="int8"), dict(speculative="self"),
                       dict(role="prefill")):
            EngineConfig.from_options(**layout, **option)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=0 must be in \[1, 64\]"):
        ParallelConfig(pipeline_parallel_size=0)


def test_micro_batches_are_runs_of_whole_requests_of_about_equal_tokens():
    requests = [Request(name, list(range(40)), SamplingParams(), frozenset(), max_tokens=4)
                for name in "abcde"]
    sizes = [30, 2, 2, 26, 4]     # new tokens of each request this step
    plan = SchedulerOutput([ScheduledRequest(r, 0, n, [0, 1], True)
                            for r, n in zip(requests, sizes)], frozenset({"z"}))
    runs = micro_batches(plan, 2)
    assert [[i.request.request_id for i in run.scheduled] for run in runs] == \
        [["a", "b"], ["c", "d", "e"]]
    assert all(run.finished_request_ids == {"z"} for run in runs)
    assert len(micro_batches(plan, 8)) == 5 and len(micro_batches(plan, 1)) == 1


def test_the_bubble_is_the_schedules_idle_slots():
    bubble = PipelineBubble(num_stages=2)
    assert bubble.share == 0.0
    bubble.add(1)                 # one micro-batch: (P-1)/P
    assert bubble.share == 1 / 2
    bubble.add(3)                 # 1 + 1 idle slots of 2 + 4
    assert bubble.share == 2 / 6


TWO_SOCKETS = [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_ranks_default_to_cores_of_one_numa_node_each():
    two = ParallelConfig(tensor_parallel_size=2)
    assert rank_cpus(two, list(range(8)), TWO_SOCKETS) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # interleaved numbering: an even split in order would straddle the sockets
    interleaved = [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert rank_cpus(two, list(range(8)), interleaved) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    four = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert rank_cpus(four, list(range(8)), interleaved) == [(0, 2), (4, 6), (1, 3), (5, 7)]
    # fewer ranks than nodes: whole nodes to each rank
    assert rank_cpus(two, list(range(8)), [(0, 1), (2, 3), (4, 5), (6, 7)]) == \
        [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_ranks_that_do_not_divide_among_the_nodes_split_in_order():
    three = ParallelConfig(tensor_parallel_size=3)
    assert rank_cpus(three, list(range(6)), [(0, 1, 2), (3, 4, 5)]) == [(0, 1), (2, 3), (4, 5)]
    two = ParallelConfig(tensor_parallel_size=2)
    # this process may run on one node only: nothing to place
    assert rank_cpus(two, [4, 5, 6, 7], TWO_SOCKETS) == [(4, 5), (6, 7)]
    # cpu_bind wins over the nodes
    bound = ParallelConfig(tensor_parallel_size=2, cpu_bind="0,4|1,5")
    assert rank_cpus(bound, list(range(8)), TWO_SOCKETS) == [(0, 4), (1, 5)]


@pytest.mark.parametrize("widths", [(5, 4), (3, 3, 3), (4, 1, 4)])
def test_ranks_best_tokens_give_the_argmax_of_the_whole_vocabulary(widths):
    """Each rank's best logit and token (argmax_columns), summed over the ranks as the
    all-reduce sums them, pick each row's argmax over the whole vocabulary, ties included:
    within a rank, across a cut and between ranks far apart (the lowest id wins, as in
    argmax over the whole row)."""
    generator = torch.Generator().manual_seed(0)
    vocab = sum(widths)
    logits = torch.randn(8, vocab, generator=generator).round(decimals=1)
    logits[0, :] = 1.0                                     # every token ties
    logits[1, widths[0] - 1] = logits[1, widths[0]] = 9.0   # a tie across the first cut
    logits[2, 1] = logits[2, vocab - 1] = 9.0               # the first and last ranks tie
    logits[3, 2] = logits[3, 3] = 9.0                       # a tie within the first rank
    logits[4, :] = float("-inf")
    logits[4, vocab - 2] = -1e30
    starts = [sum(widths[:r]) for r in range(len(widths))]
    summed = sum(argmax_columns(logits[:, s:s + w], s, r, len(widths))
                 for r, (s, w) in enumerate(zip(starts, widths)))
    assert torch.equal(pick_argmax(summed), logits.argmax(-1))
