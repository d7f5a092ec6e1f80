"""Attention over a paged KV cache.

Each layer's cache (PagedKV) is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), in the model's dtype or in int8 with one scale per token and head.
A request's token i sits in block `block_ids[i // block_size]` at offset `i % block_size`; the
runner turns that into `slot_mapping` (block * block_size + offset) for the tokens of a step.

The flat batch of a step is ordered decodes first:

    rows [0, num_decodes)        one new token per request: one batched SDPA call
    rows [num_decodes, T)        prefill chunks, one SDPA call each

This is the plain torch path, the reference on CPU and CUDA alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class PrefillChunk:
    """One request's chunk of more than one new token."""

    token_start: int   # row of its first new token in the flat batch
    num_tokens: int    # new tokens this step
    seq_len: int       # tokens in its context after this step (earlier ones + new ones)
    block_ids: Tensor  # [ceil(seq_len / block_size)] long: blocks holding the context


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Tensor               # [T] long: cache slot of each new token
    num_decodes: int = 0
    decode_block_tables: Tensor | None = None  # [num_decodes, max_blocks] long, 0-padded
    decode_seq_lens: Tensor | None = None      # [num_decodes] long
    prefills: list[PrefillChunk] = field(default_factory=list)


@dataclass
class PagedKV:
    """One layer's KV cache.

    data   [2, num_blocks, block_size, kv_heads, head_dim]: the model's dtype, or int8
    scale  [2, num_blocks, block_size, kv_heads] float16, for int8 only: x = data * scale,
           with scale = max|x| / 127 over each token's head (symmetric, per token and head)
    """

    data: Tensor
    scale: Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def write(self, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
        """Store the step's k, v [T, kv_heads, head_dim] at their slots."""
        num_slots = self.data.shape[1] * self.data.shape[2]
        for which, x in ((0, k), (1, v)):
            if self.scale is not None:
                x, scale = quantize_int8(x)
                self.scale[which].view(num_slots, -1).index_copy_(0, slot_mapping, scale)
            self.data[which].view(num_slots, *x.shape[1:]).index_copy_(0, slot_mapping, x)

    def gather(self, which: int, block_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """K (0) or V (1) of `block_ids` (any shape) -> [*block_ids.shape, block_size,
        kv_heads, head_dim] in `dtype`."""
        x = self.data[which][block_ids]
        if self.scale is None:
            return x
        return x.to(dtype) * self.scale[which][block_ids].to(dtype)[..., None]


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
                    meta: AttentionMetadata, scale: float) -> Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads, head_dim].

    Writes k and v into the cache, then attends each new token over its request's context.
    """
    kv_cache.write(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode_attention(q[:meta.num_decodes], kv_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk, scale)
    return out


def _decode_attention(q: Tensor, kv_cache: PagedKV, meta: AttentionMetadata,
                      scale: float) -> Tensor:
    """q [B, heads, head_dim]: one query per request, all requests in one SDPA call."""
    tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
    batch, max_blocks = tables.shape
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    keys = kv_cache.gather(0, tables, q.dtype).view(batch, max_blocks * block_size, kv_heads,
                                                    head_dim)
    values = kv_cache.gather(1, tables, q.dtype).view(batch, max_blocks * block_size, kv_heads,
                                                      head_dim)
    # key slot j of request b is real when j < seq_lens[b]; the padding is masked out
    mask = torch.arange(max_blocks * block_size, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: PagedKV, chunk: PrefillChunk,
                       scale: float) -> Tensor:
    """q [n, heads, head_dim] for the chunk's n new tokens, causal over its whole context."""
    n = chunk.num_tokens
    if chunk.seq_len == n:  # no earlier context: attend over this step's k and v directly
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    keys = kv_cache.gather(0, chunk.block_ids, q.dtype).view(-1, kv_heads, head_dim)
    values = kv_cache.gather(1, chunk.block_ids, q.dtype).view(-1, kv_heads, head_dim)
    keys, values = keys[:chunk.seq_len], values[:chunk.seq_len]
    # new token i sits at position seq_len - n + i and sees keys at positions <= its own
    query_pos = torch.arange(chunk.seq_len - n, chunk.seq_len, device=q.device)
    mask = torch.arange(chunk.seq_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask[None], scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
