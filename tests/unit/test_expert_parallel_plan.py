"""How expert parallel shares out a mixture's experts (ember/distributed/parallel.py), against
the split written out by hand; a rank's names and tensors; the mixture's partial outputs
against the whole mixture's; a GGUF file's stacked experts read for one rank against the
gguf package's dequantizer; and the start-up errors that name the numbers."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf import quants as gguf_quants

from ember.config import EngineConfig, ModelConfig, ParallelConfig
from ember.distributed.parallel import describe_shards, plan_shards, split_experts
from ember.errors import ConfigError
from ember.models.moe import SparseMoE
from ember.weights.gguf import GGUFFile

MOE = ModelConfig(architecture="Qwen2MoeForCausalLM", vocab_size=256, hidden_size=64,
                  intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=512, tie_word_embeddings=False, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64,
                  shared_expert_intermediate_size=96)
DENSE = replace(MOE, architecture="LlamaForCausalLM", num_experts=0, num_experts_per_tok=0,
                moe_intermediate_size=0, shared_expert_intermediate_size=0)
LAYER = "model.layers.1.mlp"


def test_experts_go_to_ranks_whole_and_contiguous_the_first_ranks_more():
    assert split_experts(4, 2) == [(0, 2), (2, 4)]
    assert split_experts(3, 2) == [(0, 2), (2, 3)]
    assert split_experts(8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert split_experts(60, 8)[0] == (0, 8) and split_experts(60, 8)[-1] == (53, 60)


def test_a_rank_holds_whole_experts_and_a_slice_of_the_shared_one():
    shards = plan_shards(MOE, 2, expert_parallel=True)
    assert [s.experts for s in shards] == [(0, 2), (2, 4)]
    assert [s.moe_intermediate for s in shards] == [(0, 64), (0, 64)]      # unsliced
    assert [s.shared_intermediate for s in shards] == [(0, 64), (64, 96)]  # units of 32
    local = shards[1].local_config(MOE)
    assert (local.num_experts, local.local_experts, local.moe_intermediate_size,
            local.shared_expert_intermediate_size) == (4, (2, 4), 64, 32)
    sliced = plan_shards(MOE, 2)   # without expert parallel: every expert's columns cut
    assert [(s.experts, s.moe_intermediate) for s in sliced] == [(None, (0, 32)),
                                                                (None, (32, 64))]
    assert sliced[1].local_config(MOE).local_experts is None


def test_a_rank_names_its_experts_from_zero_and_skips_the_others():
    rank1 = plan_shards(MOE, 2, expert_parallel=True)[1]
    assert rank1.local_name(f"{LAYER}.experts.3.down_proj.weight") == \
        f"{LAYER}.experts.1.down_proj.weight"
    assert rank1.local_name(f"{LAYER}.experts.1.gate_proj.weight") is None
    # Mixtral's own names, as the files hold them
    assert rank1.local_name("model.layers.0.block_sparse_moe.experts.2.w1.weight") == \
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    for name in (f"{LAYER}.shared_expert.up_proj.weight", f"{LAYER}.gate.weight",
                 "model.layers.12.self_attn.q_proj.weight"):
        assert rank1.local_name(name) == name
    sliced = plan_shards(MOE, 2)[1]
    assert sliced.local_name(f"{LAYER}.experts.0.up_proj.weight") == \
        f"{LAYER}.experts.0.up_proj.weight"


def test_take_keeps_experts_whole_and_cuts_the_shared_expert():
    rank1 = plan_shards(MOE, 2, expert_parallel=True)[1]
    down = torch.randn(64, 64)
    assert rank1.take(f"{LAYER}.experts.1.down_proj.weight", down) is down
    up = torch.randn(64, 64)
    assert rank1.take(f"{LAYER}.experts.1.up_proj.weight", up) is up
    shared_up, shared_down = torch.randn(96, 64), torch.randn(64, 96)
    assert torch.equal(rank1.take(f"{LAYER}.shared_expert.up_proj.weight", shared_up),
                       shared_up[64:])
    assert torch.equal(rank1.take(f"{LAYER}.shared_expert.down_proj.weight", shared_down),
                       shared_down[:, 64:])
    router = torch.randn(4, 64)
    assert rank1.take(f"{LAYER}.gate.weight", router) is router


@pytest.mark.parametrize("num_experts, num_ranks", [(4, 2), (3, 2), (5, 3)])
def test_the_ranks_partial_outputs_sum_to_the_whole_mixture(num_experts, num_ranks):
    """Each rank routes every token over all the experts and runs its own: the ranks'
    outputs (what the all-reduce adds) sum to the one-process mixture's."""
    config = replace(MOE, architecture="MixtralForCausalLM", num_experts=num_experts,
                     shared_expert_intermediate_size=0, norm_topk_prob=True)
    torch.manual_seed(0)
    whole = SparseMoE(config)
    for param in whole.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(23, config.hidden_size)
    with torch.no_grad():
        want = whole(x)
        total = torch.zeros_like(want)
        for shard in plan_shards(config, num_ranks, expert_parallel=True):
            part = SparseMoE(shard.local_config(config))
            state = {}
            for name, tensor in whole.state_dict().items():
                local = shard.local_name(f"{LAYER}.{name}")
                if local is not None:
                    state[local.removeprefix(f"{LAYER}.")] = tensor
            part.load_state_dict(state)
            assert len(part.experts) == shard.experts[1] - shard.experts[0]
            total += part(x)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=0)


