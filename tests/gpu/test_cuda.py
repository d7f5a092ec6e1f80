"""The CUDA path against the CPU reference path (skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from tests.conftest import first_mismatch
from tests.reference.test_llama_vs_hf import PROMPTS

pytestmark = pytest.mark.gpu


def test_cuda_float32_matches_cpu_greedy(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    cpu = LLM(str(folder), dtype="float32").generate(PROMPTS, params)
    gpu = LLM(str(folder), dtype="float32", device="cuda").generate(PROMPTS, params)
    for a, b in zip(cpu, gpu):
        a, b = a.outputs[0], b.outputs[0]
        k = first_mismatch(a.token_ids, b.token_ids)
        if k is not None:  # TF32 and other kernels: the closeness rule
            assert b.token_ids[k] in {t.token_id for t in a.logprobs[k].top}
        for x, y in zip(a.logprobs[:k], b.logprobs[:k]):
            assert abs(x.logprob - y.logprob) < 1e-2


def test_cuda_bfloat16_default_model_runs(smollm_path):
    llm = LLM(str(smollm_path), device="cuda")
    assert llm.engine.dtype == torch.bfloat16
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert "Paris" in out.text
