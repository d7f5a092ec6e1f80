"""The KV cache's tensors: how many blocks fit a memory budget, and allocating them."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ember.config import CacheConfig, ModelConfig
from ember.kernels import CpuKernels
from ember.models.attention import PagedKV

GIB = 1 << 30
SCALE_DTYPE = torch.float16


def resolve_kv_cache_dtype(name: str, quantization: str, dtype: torch.dtype, head_dim: int,
                           kernels: CpuKernels | None) -> str:
    """'auto' is int8 for int4 weights (the default format, whose quality budget is 5% of
    bfloat16's perplexity; the int8 cache moves it by under 0.3%) where the compiled attention
    kernels read an int8 cache in place (a bfloat16 model, head_dim 64 or 128, AVX-512 BF16
    and VNNI): half the bytes a token of bfloat16 and more output under load, as decode
    attention reads half the bytes on int8 dot products. Else 'model',
    the model's own dtype: int8 and dense weights are chosen for their quality (budget 1%).
    An explicit choice is kept (int8 without the kernels takes the torch path)."""
    if name != "auto":
        return name
    reads_int8 = (quantization == "int4" and dtype == torch.bfloat16 and kernels is not None
                  and kernels.attends_head_dim(head_dim))
    return "int8" if reads_int8 else "model"


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "model"
                       ) -> int:
    """K and V of one token in every layer (int8: one byte a value plus a float16 scale per
    head, ~1.94x the tokens of bf16 in the same memory)."""
    num_values = 2 * model.num_layers * model.kv_size
    if kv_cache_dtype == "int8":
        num_scales = 2 * model.num_layers * model.num_kv_heads
        return num_values + num_scales * torch.tensor([], dtype=SCALE_DTYPE).element_size()
    return num_values * torch.tensor([], dtype=dtype).element_size()


def plan_num_blocks(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype,
                    kv_cache_dtype: str) -> int:
    """Blocks that fit `cache.kv_cache_gib` (or `cache.num_blocks` when given), the cache in
    `kv_cache_dtype` (resolved: int8 or model)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    bytes_per_block = kv_bytes_per_token(model, dtype, kv_cache_dtype) * cache.block_size
    return max(1, int(cache.kv_cache_gib * GIB) // bytes_per_block)


def allocate_kv_caches(model: ModelConfig, num_blocks: int, block_size: int,
                       dtype: torch.dtype, device: str, kv_cache_dtype: str = "model",
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
