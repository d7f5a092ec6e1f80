"""Attention over the paged KV cache with a sliding window and/or soft-capped scores.

The plain torch path of attention.py, with two more rules on top of causality:

  window   new token at position p sees keys at p - window < j <= p (Mistral, Gemma's local
           layers, Phi-3), as transformers' sliding-window mask
  softcap  scores = cap * tanh(scores / cap) before the mask and softmax (Gemma 2)

The compiled kernels attend whole contexts without either rule, so these layers never use them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.models.attention import AttentionGroup, AttentionMetadata, PagedKV


def windowed_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: PagedKV,
                       meta: AttentionMetadata, scale: float, window: int | None,
                       softcap: float | None) -> Tensor:
    """q [T, heads, head_dim], k/v [T, kv_heads, head_dim] -> [T, heads, head_dim].

    Writes k and v into the cache, then attends each new token over its request's context."""
    kv_cache.write(k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    for chunk in meta.fresh:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        pos = torch.arange(chunk.num_tokens, device=q.device)
        mask = _visible(pos[:, None], pos[None, :], window)            # [n, n]
        keys, values = (x[rows].transpose(0, 1)[:, None] for x in (k, v))  # [kv, 1, n, d]
        out[rows] = attend(q[rows][None], keys, values, mask[None, None], scale, softcap)[0]
    for group in meta.groups:
        out[group.out_index] = _group(q, kv_cache, group, scale, window, softcap)
    return out


def _visible(query_pos: Tensor, key_pos: Tensor, window: int | None) -> Tensor:
    """Causal mask, limited to the window: key j is visible to a query at p iff j <= p and
    p - j < window."""
    mask = key_pos <= query_pos
    return mask if window is None else mask & (query_pos - key_pos < window)


def _group(q: Tensor, kv_cache: PagedKV, group: AttentionGroup, scale: float,
           window: int | None, softcap: float | None) -> Tensor:
    """One group's outputs [num valid rows, heads, head_dim], in the order of rows[valid]."""
    keys, values = kv_cache.gather(group.block_tables, q.dtype)   # [kv, G, ctx, d] each
    mask = group.mask                                             # [G, 1, n, ctx]
    if window is not None:
        context = keys.shape[2]
        key_pos = torch.arange(context, device=q.device)[None, None, :]
        query_pos = (group.seq_lens[:, None] - group.num_new[:, None]
                     + torch.arange(group.rows.shape[1], device=q.device)[None, :])[:, :, None]
        # padding rows keep their one visible key, so that no row is fully masked
        recent = (query_pos - key_pos < window) | ~group.valid[:, :, None]
        mask = mask & recent[:, None]
    out = attend(q[group.rows], keys, values, mask, scale, softcap)   # [G, n, heads, d]
    return out[group.valid]


def attend(queries: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
           softcap: float | None) -> Tensor:
    """queries [G, n, heads, d], keys/values [kv_heads, G, ctx, d], mask [G, 1, n, ctx] bool
    -> [G, n, heads, d]. Without a cap, SDPA; with one, float32 matmuls (SDPA has no cap)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)
    per_kv = queries.shape[2] // keys.shape[0]
    keys = keys.float().repeat_interleave(per_kv, dim=0)        # [heads, G, ctx, d]
    values = values.float().repeat_interleave(per_kv, dim=0)
    scores = torch.einsum("gnhd,hgcd->ghnc", queries.float(), keys) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("ghnc,hgcd->gnhd", probs, values).to(queries.dtype)
