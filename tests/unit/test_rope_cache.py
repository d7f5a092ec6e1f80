"""RoPE's cos and sin looked up in tables (LlamaForCausalLM.cache_rope) against computing them
per step (rope_cos_sin): the same values bit for bit, in the layout the kernels take."""
from __future__ import annotations

import torch

from ember.config import ModelConfig
from ember.models.layers import rope_cos_sin
from ember.models.llama import LlamaForCausalLM


def test_cached_rope_is_what_each_step_computed():
    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64,
                         intermediate_size=128, num_layers=1, num_heads=4, num_kv_heads=2,
                         head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.cache_rope(4096, torch.bfloat16)
    positions = torch.tensor([0, 1, 17, 300, 4095, 5])
    want = rope_cos_sin(positions, model.inv_freq, torch.bfloat16)
    for table, expected in zip(model.rope_cache, want):
        got = table[positions]
        assert got.shape == (6, 1, 16) and got.dtype == torch.bfloat16 and got.is_contiguous()
        assert torch.equal(got, expected)
