"""Attention over a paged KV cache.

Each layer's cache (PagedKV) is one tensor [2, num_kv_heads, num_blocks, block_size, head_dim]
(K then V), in the model's dtype or in int8 with one scale per token and head. Heads lead so
that a group's gathered context, [kv_heads, members, context, head_dim], feeds the attention
matmuls as it is, with no transposing copy.
A request's token i sits in block `block_ids[i // block_size]` at offset `i % block_size`; the
runner turns that into `slot_mapping` (block * block_size + offset) for the tokens of a step.

A step's new tokens form one flat batch. Requests are attended in two ways:

  fresh chunks   a prompt's first chunk (no earlier context): causal attention over the
                 chunk's own k and v, one SDPA call each (the flash kernel on CPU)
  groups         every other request (a decode, or a chunk that continues a prompt):
                 several requests at once, their queries padded to the group's longest and
                 their context gathered through block tables, under one boolean mask

The runner (runner/inputs.py) forms the groups and builds their masks once per step. This is
the plain torch path, the reference on CPU and CUDA alike. With compiled CPU kernels
(ember/kernels), a group whose members each bring one new token (decodes) attends in one
kernel call that reads the blocks in place, with no gathered copy of the context; and where
the CPU has AVX-512 BF16 and the cache is bfloat16, every prompt chunk (fresh or continued)
attends in a flash-attention kernel over its blocks (kernels.can_prefill).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.kernels import CpuKernels


@dataclass(frozen=True)
class FreshChunk:
    """A prompt's first chunk: its tokens attend only to each other."""

    token_start: int   # row of its first new token in the flat batch
    num_tokens: int
    block_table: Tensor | None = None  # [blocks] long: where its k and v go (for kernels)


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together over their paged context.

    rows          [G, max_n] long: flat-batch row of each member's i-th new token (padding
                  repeats a real row; its output is dropped)
    valid_flags   [G, max_n] long: 1 where those are real (valid: as bool, when first asked for)
    block_tables  [G, max_blocks] long: each member's context blocks, 0-padded
    out_rows      [num valid] long: rows[valid], where the outputs go
    seq_lens      [G] long: each member's context after this step (its new tokens included)
    num_new       [G] long: each member's new tokens
    block_size    the cache's tokens per block
    whole_batch   the group is the step's whole flat batch, rows 0..T-1 in order, no padding
                  (every step that only decodes): queries and outputs need no indexing
    lone          (first row, seq_len) when the group has one member (a continued prompt
                  chunk): its rows are contiguous, for the prefill kernel
    span          (first row, count) when every member has one new token and their rows
                  are first .. first + count - 1 in order (a step's decodes beside prompt
                  chunks, nearly always): queries and outputs by slice (out_index), not by an
                  index tensor's gather and scatter
    prompt        every member is a prompt chunk (by kind, runner/inputs.py): a lone one
                  attends on the prefill kernel however few its rows
    valid, mask, bias  built when first asked for (the kernels never need them), see below
    """

    rows: Tensor
    valid_flags: Tensor
    block_tables: Tensor
    out_rows: Tensor
    seq_lens: Tensor
    num_new: Tensor
    block_size: int
    whole_batch: bool = False
    lone: tuple[int, int] | None = None
    span: tuple[int, int] | None = None
    prompt: bool = False   # prompt chunks (a lone one attends on the prefill kernel, even a row)

    @property
    def out_index(self) -> slice | Tensor:
        """Where the group's outputs go in the step's flat batch: a slice where it spans
        contiguous rows, else out_rows."""
        if self.span is None:
            return self.out_rows
        first, count = self.span
        return slice(first, first + count)

    @functools.cached_property
    def valid(self) -> Tensor:
        """[G, max_n] bool: which rows are real. A torch op of its own, which a step on the
        kernels never needs (~10 us a decode step, where the caches are cold)."""
        return self.valid_flags.bool()

    @functools.cached_property
    def mask(self) -> Tensor:
        """[G, 1, max_n, max_blocks * block_size] bool: key j is visible to new token i of
        member g iff j < seq_len_g and j <= seq_len_g - n_g + i (padding rows see key 0 only,
        so that no row is fully masked)."""
        context = self.block_tables.shape[1] * self.block_size
        max_n = self.rows.shape[1]
        key_pos = torch.arange(context, device=self.rows.device)[None, None, :]
        seq_lens = self.seq_lens[:, None, None]
        query_pos = (self.seq_lens[:, None] - self.num_new[:, None]
                     + torch.arange(max_n, device=self.rows.device)[None, :])[:, :, None]
        mask = (key_pos < seq_lens) & (key_pos <= query_pos)
        mask |= (~self.valid[:, :, None]) & (key_pos == 0)
        return mask[:, None]

    @functools.cached_property
    def bias(self) -> Tensor:
        """The mask as float32 0 / -inf, for the matmul path (few queries per member)."""
        return torch.zeros(self.mask.shape, dtype=torch.float32,
                           device=self.mask.device).masked_fill_(~self.mask, float("-inf"))


@dataclass(frozen=True)
class DecodeBatch:
    """A step that only decodes (one new token per request), every request in row order,
    for a kernel that attends them all in one call whatever their lengths (the groups above
    split uneven lengths apart for the padded torch path)."""

    block_tables: Tensor   # [T, max_blocks] long, 0-padded
    seq_lens: Tensor       # [T] long: context after this step, the new token included


@dataclass(frozen=True)
class PromptStep:
    """A step with prompt chunks, laid out for a kernel that runs it whole (the decode
    stack's forward_mixed): its decodes (one new token each) on rows decode_first ..
    decode_first + D - 1, and each prompt chunk (fresh, or continued and attended alone) as
    a row of chunk_info with its block table."""

    decode_first: int
    block_tables: Tensor        # [D, max_blocks] long, 0-padded (D may be 0)
    seq_lens: Tensor            # [D] long: context after this step, the new token included
    chunk_info: Tensor          # [C, 4] long: first row, new tokens, seq_len, fresh (0 / 1)
    chunk_tables: list[Tensor]  # [C] of [blocks] long: each chunk's context blocks


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Tensor               # [T] long: cache slot of each new token
    fresh: list[FreshChunk] = field(default_factory=list)
    groups: list[AttentionGroup] = field(default_factory=list)
    decodes: DecodeBatch | None = None  # the step's requests when it only decodes
    prompt_step: PromptStep | None = None  # else, where its shape allows (see PromptStep)
    # [T] long, a tensor-parallel rank's where it shares a KV head with another: per row, a
    # bit per KV head whose query heads that row leaves to the other rank (outputs zeros;
    # ember/models/parallel.py HeadShare); None: every row attends every head
    skip: Tensor | None = None


@dataclass
class PagedKV:
    """One layer's KV cache.

    data   [2, kv_heads, num_blocks, block_size, head_dim]: the model's dtype, or int8
    scale  [2, kv_heads, num_blocks, block_size] float16, for int8 only: x = data * scale,
           with scale = max|x| / 127 over each token's head (symmetric, per token and head)
    """

    data: Tensor
    scale: Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.data.shape[3]

    def write(self, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store the step's k, v [T, kv_heads, head_dim] at their slots."""
        _, kv_heads, num_blocks, block_size, head_dim = self.data.shape
        num_slots = num_blocks * block_size
        for which, x in ((0, k), (1, v)):
            if self.scale is not None:
                x, scale = quantize_int8(x)
                self.scale[which].view(kv_heads, num_slots).index_copy_(
                    1, slot_mapping, scale.transpose(0, 1))
            self.data[which].view(kv_heads, num_slots, head_dim).index_copy_(
                1, slot_mapping, x.transpose(0, 1))

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy slots src [N] long (K, V and scales) into slots dst [N], all read before any is
        written."""
        _, kv_heads, num_blocks, block_size, head_dim = self.data.shape
        data = self.data.view(2 * kv_heads, num_blocks * block_size, head_dim)
        data.index_copy_(1, dst, data.index_select(1, src))
        if self.scale is not None:
            scale = self.scale.view(2 * kv_heads, num_blocks * block_size)
            scale.index_copy_(1, dst, scale.index_select(1, src))

    def gather(self, block_tables: Tensor, dtype: torch.dtype) -> Tensor:
        """K and V of block_tables [G, max_blocks] -> [2, kv_heads, G, max_blocks * block_size,
        head_dim] in `dtype` (the model's, or float32 for small attention)."""
        _, kv_heads, num_blocks, block_size, head_dim = self.data.shape
        members, max_blocks = block_tables.shape
        # index_select over whole blocks: 2.5-4x faster than advanced indexing on CPU
        flat = block_tables.flatten()
        x = self.data.view(2 * kv_heads, num_blocks, -1).index_select(1, flat)
        x = x.view(2, kv_heads, members, max_blocks * block_size, head_dim).to(dtype)
        if self.scale is None:
            return x
        scale = self.scale.view(2 * kv_heads, num_blocks, -1).index_select(1, flat)
        return x * scale.view(2, kv_heads, members, -1, 1).to(dtype)


FP16_MIN_NORMAL = 2.0 ** -14


def quantize_int8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [T, heads, head_dim] -> (int8 values, float16 scales [T, heads]).

    The scale is rounded to float16 before quantizing, so that value * stored scale is within
    half a step of x (heads whose values are all below ~2e-3 get the smallest normal scale).
    """
    scale = (x.abs().amax(dim=-1).float() / 127.0).clamp(min=FP16_MIN_NORMAL)
    scale = scale.to(torch.float16)
    q = (x.float() / scale.float()[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: PagedKV,
                    meta: AttentionMetadata, scale: float,
                    kernels: CpuKernels | None = None) -> Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads, head_dim].

    Writes k and v into the cache, then attends each new token over its request's context.
    """
    kv_cache.write(k, v, meta.slot_mapping)
    if not meta.fresh or prefill_in_kernel(kernels, q.dtype, kv_cache):
        return attend_cached(q, kv_cache, meta, scale, kernels, (k, v))
    out = torch.empty_like(q)
    for chunk in meta.fresh:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        # 4-D with a batch of one: CPU's flash kernel runs 3-D inputs 2x slower
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None],
            v[rows].transpose(0, 1)[None], is_causal=True, scale=scale,
            enable_gqa=True)[0].transpose(0, 1)
    for group in meta.groups:
        out[group.out_index] = _group_attention(q, kv_cache, group, scale, kernels)
    return out