def test_a_gguf_rank_reads_only_its_stacked_experts(tmp_path):
    """A Q8_0 stack of 4 experts read for rank 1 of 2: experts 2 and 3 only, each as the
    gguf package dequantizes it (the others are never dequantized)."""
    weights = np.random.default_rng(0).standard_normal((4, 16, 64)).astype(np.float32)
    packed = gguf_quants.quantize(weights, GGMLQuantizationType.Q8_0)
    path = tmp_path / "experts.gguf"
    writer = GGUFWriter(path, "qwen2moe")
    writer.add_tensor("blk.0.ffn_down_exps.weight", packed,
                      raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    want = torch.from_numpy(gguf_quants.dequantize(packed, GGMLQuantizationType.Q8_0))
    rank1 = plan_shards(MOE, 2, expert_parallel=True)[1]
    got = dict(GGUFFile(path).tensors(MOE, keep=lambda n: rank1.local_name(n) is not None))
    assert list(got) == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (2, 3)]
    for expert, tensor in zip((2, 3), got.values()):
        assert torch.equal(tensor, want[expert])


def test_describe_shards_names_each_ranks_experts():
    three = replace(MOE, num_experts=3)
    text = describe_shards(plan_shards(three, 2, expert_parallel=True), three)
    assert "rank 0: query heads 0-1, KV heads 0, MLP columns 0-63, experts 0-1" in text
    assert "rank 1: query heads 2-3, KV heads 1, MLP columns 64-127, experts 2," in text
    assert "experts" not in describe_shards(plan_shards(MOE, 2), MOE)


def test_more_ranks_than_experts_fail_naming_both():
    with pytest.raises(ConfigError, match="expert_parallel over tensor_parallel_size=4 ranks "
                                          "needs an expert per rank, and the model has 3 "
                                          "experts; use tensor_parallel_size=3 or less"):
        plan_shards(replace(MOE, num_experts=3), 4, expert_parallel=True)


def test_a_dense_model_or_one_rank_is_refused_saying_what_to_use():
    with pytest.raises(ConfigError, match="LlamaForCausalLM is a dense model \\(0 experts\\); "
                                          "drop expert_parallel"):
        plan_shards(DENSE, 2, expert_parallel=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 is one rank; use "
                                          "tensor_parallel_size=2 or more"):
        ParallelConfig(expert_parallel=True)
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 is one rank"):
        EngineConfig.from_options(expert_parallel=True, pipeline_parallel_size=2)
    assert EngineConfig.from_options(expert_parallel=True,
                                     tensor_parallel_size=2).parallel.expert_parallel


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_the_flag_reaches_the_engine_config(command):
    from ember.cli import build_parser, engine_config
    args = build_parser().parse_args([*command, "--tensor-parallel-size", "2",
                                      "--expert-parallel"])
    assert engine_config(args).parallel == ParallelConfig(tensor_parallel_size=2,
                                                          expert_parallel=True)
