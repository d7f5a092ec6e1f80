"""What differs between GGUF architectures: tensor names and the metadata of Llama's relatives,
following llama.cpp's converter (convert_hf_to_gguf.py) and its loader.

Conventions of llama.cpp's files kept in mind here:
  * only `llama` files have q/k rows permuted (see gguf.unpermute_rows)
  * Gemma's norm weights are stored with Gemma's +1 added (ember's model keeps them so)
  * Phi-3 stores q/k/v fused (attn_qkv) and gate/up fused (ffn_up), and LongRoPE's factors
    as the tensors rope_factors_long/short
  * Gemma 2/3's query scale is head_dim ** -0.5, but (n_embd / n_head) ** -0.5 for the 27B
    models (46 and 62 layers), as llama.cpp decides it by layer count
  * experts stacked in one tensor per projection; the top-k weights renormalised for llama
    (Mixtral) and qwen3moe files, not for qwen2moe and olmoe ones, as llama.cpp runs them
  * which layers slide: sliding_window_pattern (a period or a list of flags), else every
    2nd layer of Gemma 2 and 5 of each 6 of Gemma 3 global-free (llama.cpp's defaults)
"""
from __future__ import annotations

from typing import Any

# GGUF architecture -> (HF architecture, q/k rows permuted by the converter)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                 "qwen3": ("Qwen3ForCausalLM", False), "gemma2": ("Gemma2ForCausalLM", False),
                 "gemma3": ("Gemma3ForCausalLM", False), "phi3": ("Phi3ForCausalLM", False),
                 "olmo2": ("Olmo2ForCausalLM", False),
                 "qwen2moe": ("Qwen2MoeForCausalLM", False),
                 "qwen3moe": ("Qwen3MoeForCausalLM", False), "olmoe": ("OlmoeForCausalLM", False)}
MIXTRAL = "MixtralForCausalLM"  # a llama file with experts

LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # experts: one [experts, rows, columns] tensor per projection, split per expert ("*")
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj",
    "ffn_up_exps": "mlp.experts.*.up_proj", "ffn_down_exps": "mlp.experts.*.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GEMMA_NAMES = LAYER_NAMES | {"ffn_norm": "pre_feedforward_layernorm"}
_ARCH_NAMES = {"gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES,
               "phi3": LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj",
                                      "ffn_up": "mlp.gate_up_proj"}}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_SLIDING_PERIOD = {"gemma2": 2, "gemma3": 6}
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}


def layer_names(arch: str) -> dict[str, str]:
    """GGUF layer tensor kind ('attn_q') -> transformers module path, for `arch`."""
    return _ARCH_NAMES.get(arch, LAYER_NAMES)


def sliding_layers(arch: str, metadata: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window, as llama.cpp's loader decides it."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        return tuple(bool(p) for p in pattern)
    period = int(pattern) if pattern is not None else _SLIDING_PERIOD.get(arch, 0)
    return tuple(period == 0 or i % period < period - 1 for i in range(num_layers))


def moe_fields(arch: str, metadata: dict[str, Any], tensor_names: set[str],
               num_layers: int) -> dict[str, Any]:
    """The experts of a GGUF file (none: {}); layers without a router keep a dense MLP."""
    num_experts = metadata.get(f"{arch}.expert_count")
    if not num_experts:
        return {}
    size = metadata.get(f"{arch}.expert_feed_forward_length") or \
        metadata[f"{arch}.feed_forward_length"]
    return dict(num_experts=int(num_experts),
                num_experts_per_tok=int(metadata[f"{arch}.expert_used_count"]),
                moe_intermediate_size=int(size), norm_topk_prob=arch in ("llama", "qwen3moe"),
                shared_expert_intermediate_size=int(
                    metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
                dense_mlp_layers=tuple(i for i in range(num_layers)
                                       if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names))


def variant_fields(arch: str, metadata: dict[str, Any], hidden: int, num_heads: int,
                   head_dim: int, num_layers: int) -> dict[str, Any]:
    """ModelConfig keywords beyond Llama's for a GGUF file of `arch` (RoPE and experts
    apart)."""
    fields: dict[str, Any] = {}
    window = metadata.get(f"{arch}.attention.sliding_window")
    if arch == "gemma2" and window is None:
        window = 4096  # llama.cpp's default for Gemma 2
    if window:
        fields.update(sliding_window=int(window),
                      sliding_layers=sliding_layers(arch, metadata, num_layers))
    if arch in ("qwen3", "gemma3", "qwen3moe"):
        fields["qk_norm"] = "head"
    if arch == "olmo2":
        fields.update(qk_norm="full", norm_layout="post")
    if arch == "olmoe":
        fields["qk_norm"] = "full"
    if arch in _LAYERS_27B:
        scale_dim = hidden // num_heads if num_layers == _LAYERS_27B[arch] else head_dim
        # llama.cpp's defaults: Gemma 2 caps at 50 and 30, Gemma 3 has no caps
        default = (50.0, 30.0) if arch == "gemma2" else (None, None)
        softcap = metadata.get(f"{arch}.attn_logit_softcapping", default[0])
        final = metadata.get(f"{arch}.final_logit_softcapping", default[1])
        fields.update(norm_layout="sandwich", hidden_act="gelu_tanh", norm_plus_one=True,
                      embedding_scale=float(hidden) ** 0.5, attn_scale=scale_dim ** -0.5,
                      attn_softcap=float(softcap) if softcap else None,
                      final_softcap=float(final) if final else None)
    if arch == "gemma3":
        fields["local_rope_theta"] = float(metadata.get("gemma3.rope.freq_base_swa", 10000.0))
    return fields