def attend_cached(q: Tensor, kv_cache: PagedKV, meta: AttentionMetadata, scale: float,
                  kernels: CpuKernels | None = None,
                  new_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Attention for a step whose new k and v are already in the cache (fresh chunks only
    with the prefill kernel): q [T, heads, head_dim] -> [T, heads, head_dim]. With an int8
    cache, a fresh chunk attends over its own k and v as computed, `new_kv` ([T, kv_heads,
    head_dim] each, k rotated), not as rounded into the cache, as the torch path does: its
    first token is then the bfloat16 cache's (the rounding cost a prompt ~0.15% perplexity
    and flipped close first tokens); later tokens read the int8 cache."""
    if not meta.fresh and len(meta.groups) == 1 and meta.groups[0].whole_batch:
        return _group_attention(q, kv_cache, meta.groups[0], scale, kernels)  # all decodes
    out = torch.empty_like(q)
    for chunk in meta.fresh:
        assert kernels is not None and chunk.block_table is not None
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        if kv_cache.scale is not None and new_kv is not None:
            k, v = new_kv  # the chunk's own k and v as one bfloat16 block: [2, kv_heads, 1, n, d]
            own = torch.stack((k[rows].transpose(0, 1), v[rows].transpose(0, 1))).unsqueeze(2)
            out[rows] = kernels.prefill_attention(q[rows], own, ONE_BLOCK, chunk.num_tokens,
                                                  scale)
            continue
        out[rows] = kernels.prefill_attention(q[rows], kv_cache.data, chunk.block_table,
                                              chunk.num_tokens, scale, kv_cache.scale)
    for group in meta.groups:
        out[group.out_index] = _group_attention(q, kv_cache, group, scale, kernels)
    return out


def prefill_in_kernel(kernels: CpuKernels | None, dtype: torch.dtype, kv_cache: PagedKV
                      ) -> bool:
    """Whether prompt chunks with activations of `dtype` attend in the compiled prefill
    kernel, reading the cache (a bfloat16 one, or int8 with bfloat16 activations)."""
    return (kernels is not None and kernels.can_prefill(kv_cache.data)
            and (dtype == kv_cache.data.dtype if kv_cache.scale is None
                 else dtype == torch.bfloat16))


def cache_in_kernels(kernels: CpuKernels | None, dtype: torch.dtype, kv_cache: PagedKV
                     ) -> bool:
    """Whether the compiled kernels write this cache and attend decodes over it in place,
    with activations of `dtype`: a cache in that dtype, or an int8 one (k and v quantized as
    PagedKV.write does) with bfloat16 activations, head_dim 64 or 128, AVX-512 BF16."""
    if kernels is None:
        return False
    if kv_cache.scale is None:
        return kv_cache.data.dtype == dtype
    return prefill_in_kernel(kernels, dtype, kv_cache)


def _group_attention(q: Tensor, kv_cache: PagedKV, group: AttentionGroup, scale: float,
                     kernels: CpuKernels | None = None) -> Tensor:
    """Returns [num valid rows, heads, head_dim], in the order of rows[valid]."""
    members, max_blocks = group.block_tables.shape
    context = max_blocks * kv_cache.block_size
    max_n = group.rows.shape[1]
    if group.lone is not None and (max_n > 1 or group.prompt) and \
            prefill_in_kernel(kernels, q.dtype, kv_cache):
        row, seq_len = group.lone
        return kernels.prefill_attention(q[row:row + max_n], kv_cache.data,
                                         group.block_tables[0], seq_len, scale, kv_cache.scale)
    if max_n == 1 and cache_in_kernels(kernels, q.dtype, kv_cache):
        # one new token each: out_rows are the queries' rows, a slice where they lie
        # together (always for whole_batch: 0 .. T-1)
        queries = q[group.out_index]
        return kernels.decode_attention(queries, kv_cache.data, group.block_tables,
                                        group.seq_lens, scale, kv_cache.scale)
    if group.whole_batch:  # the rows are 0..T-1 in order: no gather of queries
        queries = q.view(members, max_n, *q.shape[1:])
    else:
        queries = q[group.rows]                              # [G, max_n, heads, head_dim]
    small = max_n <= MATMUL_MAX_QUERIES and members * context <= SMALL_ATTENTION_KEYS
    # bf16 matmuls cost ~14 us each when tiny, float32 ones ~4 us
    keys, values = kv_cache.gather(group.block_tables, torch.float32 if small else q.dtype)
    if max_n <= MATMUL_MAX_QUERIES or (members == 1 and max_n <= MATMUL_MAX_QUERIES_ALONE):
        out = _matmul_attention(queries, keys, values, group.bias, scale)
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=group.mask, scale=scale,
            enable_gqa=True).transpose(1, 2)                 # [G, max_n, heads, head_dim]
    if out.shape[0] * out.shape[1] == group.out_rows.shape[0]:
        return out.reshape(-1, *out.shape[2:])               # no padding: every row is real
    return out[group.valid]


ONE_BLOCK = torch.zeros(1, dtype=torch.long)  # the block table of a chunk's own k and v

# up to this many new tokens per member, plain matmuls beat the SDPA kernel, whose masked
# bfloat16 path is 3-17x slower for decode-sized queries on CPU
MATMUL_MAX_QUERIES = 16
# and for a group of one (a prompt's suffix after a prefix-cache hit) up to this many
MATMUL_MAX_QUERIES_ALONE = 128
# up to this many keys in a group, float32 matmuls (~4 us) beat bfloat16 ones (~14 us)
SMALL_ATTENTION_KEYS = 1024


def _matmul_attention(queries: Tensor, keys: Tensor, values: Tensor, bias: Tensor,
                      scale: float) -> Tensor:
    """queries [G, n, heads, d], keys/values [kv_heads, G, ctx, d], bias [G, 1, n, ctx] ->
    [G, n, heads, d]. The heads sharing a KV head are stacked as extra query rows, so each
    KV head is read once; softmax runs in float32."""
    out_dtype = queries.dtype
    members, n, heads, d = queries.shape
    kv_heads = keys.shape[0]
    per_kv = heads // kv_heads
    stacked = queries.to(keys.dtype).view(members, n, kv_heads, per_kv, d) \
        .permute(2, 0, 3, 1, 4).reshape(kv_heads, members, per_kv * n, d)
    scores = torch.matmul(stacked, keys.transpose(-1, -2)).float() * scale
    scores = scores.view(kv_heads, members, per_kv, n, -1) + bias.view(1, members, 1, n, -1)
    probs = torch.softmax(scores, dim=-1).to(values.dtype).view(kv_heads, members, per_kv * n,
                                                                -1)
    out = torch.matmul(probs, values).view(kv_heads, members, per_kv, n, d)
    return out.permute(1, 3, 0, 2, 4).reshape(members, n, heads, d).to(out_dtype)
