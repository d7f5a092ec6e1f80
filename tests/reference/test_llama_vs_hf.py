"""ember's Llama/Mistral/Qwen2 against transformers, on tiny random models made here.

Reference: transformers' own modelling code with the same weights, float32 on CPU.
"""
from __future__ import annotations

import pytest
import torch

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.core import EngineCore
from ember.scheduler.output import RunnerOutput
from tests.conftest import (assert_greedy_close, first_mismatch, hf_greedy, save_tiny_model,
                            tiny_hf_model)

PROMPTS = [[1, 500, 77, 9000, 31, 2024, 17],
           [48000, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [300],
           list(range(1000, 1041))]
NUM_STEPS = 12


def ember_greedy_logits(engine: EngineCore, prompt: list[int], num_steps: int
                        ) -> tuple[list[int], list[torch.Tensor]]:
    """Drive the engine step by step with greedy choice, keeping each step's logits."""
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=num_steps,
                                                   ignore_eos=True))
    tokens, logits = [], []
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        requests, step_logits = engine.runner.forward(plan)
        result = RunnerOutput()
        if requests:
            token = int(step_logits[0].argmax())
            result.sampled_token_ids["r"] = [token]
            tokens.append(token)
            logits.append(step_logits[0])
        engine.scheduler.update(plan, result)
    return tokens, logits


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


CASES = {
    "llama": dict(kind="llama", tie_word_embeddings=False),
    "llama-tied": dict(kind="llama", tie_word_embeddings=True),
    "llama-mha-headdim32": dict(kind="llama", num_key_value_heads=4, head_dim=32),
    "llama3-rope-scaling": dict(kind="llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope": dict(kind="llama", rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(kind="mistral", sliding_window=None),
    "qwen2-bias": dict(kind="qwen2", tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(CASES))
def tiny_pair(request, tmp_path_factory, tokenizer_files):
    options = dict(CASES[request.param])
    model = tiny_hf_model(options.pop("kind"), **options)
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), model, tokenizer_files)
    return folder, model


def test_logits_match_transformers_at_prefill_and_every_decode_step(tiny_pair):
    folder, hf_model = tiny_pair
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32"))
    for prompt in PROMPTS:
        tokens, logits = ember_greedy_logits(engine, prompt, NUM_STEPS)
        expected = hf_logits(hf_model, prompt + tokens[:-1])[len(prompt) - 1:]
        assert len(logits) == NUM_STEPS
        for step, (got, want) in enumerate(zip(logits, expected)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0,
                                       msg=lambda m, step=step: f"step {step}: {m}")


def test_greedy_tokens_match_transformers_batched(tiny_pair):
    folder, hf_model = tiny_pair
    llm = LLM(str(folder), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        want = hf_greedy(hf_model, prompt, 24)
        got = out.outputs[0].token_ids
        assert got == want, f"diverged at token {first_mismatch(want, got)}"


def test_bfloat16_runs_close_to_float32(tiny_llama_dir):
    """bf16 is not exact: the closeness rule (STYLE.md) applies to its greedy tokens."""
    folder, _ = tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    ref = LLM(str(folder), dtype="float32").generate(PROMPTS, params)
    low = LLM(str(folder), dtype="bfloat16").generate(PROMPTS, params)
    assert_greedy_close(ref, low)
