"""The parts of a transformers config.json that set Llama's relatives apart (ModelConfig's
variant fields): windows, RoPE, norms, activations, scales and caps."""
from __future__ import annotations

import math
from typing import Any

from ember.config import RopeScaling
from ember.errors import UnsupportedModel

GEMMAS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
# transformers 4 configs without layer_types: which layers slide, by index
_DEFAULT_SLIDING = {"Gemma2ForCausalLM": lambda i, _: i % 2 == 0,
                    "Gemma3ForCausalLM": lambda i, pattern: (i + 1) % pattern != 0}


def rope_of(config: dict[str, Any], params: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one RoPE parameter set (rope_parameters, or the older rope_scaling
    beside rope_theta)."""
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "default":
        return theta, None
    if float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))) != 1:
        raise UnsupportedModel("partial rotary embeddings (partial_rotary_factor < 1) are not "
                               "supported; ember rotates whole heads")
    original = int(params.get("original_max_position_embeddings")
                   or config.get("original_max_position_embeddings") or 8192)
    if kind == "longrope":
        return theta, _longrope(config, params, original)
    return theta, RopeScaling(
        kind=kind, factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original)


def _longrope(config: dict[str, Any], params: dict[str, Any], original: int) -> RopeScaling:
    """Phi-3's LongRoPE; the attention factor defaults as transformers computes it."""
    factor = params.get("factor") or config["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(kind="longrope", factor=float(factor),
                       original_max_position_embeddings=original,
                       short_factor=tuple(float(f) for f in params["short_factor"]),
                       long_factor=tuple(float(f) for f in params["long_factor"]),
                       attention_factor=float(attention))


def rope_fields(config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, rope_scaling and (Gemma 3) local_rope_theta."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "full_attention" in params:  # per layer type (Gemma 3)
        theta, scaling = rope_of(config, params["full_attention"] or {})
        local, _ = rope_of({}, params.get("sliding_attention") or {})
        return dict(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local)
    theta, scaling = rope_of(config, params)
    fields: dict[str, Any] = dict(rope_theta=theta, rope_scaling=scaling)
    if config.get("rope_local_base_freq"):
        fields["local_rope_theta"] = float(config["rope_local_base_freq"])
    return fields


def window_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """sliding_window and sliding_layers: from layer_types where the config has them."""
    window = config.get("sliding_window")
    num_layers = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is not None:
        sliding = tuple(t == "sliding_attention" for t in types)
    elif architecture in _DEFAULT_SLIDING:
        pattern = int(config.get("sliding_window_pattern") or 6)
        sliding = tuple(_DEFAULT_SLIDING[architecture](i, pattern) for i in range(num_layers))
    elif architecture.startswith("Qwen") and not config.get("use_sliding_window"):
        sliding = (False,) * num_layers
    else:
        sliding = (True,) * num_layers
    if not window or not any(sliding):
        return dict(sliding_window=None, sliding_layers=None)
    return dict(sliding_window=int(window), sliding_layers=sliding)


def moe_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The experts: how many, how many per token, their size, the routing's normalisation,
    Qwen2-MoE's shared expert and the layers that keep a dense MLP."""
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    num_layers = int(config["num_hidden_layers"])
    step = int(config.get("decoder_sparse_step") or 1)
    dense = sorted(set(config.get("mlp_only_layers") or [])
                   | {i for i in range(num_layers) if (i + 1) % step})
    size = config.get("moe_intermediate_size") or config["intermediate_size"]
    return dict(num_experts=num_experts, num_experts_per_tok=int(config["num_experts_per_tok"]),
                moe_intermediate_size=int(size),
                norm_topk_prob=architecture == "MixtralForCausalLM"
                or bool(config.get("norm_topk_prob")),
                shared_expert_intermediate_size=int(
                    config.get("shared_expert_intermediate_size") or 0),
                dense_mlp_layers=tuple(dense))


def variant_fields(config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """ModelConfig keywords beyond Llama's for this architecture's config.json."""
    fields = rope_fields(config) | window_fields(config, architecture)
    act = config.get("hidden_activation") or config.get("hidden_act") or "silu"
    fields["hidden_act"] = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}.get(act, act)
    if architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        fields["qk_norm"] = "head"
    if architecture == "Olmo2ForCausalLM":
        fields.update(qk_norm="full", norm_layout="post")
    if architecture in MOES:
        fields.update(moe_fields(config, architecture))
    if architecture == "Qwen3MoeForCausalLM":
        fields["qk_norm"] = "head"
    if architecture == "OlmoeForCausalLM":
        fields["qk_norm"] = "full"
    if architecture in GEMMAS:
        # Gemma2Config's defaults, for configs that leave them out
        softcaps = (50.0, 30.0) if architecture == "Gemma2ForCausalLM" else (None, None)
        fields.update(norm_layout="sandwich", norm_plus_one=True,
                      embedding_scale=float(config["hidden_size"]) ** 0.5,
                      attn_scale=float(config.get("query_pre_attn_scalar") or 256) ** -0.5,
                      attn_softcap=config.get("attn_logit_softcapping", softcaps[0]),
                      final_softcap=config.get("final_logit_softcapping", softcaps[1]))
    return fields
