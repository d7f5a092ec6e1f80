"""Attention over a paged KV cache.

Each layer's cache is one tensor [2, num_blocks, block_size, num_kv_heads, head_dim] (K then V).
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


def write_kv(kv_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store the step's k, v [T, kv_heads, head_dim] at their slots."""
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    kv_cache[0].view(num_slots, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(num_slots, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor,
                    meta: AttentionMetadata, scale: float) -> Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads, head_dim].

    Writes k and v into the cache, then attends each new token over its request's context.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[:meta.num_decodes] = _decode_attention(q[:meta.num_decodes], kv_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], kv_cache, chunk, scale)
    return out


def _decode_attention(q: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                      scale: float) -> Tensor:
    """q [B, heads, head_dim]: one query per request, all requests in one SDPA call."""
    tables, seq_lens = meta.decode_block_tables, meta.decode_seq_lens
    batch, max_blocks = tables.shape
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    keys = kv_cache[0][tables].view(batch, max_blocks * block_size, kv_heads, head_dim)
    values = kv_cache[1][tables].view(batch, max_blocks * block_size, kv_heads, head_dim)
    # key slot j of request b is real when j < seq_lens[b]; the padding is masked out
    mask = torch.arange(max_blocks * block_size, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
    return out[:, :, 0, :]


def _prefill_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, chunk: PrefillChunk,
                       scale: float) -> Tensor:
    """q [n, heads, head_dim] for the chunk's n new tokens, causal over its whole context."""
    n = chunk.num_tokens
    if chunk.seq_len == n:  # no earlier context: attend over this step's k and v directly
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
            is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    block_size, kv_heads, head_dim = kv_cache.shape[2:]
    keys = kv_cache[0][chunk.block_ids].view(-1, kv_heads, head_dim)[:chunk.seq_len]
    values = kv_cache[1][chunk.block_ids].view(-1, kv_heads, head_dim)[:chunk.seq_len]
    # new token i sits at position seq_len - n + i and sees keys at positions <= its own
    query_pos = torch.arange(chunk.seq_len - n, chunk.seq_len, device=q.device)
    mask = torch.arange(chunk.seq_len, device=q.device)[None, :] <= query_pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask[None], scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
