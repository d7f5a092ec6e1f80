"""Attention over a paged KV cache.

Each layer's cache (PagedKV) is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), in the model's dtype or in int8 with one scale per token and head.
A request's token i sits in block `block_ids[i // block_size]` at offset `i % block_size`; the
runner turns that into `slot_mapping` (block * block_size + offset) for the tokens of a step.

A step's new tokens form one flat batch. Requests are attended in two ways:

  fresh chunks   a prompt's first chunk (no earlier context): causal attention over the
                 chunk's own k and v, one SDPA call each (the flash kernel on CPU)
  groups         every other request (a decode, or a chunk that continues a prompt):
                 several requests at once, their queries padded to the group's longest and
                 their context gathered through block tables, under one boolean mask

The runner (runner/inputs.py) forms the groups and builds their masks once per step. This is
the plain torch path, the reference on CPU and CUDA alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class FreshChunk:
    """A prompt's first chunk: its tokens attend only to each other."""

    token_start: int   # row of its first new token in the flat batch
    num_tokens: int


@dataclass(frozen=True)
class AttentionGroup:
    """Requests attended together over their paged context.

    rows          [G, max_n] long: flat-batch row of each member's i-th new token (padding
                  repeats a real row; its output is dropped)
    valid         [G, max_n] bool: which of those are real
    block_tables  [G, max_blocks] long: each member's context blocks, 0-padded
    mask          [G, 1, max_n, max_blocks * block_size] bool: key j is visible to new token i
                  of member g iff j < seq_len_g and j <= seq_len_g - n_g + i (padding rows see
                  key 0 only, so that no row is fully masked)
    """

    rows: Tensor
    valid: Tensor
    block_tables: Tensor
    mask: Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: Tensor               # [T] long: cache slot of each new token
    fresh: list[FreshChunk] = field(default_factory=list)
    groups: list[AttentionGroup] = field(default_factory=list)


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
    for chunk in meta.fresh:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
    for group in meta.groups:
        out[group.rows[group.valid]] = _group_attention(q, kv_cache, group, scale)
    return out


def _group_attention(q: Tensor, kv_cache: PagedKV, group: AttentionGroup,
                     scale: float) -> Tensor:
    """Returns [num valid rows, heads, head_dim], in the order of rows[valid]."""
    members, max_blocks = group.block_tables.shape
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    context = max_blocks * block_size
    keys = kv_cache.gather(0, group.block_tables, q.dtype).view(members, context, kv_heads,
                                                                head_dim)
    values = kv_cache.gather(1, group.block_tables, q.dtype).view(members, context, kv_heads,
                                                                  head_dim)
    queries = q[group.rows]                                   # [G, max_n, heads, head_dim]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=group.mask, scale=scale, enable_gqa=True)  # [G, heads, max_n, head_dim]
    return out.transpose(1, 2)[group.valid]
