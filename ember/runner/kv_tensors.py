"""The KV cache's tensors: how many blocks fit a memory budget, and allocating them."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ember.config import CacheConfig, ModelConfig
from ember.models.attention import PagedKV

GIB = 1 << 30
SCALE_DTYPE = torch.float16


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto"
                       ) -> int:
    """K and V of one token in every layer (int8: one byte a value plus a float16 scale per
    head, ~1.94x the tokens of bf16 in the same memory)."""
    num_values = 2 * model.num_layers * model.kv_size
    if kv_cache_dtype == "int8":
        num_scales = 2 * model.num_layers * model.num_kv_heads
        return num_values + num_scales * torch.tensor([], dtype=SCALE_DTYPE).element_size()
    return num_values * torch.tensor([], dtype=dtype).element_size()


def plan_num_blocks(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks that fit `cache.kv_cache_gib` (or `cache.num_blocks` when given)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = kv_bytes_per_token(model, dtype, cache.kv_cache_dtype) * cache.block_size
    return max(1, int(cache.kv_cache_gib * GIB) // bytes_per_block)


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str, kv_cache_dtype: str = "auto",
                       zeros: Callable[..., torch.Tensor] | None = None) -> list[PagedKV]:
    """One PagedKV per layer: [2 (K, V), kv_heads, num_blocks, block_size, head_dim], each
    tensor made by zeros(shape, dtype, device) (default torch.zeros; the engine passes one
    that asks for huge pages)."""
    make = zeros or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
    shape = (2, model.num_kv_heads, num_blocks, block_size, model.head_dim)
    if kv_cache_dtype == "int8":
        return [PagedKV(make(shape, torch.int8, device), make(shape[:-1], SCALE_DTYPE, device))
                for _ in range(model.num_layers)]
    return [PagedKV(make(shape, dtype, device)) for _ in range(model.num_layers)]
