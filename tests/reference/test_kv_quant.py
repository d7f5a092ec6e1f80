"""KV-cache int8 and the perplexity measure.

References: transformers for the perplexity arithmetic; bf16 KV for int8 KV (closeness rule
for greedy tokens, perplexity within 1%); the byte count per token for capacity.
"""
from __future__ import annotations

import math

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.workloads import default_corpus
from ember.engine.perplexity import perplexity
from ember.models.attention import quantize_int8
from ember.runner.kv_tensors import resolve_kv_cache_dtype
from tests.conftest import CHAT_PROMPTS, assert_greedy_close


def test_int8_round_trip_error_is_within_half_a_step():
    x = torch.randn(50, 3, 64) * torch.linspace(0.01, 5, 50)[:, None, None]
    q, scale = quantize_int8(x)
    back = q.float() * scale.float()[..., None]
    step = scale.float()[..., None]
    assert q.dtype == torch.int8 and scale.shape == (50, 3)
    assert ((back - x).abs() <= 0.5 * step * 1.01 + 1e-6).all()


def test_perplexity_equals_transformers(smollm_llm, hf_smollm):
    ids = smollm_llm.tokenizer.encode(default_corpus(), add_special_tokens=False)[:600]
    ours = perplexity(smollm_llm.engine, ids, window=300)
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, 600, 300):
            window = torch.tensor([ids[start:start + 300]])
            logprobs = hf_smollm(window).logits[0].float().log_softmax(-1)
            nll -= float(logprobs[:-1].gather(-1, window[0, 1:, None]).sum())
            n += 299
    assert ours["tokens_scored"] == n
    assert ours["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)


def test_second_half_scoring_with_a_first_token_equals_transformers(smollm_llm, hf_smollm):
    """llama-perplexity's windows: each window's first token replaced (by BOS), only the
    tokens at positions window/2 + 1 .. window - 1 scored."""
    ids = smollm_llm.tokenizer.encode(default_corpus(), add_special_tokens=False)[:400]
    bos = 1
    ours = perplexity(smollm_llm.engine, ids, window=200, scored_from=101, first_token=bos)
    nll, n = 0.0, 0
    with torch.no_grad():
        for start in range(0, 400, 200):
            window = torch.tensor([[bos, *ids[start + 1:start + 200]]])
            logprobs = hf_smollm(window).logits[0].float().log_softmax(-1)
            nll -= float(logprobs[100:-1].gather(-1, window[0, 101:, None]).sum())
            n += 99
    assert ours["tokens_scored"] == n
    assert ours["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-4)


@pytest.fixture(scope="module")
def bf16_pair(smollm_path):
    """The default model in bf16 with bf16 and int8 KV, stepping 32 tokens at a time so that
    most tokens attend over cached K and V."""
    return {kv: LLM(str(smollm_path), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_gib=0.25,
                    max_num_batched_tokens=32) for kv in ("model", "int8")}


def test_int8_kv_fits_at_least_1_9x_the_tokens_of_bf16(bf16_pair):
    bf16, int8 = (bf16_pair[k].engine.cache_info for k in ("model", "int8"))
    assert int8.num_tokens >= 1.9 * bf16.num_tokens
    assert int8.dtype == "int8" and bf16.dtype == "bfloat16"


def test_int8_kv_greedy_tokens_agree_with_bf16_by_the_closeness_rule(bf16_pair):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    prompts = [bf16_pair["model"].chat_prompt([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    ref, got = (bf16_pair[k].generate(prompts, params) for k in ("model", "int8"))
    assert_greedy_close(ref, got)


def test_int8_kv_perplexity_within_1_percent_of_bf16(bf16_pair):
    ids = bf16_pair["model"].tokenizer.encode(default_corpus(), add_special_tokens=False)[:1024]
    base, quant = (perplexity(bf16_pair[k].engine, ids, window=512)["perplexity"]
                   for k in ("model", "int8"))
    assert abs(quant / base - 1) < 0.01, (base, quant)


def test_the_default_cache_is_int8_where_the_kernels_read_it_and_stays_close_to_bf16(
        smollm_path, bf16_pair):
    """kv_cache_dtype auto: int8 with int4 weights (the default) where the compiled attention
    kernels read it (AVX-512 BF16 and VNNI), else the model's dtype (int8 and dense weights
    keep it). Every prompt row reads k and v as the int8 cache holds them (a fresh prompt
    too, so that a cache hit or a later chunk reads what it read): greedy answers stay
    within the closeness rule of the bfloat16 cache's (bf16_pair's, prompts in chunks of 32)."""
    auto = LLM(str(smollm_path), kv_cache_gib=0.05, enable_prefix_caching=False)
    kernels = auto.engine.runner.model.model.norm.kernels
    head_dim = auto.engine.model_config.head_dim
    for quantization in ("int8", "none"):
        assert resolve_kv_cache_dtype("auto", quantization, torch.bfloat16, head_dim,
                                      kernels) == "model"
    if kernels is None or not kernels.has_bf16_dot:
        assert auto.engine.cache_info.dtype == "bfloat16"
        pytest.skip("this CPU has no AVX-512 BF16 and VNNI: the cache stays bfloat16")
    assert auto.engine.cache_info.dtype == "int8"
    model = bf16_pair["model"]
    assert model.engine.cache_info.dtype == "bfloat16"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    prompts = [auto.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    got, want = (llm.generate(prompts, params) for llm in (auto, model))
    assert_greedy_close(want, got)
