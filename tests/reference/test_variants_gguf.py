"""Qwen3, Gemma 2/3, Phi-3, OLMo 2 and the mixtures of experts from GGUF files written here
the way llama.cpp's converter writes them, against transformers on the same weights.

The files take their tensor names from the gguf package's own name map (the converter's),
Gemma's norms with +1 added, Phi-3's LongRoPE factors as tensors, experts stacked into one
tensor per projection (Mixtral as a llama file, q/k rows permuted), and the metadata keys
that llama.cpp's loader reads. Reference: transformers' model the file was written from, float32,
token by token (hf_step_logits).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from gguf import MODEL_ARCH_NAMES, GGUFWriter, RopeScalingType, get_tensor_name_map

from ember import EngineConfig
from ember.engine.core import EngineCore
from ember.weights.gguf import GGUFFile
from tests.reference.test_gguf import llama_cpp_permute
from tests.reference.test_llama_vs_hf import PROMPTS
from tests.reference.test_variants_vs_hf import (CASES, ENGINE, NUM_STEPS,
                                                 assert_steps_match_transformers, tiny_variant)

ARCHS = {"qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
         "phi3-longrope-window": "phi3", "olmo2": "olmo2", "mixtral": "llama",
         "qwen2moe-shared": "qwen2moe", "qwen3moe": "qwen3moe", "olmoe": "olmoe"}
# transformers holds each layer's experts as [experts, rows, columns] tensors, gate and up
# fused (gate rows first), as GGUF stacks them
EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# llama.cpp scales queries by head_dim ** -0.5 (but for the 27B models): give the Gemmas that
# and llama.cpp's qwen2moe has no dense layers
GGUF_OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=16),
                  "gemma3": dict(query_pre_attn_scalar=16),
                  "qwen2moe-shared": dict(mlp_only_layers=[])}


def write_variant_gguf(path: Path, hf_model, arch: str, source: dict) -> None:
    cfg = hf_model.config
    writer = GGUFWriter(path, arch)
    _write_hparams(writer, cfg, arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    names = get_tensor_name_map(_arch_enum(arch), cfg.num_hidden_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w = tensor.numpy().astype(np.float32)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # the converter stores Gemma's (1 + weight)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            w = llama_cpp_permute(w, heads)
        if match := EXPERT_RE.fullmatch(name):
            layer, kind = match.groups()
            if kind == "down_proj":
                writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
            else:
                gate, up = np.split(w, 2, axis=1)
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate)
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up)
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        writer.add_tensor(gname, w)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        writer.add_tensor("rope_factors_short.weight",
                          np.array(rope["short_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_hparams(writer: GGUFWriter, cfg, arch: str) -> None:
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim if getattr(cfg, "head_dim", None)
                          else cfg.hidden_size // cfg.num_attention_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        rope = rope["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(
            float(np.sqrt(1 + np.log(scale) / np.log(original))) if scale > 1 else 1.0)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "layer_types", None):
            writer.add_sliding_window_pattern([t == "sliding_attention"
                                               for t in cfg.layer_types])
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _arch_enum(arch: str):
    return next(a for a, n in MODEL_ARCH_NAMES.items() if n == arch)


@pytest.fixture(scope="module")
def smollm_metadata(smollm_path) -> dict:
    return GGUFFile(smollm_path).metadata


# the default run writes a GGUF of four kinds (dense with qk-norm, Gemma 3, Mixtral, a MoE
# with qk-norm); -m heavy writes every one
DEFAULT_RUN = ("qwen3", "gemma3", "mixtral", "qwen3moe")


@pytest.fixture(scope="module", params=[a if a in DEFAULT_RUN else
                                        pytest.param(a, marks=pytest.mark.heavy) for a in ARCHS])
def gguf_pair(request, tmp_path_factory, smollm_metadata):
    kind, options = CASES[request.param]
    model = tiny_variant(kind, **(options | GGUF_OVERRIDES.get(request.param, {})))
    path = tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}.gguf"
    write_variant_gguf(path, model, ARCHS[request.param], smollm_metadata)
    return path, model, ENGINE.get(request.param, {})


def test_gguf_logits_match_transformers(gguf_pair):
    path, hf_model, options = gguf_pair
    engine = EngineCore(EngineConfig(model=str(path), dtype="float32", **options))
    for prompt in PROMPTS:
        assert_steps_match_transformers(engine, hf_model, prompt, NUM_STEPS, atol=1e-4)
