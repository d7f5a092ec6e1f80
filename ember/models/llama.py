"""LlamaForCausalLM over a flat batch of tokens; Mistral and Qwen2 are config flags of it.

Parameter names follow transformers, except that q/k/v and gate/up are fused
(`qkv_proj`, `gate_up_proj`); the loader concatenates them.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ember.config import ModelConfig
from ember.kernels import CpuKernels
from ember.lora.batch import LoraLayer, LoraStep
from ember.models.attention import (AttentionMetadata, DecodeBatch, PagedKV, PromptStep,
                                    attend_cached, cache_in_kernels, paged_attention,
                                    prefill_in_kernel)
from ember.models.layers import (KERNEL_DTYPES, RMSNorm, SwiGLU, apply_rope, rope_cos_sin,
                                 rope_inv_freq)
from ember.models.parallel import (AllReduce, GatheredHead, HeadShare, StackAllReduce,
                                   StageLink, reduce_, zero_skipped)
from ember.quant.packed import PackedLinear


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.kernels: CpuKernels | None = None  # compiled CPU kernels, if the engine has them
        # tensor parallel: o_proj's output is this rank's partial sum over its heads, summed
        # across the ranks (ember/distributed/); None in one process
        self.all_reduce: AllReduce | None = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: PagedKV,
                meta: AttentionMetadata, lora: LoraLayer | None = None) -> Tensor:
        """x [T, hidden] -> [T, hidden]; `lora`: the rows' adapters, if any."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add_("qkv", qkv, x)
        if self._fused_path(qkv, kv_cache, meta):  # decodes: rotate and write in one kernel
            # a fresh prompt chunk attends over its own k and v as computed, not their int8
            # rounding (attend_cached): the kernel hands the rotated k back
            new_k = qkv.new_empty(num_tokens, self.num_kv_heads, self.head_dim) \
                if meta.fresh and kv_cache.scale is not None else None
            q = self.kernels.rope_write(qkv, cos, sin, kv_cache.data, meta.slot_mapping,
                                        self.num_heads, self.num_kv_heads, kv_cache.scale,
                                        new_k)
            new_kv = None if new_k is None else (new_k, self._v(qkv))
            out = attend_cached(q, kv_cache, meta, self.scale, self.kernels, new_kv)
            return self._out(self._attended(out, meta), lora)
        # q and k rotate together: one pass over [T, heads + kv_heads, head_dim]
        qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(
            num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, self._v(qkv), kv_cache, meta, self.scale, self.kernels)
        return self._out(self._attended(out, meta), lora)

    def _attended(self, out: Tensor, meta: AttentionMetadata) -> Tensor:
        """Attention's output [T, heads, head_dim] as o_proj's input [T, q_size], zeros for
        the heads another tensor-parallel rank attends for a row (meta.skip)."""
        if meta.skip is not None:
            out = zero_skipped(out, meta.skip, self.num_kv_heads)
        return out.reshape(out.shape[0], self.q_size)

    def _out(self, attended: Tensor, lora: LoraLayer | None) -> Tensor:
        out = self.o_proj(attended)
        out = out if lora is None else lora.add_("o", out, attended)
        return reduce_(self.all_reduce, out)

    def _v(self, qkv: Tensor) -> Tensor:
        """v's columns of qkv as [T, kv_heads, head_dim] (a view)."""
        return qkv[:, self.q_size + self.kv_size:].view(qkv.shape[0], self.num_kv_heads,
                                                        self.head_dim)

    def _fused_path(self, qkv: Tensor, kv_cache: PagedKV, meta: AttentionMetadata) -> bool:
        """Whether the compiled kernels take this step: no bias, a cache in the activations'
        dtype (or an int8 one the kernels read), and no fresh prompt chunk unless the prefill
        kernel attends it from the cache (the torch path attends a fresh chunk over its own
        k and v, which the fused kernel does not hand back)."""
        return (self.qkv_proj.bias is None
                and cache_in_kernels(self.kernels, qkv.dtype, kv_cache)
                and qkv.dtype in KERNEL_DTYPES and qkv.is_contiguous()
                and (not meta.fresh or prefill_in_kernel(self.kernels, qkv.dtype, kv_cache)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor,
                kv_cache: PagedKV, meta: AttentionMetadata,
                lora: LoraLayer | None = None) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (this layer's output, the residual stream before it). The stream
        is x + residual, kept apart so that each add fuses into the norm that follows it;
        the first layer gets residual None."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # no random init: the weights come from the model file (and nn.Embedding's normal_
        # on the meta device imports torch._dynamo and triton: ~140 MB resident for nothing)
        empty = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=empty)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.decode_stack = None  # set by use_kernels where it applies
        self.int8_decode = False  # set by use_int8_decode: the stack's big batches on int8
        # steps come as prompt rows alone or decode rows alone (the runner's by_kind): the
        # stack runs prompt steps on the int8 weights at any size; with batch_invariant
        # (EngineConfig.deterministic) decode steps stay on the int4 ones at any size
        self.rows_by_kind = False
        self.batch_invariant = False
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta,
                                                       config.rope_scaling), persistent=False)
        self.rope_cache: tuple[Tensor, Tensor] | None = None   # set by cache_rope
        # a pipeline stage's neighbours (None: every layer here); its layers are the stage's
        self.stage_link: StageLink | None = None
        # a tensor-parallel rank's all-reduce where its decode stack may call it itself
        # (use_stack_all_reduce); None in one process, and over gloo
        self.stack_all_reduce: StackAllReduce | None = None
        # a tensor-parallel rank holding a KV head another rank holds too: which requests
        # it attends over it (the runner marks the others' rows in each step's meta.skip)
        self.head_share: HeadShare | None = None

    def cache_rope(self, max_positions: int, dtype: torch.dtype) -> None:
        """From now on, look each step's RoPE cos and sin up in tables for positions below
        `max_positions` (the engine's max_model_len; 2 MB on the default model), where
        computing them took about ten ops a step: in a decode step, after the weights have
        streamed through the caches, each costs tens of microseconds. Positions must stay
        below it."""
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        self.rope_cache = rope_cos_sin(positions, self.inv_freq, dtype)

    def tie_weights(self) -> None:
        # (a pipeline stage without the output projection has nothing to tie)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[PagedKV],
                meta: AttentionMetadata, lora: LoraStep | None = None) -> Tensor:
        """input_ids, positions [T] long -> final hidden states [T, hidden]. `lora`: the
        step's adapters, where a row has one (the decode stack adds them as the layers do).
        A pipeline stage but the first takes its input from the stage before; one but the
        last returns its last layer's output, whose row count is all the driver reads."""
        link = self.stage_link
        if link is not None and not link.is_first:
            shape = (2, input_ids.shape[0], self.config.hidden_size)
            x, residual = link.receive(shape, self.model.norm.weight.dtype)
            return self._layers(x, residual, positions, kv_caches, meta, lora)
        x = self.model.embed_tokens(input_ids)
        step = self._stack_step(kv_caches, meta)
        if step is not None:  # every layer in one compiled call (with the rows' adapters)
            adapters = [] if lora is None else lora.stack_tensors()
            caches = [c.data for c in kv_caches]
            scales = [c.scale for c in kv_caches] if kv_caches[0].scale is not None else []
            if self.rope_cache is not None:   # the stack looks each row up in the tables
                (cos, sin), rows = self.rope_cache, positions
            else:
                (cos, sin), rows = self._rope_rows(positions, x.dtype), None
            if isinstance(step, DecodeBatch):
                return self.decode_stack.forward(x, cos, sin, caches, scales, meta.slot_mapping,
                                                 step.block_tables, step.seq_lens, rows,
                                                 adapters, meta.skip)
            return self.decode_stack.forward_mixed(x, cos, sin, caches, scales,
                                                   meta.slot_mapping, step.decode_first,
                                                   step.block_tables, step.seq_lens,
                                                   step.chunk_info, step.chunk_tables, rows,
                                                   adapters, meta.skip)
        return self._layers(x, None, positions, kv_caches, meta, lora)

    def _layers(self, x: Tensor, residual: Tensor | None, positions: Tensor,
                kv_caches: list[PagedKV], meta: AttentionMetadata,
                lora: LoraStep | None) -> Tensor:
        """The layers one by one from (x, residual) [T, hidden] each, then the final norm,
        or, on a pipeline stage but the last, the stream sent on to the next stage."""
        cos, sin = self._rope_rows(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta,
                                None if lora is None else lora.layer(i))
        if self.stage_link is not None and not self.stage_link.is_last:
            self.stage_link.send(torch.stack((x, residual)))
            return x
        return self.model.norm(x, residual)[0]

    def _rope_rows(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [T, 1, head_dim] at the step's positions: from the tables (cache_rope), or
        computed."""
        if self.rope_cache is not None:
            cos, sin = self.rope_cache
            return cos[positions], sin[positions]
        return rope_cos_sin(positions, self.inv_freq, dtype)

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Run the norms and decode attention on compiled CPU kernels (None: torch only);
        call it after quantizing: where every layer's linears are int4 on the kernels, steps
        that only decode run through all layers in one call (decode_stack; use_int8_decode
        later gives it the int8 weights for steps of more than 8 rows)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, SwiGLU, GatheredHead)):
                module.kernels = kernels
        self.decode_stack = _build_decode_stack(self, kernels)

    def use_stack_all_reduce(self, all_reduce: StackAllReduce,
                             kernels: CpuKernels | None) -> None:
        """A tensor-parallel rank, once its group's all-reduce goes through shared memory:
        steps of decodes run through the whole-model decode stack (its heads and columns),
        which all-reduces the o and down projections' partial sums itself in C++, on the
        same handle, in the same order as the layers would; where there is no stack for
        this model, nothing changes."""
        self.stack_all_reduce = all_reduce
        self.use_kernels(kernels)
        if self.decode_stack is not None and self.int8_decode:
            self.use_int8_decode()

    def _stack_step(self, kv_caches: list[PagedKV], meta: AttentionMetadata
                    ) -> DecodeBatch | PromptStep | None:
        """The step as decode_stack runs it, with a bfloat16 cache or an int8 one (PagedKV's,
        quantized and read by the same kernels as the layers'), or None.

        A step that only decodes (DecodeBatch), any number of rows: up to 8 the layers would
        run the same int4 kernels; beyond, with int8 prompt matmuls (use_int8_decode), the
        same int8 tiles as the layers, so the stack's output is theirs, bit for bit, either
        way. Without them the stack keeps the int4 weights above 8 rows too, where the layers
        would run the dense bfloat16 copies on oneDNN (which a decode step reads from DRAM at
        3x the bytes: the stack was 1.18-1.65x faster there, 12-48 rows).

        A step with prompt chunks (PromptStep: its decodes on adjacent rows, each continued
        chunk attended alone) only with the int8 prompt matmuls: the stack then calls what
        the layers call, in the same order (each chunk on the prefill kernel, the decodes on
        the decode kernel), without the Python and torch work between the calls, ~12% of a
        prompt step's time on the default model."""
        if not self.stack_runs_decodes(kv_caches):
            return None
        if meta.decodes is not None:
            return meta.decodes
        return meta.prompt_step if self.int8_decode else None

    def stack_runs_decodes(self, kv_caches: list[PagedKV]) -> bool:
        """Whether every step of decodes runs in decode_stack with these caches (a bfloat16
        or an int8 cache): its inputs then need no attention groups (prepare_inputs)."""
        if self.decode_stack is None:
            return False
        cache = kv_caches[0]
        return cache.data.dtype == (torch.bfloat16 if cache.scale is None else torch.int8)

    def attends_chunks_alone(self, kv_caches: list[PagedKV]) -> bool:
        """Whether prompt chunks attend on the compiled prefill kernel over these caches: then
        a continued chunk attends alone whatever its length (prepare_inputs' chunks_alone)."""
        attention = self.model.layers[0].self_attn
        return prefill_in_kernel(attention.kernels, self.model.norm.weight.dtype, kv_caches[0])

    def use_int8_decode(self) -> None:
        """After the int8 prompt matmuls are set up (use_int8_dense): decode steps of more than
        max_packed_rows rows run the decode stack on the same int8 weights (w8a8_linear's
        arithmetic, so such a step computes what the layers would), and int8_decode says so;
        with rows_by_kind, steps of prompt chunks run on them at every size, and with
        batch_invariant too decode steps never do. Where a linear's int8 weight is not in
        quads, or there is no stack, nothing changes."""
        if self.decode_stack is None:
            return
        tensors, groups, rows = [], [], set()
        for layer in self.model.layers:
            for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj):
                if not (isinstance(p, PackedLinear) and p.int8_quads):
                    return
                tensors += [p.dense_q, p.dense_scales, p.smooth]
                groups.append(p.act_group)
                rows.add(p.max_packed_rows)
        if len(rows) != 1:
            return
        decode_rows = 1 << 40 if self.batch_invariant else rows.pop()
        self.decode_stack.use_int8(tensors, groups, decode_rows, self.rows_by_kind)
        self.int8_decode = True

    def int8_prefill_linears(self) -> list[tuple[nn.Module, bool]]:
        """The projections whose prompt-chunk matmuls may run on int8 activations (SmoothQuant,
        ember/engine/calibrate.py), each with whether its input has sharp outliers: q/k/v, o
        and gate/up (no), the down projection (yes: its input, silu(gate) * up, has the
        sharpest outliers per token; rounded to int8 per row it alone cost 2.7% perplexity
        on the default model, more than the other three together)."""
        return [pair for layer in self.model.layers
                for pair in ((layer.self_attn.qkv_proj, False), (layer.self_attn.o_proj, False),
                             (layer.mlp.gate_up_proj, False), (layer.mlp.down_proj, True))]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32."""
        return self.lm_head(hidden).float()

    def argmax_apart(self) -> bool:
        """Whether compute_argmax spares gathering the logits: the output projection's rows
        are split over tensor-parallel ranks, and its logits are the model's (a model whose
        compute_logits changes them, as a soft cap does, says no)."""
        return isinstance(self.lm_head, GatheredHead) and self.stage_link is None

    def compute_argmax(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> compute_logits(hidden).argmax(-1) [N] long, on every rank of
        a split output projection (argmax_apart) from each rank's best token."""
        if self.argmax_apart():
            return self.lm_head.argmax(hidden)
        return self.compute_logits(hidden).argmax(-1)


