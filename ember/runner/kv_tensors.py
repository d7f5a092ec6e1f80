"""The KV cache's tensors: how many blocks fit a memory budget, and allocating them."""
from __future__ import annotations

import torch

from ember.config import CacheConfig, ModelConfig

GIB = 1 << 30


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * model.num_layers * model.kv_size * torch.tensor([], dtype=dtype).element_size()


def plan_num_blocks(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    """Blocks that fit `cache.kv_cache_gib` (or `cache.num_blocks` when given)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = kv_bytes_per_token(model, dtype) * cache.block_size
    return max(1, int(cache.kv_cache_gib * GIB) // bytes_per_block)


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """One tensor per layer: [2 (K, V), num_blocks, block_size, kv_heads, head_dim]."""
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
