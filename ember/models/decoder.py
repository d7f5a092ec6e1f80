"""Llama's relatives: Qwen3, Gemma 2 and 3, Phi-3, OLMo 2, Mistral with its sliding window,
and the mixtures of experts Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE (moe.py).

Each is a Llama decoder with some of these changes (ModelConfig's fields name them):

  qk_norm        RMSNorm on q and k before RoPE: per head (Qwen3, Gemma 3) or over the
                 whole projection (OLMo 2)
  norm_layout    pre       x + attn(norm(x)); then x + mlp(norm(x))             (Llama)
                 sandwich  x + norm(attn(norm(x))); then x + norm(mlp(norm(x))) (Gemma)
                 post      x + norm(attn(x)); then x + norm(mlp(x))             (OLMo 2)
  GeGLU          gelu(gate) * up instead of silu (Gemma)
  scales, caps   embeddings times sqrt(hidden), a query scale of its own, soft-capped scores
                 and logits (Gemma 2)
  windows        sliding-window layers (Mistral, Phi-3, Gemma's local layers; windowed.py),
                 Gemma 3's local layers with a RoPE base of their own
  longrope       Phi-3's per-frequency RoPE factors: long ones where the served context
                 passes the original one

Parameter names follow transformers (q/k/v and gate/up fused as in llama.py). The layers run
one by one: the compiled decode stack computes Llama's layer only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig, RopeScaling
from ember.kernels import CpuKernels
from ember.lora.batch import LoraLayer, LoraStep
from ember.models.attention import AttentionMetadata, PagedKV, paged_attention
from ember.models.layers import (RMSNorm, SwiGLU, apply_rope, longrope_inv_freq, rope_cos_sin,
                                 rope_inv_freq)
from ember.models.llama import LlamaAttention, LlamaForCausalLM
from ember.models.moe import SparseMoE
from ember.models.parallel import GatheredHead
from ember.models.windowed import windowed_attention

GLOBAL, LOCAL = "global", "local"  # RoPE tables: Gemma 3's local layers have their own


class GeGLU(SwiGLU):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up fused."""

    def _forward(self, x: Tensor, lora: LoraLayer | None) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add_("gate_up", gate_up, x)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") * up
        out = self.down_proj(act)
        return out if lora is None else lora.add_("down", out, act)


class VariantAttention(LlamaAttention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config)
        self.scale = config.attn_scale or config.head_dim ** -0.5
        self.window = config.sliding_window if config.is_sliding(layer_idx) else None
        self.softcap = config.attn_softcap
        self.qk_norm = config.qk_norm
        if config.qk_norm is not None:
            per_head = config.qk_norm == "head"
            self.q_norm = RMSNorm(config.head_dim if per_head else self.q_size,
                                  config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim if per_head else self.kv_size,
                                  config.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: PagedKV,
                meta: AttentionMetadata, lora: LoraLayer | None = None) -> Tensor:
        """x [T, hidden] -> [T, hidden]; `lora`: the rows' adapters, if any."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add_("qkv", qkv, x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self._norm(self.q_norm, q), self._norm(self.k_norm, k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.window is None and self.softcap is None:
            out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.kernels)
        else:
            out = windowed_attention(q, k, v, kv_cache, meta, self.scale, self.window,
                                     self.softcap)
        return self._out(self._attended(out, meta), lora)

    @staticmethod
    def _norm(norm: RMSNorm, x: Tensor) -> Tensor:
        """RMSNorm over the last dimension of x [T, ..., size], float32 accumulation."""
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


class VariantDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layout = config.norm_layout
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps)  # noqa: E731
        if self.layout != "post":
            self.input_layernorm = norm()
        self.self_attn = VariantAttention(config, layer_idx)
        # pre: the norm before the MLP; sandwich and post: the norm after attention
        self.post_attention_layernorm = norm()
        if self.layout == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.layout != "pre":
            self.post_feedforward_layernorm = norm()
        mlp = GeGLU if config.hidden_act == "gelu_tanh" else SwiGLU
        if config.num_experts and layer_idx not in config.dense_mlp_layers:
            self.mlp = SparseMoE(config)
        else:
            self.mlp = mlp(config.hidden_size, config.intermediate_size)
        self.rope = LOCAL if config.is_sliding(layer_idx) and config.local_rope_theta else GLOBAL

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: PagedKV,
                meta: AttentionMetadata, lora: LoraLayer | None = None) -> Tensor:
        """x [T, hidden] (the residual stream) -> the stream after this layer. `lora`: the
        rows' adapters (on a mixture of experts, attention only: see lora/adapter.py)."""
        if self.layout == "pre":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, lora)
            return x + self._mlp(self.post_attention_layernorm(x), lora)
        h = x if self.layout == "post" else self.input_layernorm(x)
        x = x + self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta, lora))
        h = x if self.layout == "post" else self.pre_feedforward_layernorm(x)
        return x + self.post_feedforward_layernorm(self._mlp(h, lora))

    def _mlp(self, h: Tensor, lora: LoraLayer | None) -> Tensor:
        return self.mlp(h) if lora is None or isinstance(self.mlp, SparseMoE) \
            else self.mlp(h, lora)


class VariantForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.layers = nn.ModuleList(VariantDecoderLayer(config, i)
                                          for i in range(config.num_layers))
        self.rope_tables: dict[str, tuple[Tensor, Tensor]] | None = None  # set by cache_rope
        self.long_rope = False  # LongRoPE's long factors (cache_rope decides)

    def cache_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        """From now on, look RoPE's cos and sin up in tables for positions below
        `max_positions` (the engine's max_model_len). With LongRoPE, that length chooses the
        factors for every position, as llama.cpp chooses them by its context size: long ones
        when it passes the original context. (transformers switches a sequence to the long
        factors when it grows past it, recomputing its whole cache, which a paged cache
        shared between requests cannot do.)"""
        scaling = self.config.rope_scaling
        self.long_rope = scaling is not None and scaling.kind == "longrope" and \
            max_positions > scaling.original_max_position_embeddings
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self.rope_tables = self._rope(positions, dtype)

    def _rope(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        """cos, sin [T, 1, head_dim] per table, at `positions` [T]."""
        config = self.config
        tables = {GLOBAL: _cos_sin(positions, self.inv_freq, config.rope_theta,
                                   config.rope_scaling, self.long_rope, dtype)}
        if config.local_rope_theta:
            local = rope_inv_freq(config.head_dim, config.local_rope_theta, None)
            tables[LOCAL] = rope_cos_sin(positions, local.to(positions.device), dtype)
        return tables

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[PagedKV],
                meta: AttentionMetadata, lora: LoraStep | None = None) -> Tensor:
        """input_ids, positions [T] long -> final hidden states [T, hidden]; `lora`: the
        step's adapters, where a row has one. A pipeline stage but the first takes the
        stream from the stage before; one but the last sends it on and returns it."""
        link = self.stage_link
        if link is not None and not link.is_first:
            x = link.receive((input_ids.shape[0], self.config.hidden_size),
                             self.model.norm.weight.dtype)
        else:
            x = self.model.embed_tokens(input_ids)
        if self.config.embedding_scale is not None and (link is None or link.is_first):
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)  # as HF rounds it
        if self.rope_tables is not None:
            tables = {kind: (cos[positions], sin[positions])
                      for kind, (cos, sin) in self.rope_tables.items()}
        else:
            tables = self._rope(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x = layer(x, *tables[layer.rope], kv_cache, meta,
                      None if lora is None else lora.layer(i))
        if link is not None and not link.is_last:
            link.send(x.contiguous())
            return x
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32, soft-capped where the model is."""
        logits = self.lm_head(hidden)
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def argmax_apart(self) -> bool:
        # a soft cap may make distinct logits equal, and argmax then takes the first of them
        return super().argmax_apart() and self.config.final_softcap is None

    def int8_prefill_linears(self) -> list[tuple[nn.Module, bool]]:
        """LlamaForCausalLM's, with each expert's projections where a layer has experts."""
        pairs: list[tuple[nn.Module, bool]] = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mlps = [mlp] if isinstance(mlp, SwiGLU) else \
                [*mlp.experts, *([mlp.shared_expert] if mlp.shared_expert else [])]
            pairs += [(attn.qkv_proj, False), (attn.o_proj, False)]
            pairs += [pair for m in mlps for pair in ((m.gate_up_proj, False),
                                                      (m.down_proj, True))]
        return pairs

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Compiled norms, and attention kernels in layers without windows or caps (which
        VariantAttention routes); no decode stack."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, SwiGLU, GatheredHead)):
                module.kernels = kernels
        self.decode_stack = None


def _cos_sin(positions: Tensor, inv_freq: Tensor, theta: float, scaling: RopeScaling | None,
             long: bool, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """rope_cos_sin's tables; with LongRoPE, from the long factors where `long` (else the
    short ones, inv_freq), and cos and sin scaled by the attention factor."""
    if scaling is None or scaling.kind != "longrope":
        return rope_cos_sin(positions, inv_freq, dtype)
    if long:
        inv_freq = longrope_inv_freq(inv_freq.shape[0] * 2, theta, scaling.long_factor)
    cos, sin = rope_cos_sin(positions, inv_freq.to(positions.device), torch.float32)
    factor = scaling.attention_factor
    return (cos * factor).to(dtype), (sin * factor).to(dtype)