def decode_stack_weights(layer: LlamaDecoderLayer) -> list[Tensor]:
    """A layer's tensors in the order CpuKernels.decode_stack takes them (its projections
    int4 PackedLinears)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [layer.input_layernorm.weight, attn.qkv_proj.qweight, attn.qkv_proj.scales,
            attn.o_proj.qweight, attn.o_proj.scales, layer.post_attention_layernorm.weight,
            mlp.gate_up_proj.qweight, mlp.gate_up_proj.scales, mlp.down_proj.qweight,
            mlp.down_proj.scales]


def _build_decode_stack(model: LlamaForCausalLM, kernels: CpuKernels | None):
    """The compiled whole-model decode step, where it applies: AVX-512 BF16 kernels, a
    bfloat16 model with no biases whose every projection is int4 on those kernels (and
    head_dim 64 or 128), not a pipeline stage, and in one process or on a tensor-parallel
    rank whose all-reduce the stack can call (stack_all_reduce: shared memory); else None,
    and steps run layer by layer."""
    config = model.config
    if kernels is None or not kernels.has_bf16_dot or config.head_dim not in (64, 128):
        return None
    ranks = model.model.layers[0].self_attn.all_reduce is not None
    if model.stage_link is not None or (ranks and model.stack_all_reduce is None):
        return None   # the layers run one by one, with their all-reduces (gloo) or sends
    weights: list[Tensor] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(isinstance(p, PackedLinear) and p.kernels is not None and p.bias is None
                   for p in linears):
            return None
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.bfloat16 for w in norms):
            return None
        weights += decode_stack_weights(layer)
    if model.model.norm.weight.dtype != torch.bfloat16:
        return None
    stack = kernels.decode_stack(weights, model.model.norm.weight, config.num_heads,
                                 config.num_kv_heads, config.head_dim, config.rms_norm_eps,
                                 config.head_dim ** -0.5)
    if ranks:
        reduce = model.stack_all_reduce
        stack.use_all_reduce(reduce.handle, reduce.timeout_s, reduce.spin_us)
    return stack
