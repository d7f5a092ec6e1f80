"""Qwen3, Gemma 2/3, Phi-3, OLMo 2 and windowed Mistral against transformers, on tiny random
models made here and saved as Hugging Face folders.

Reference: transformers' own modelling code with the same weights, float32 on CPU, generating
token by token with its cache (so that Phi-3's LongRoPE switches to the long factors as
transformers' generation does, position by position past the original context).
"""
from __future__ import annotations

import pytest
import torch

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.core import EngineCore
from tests.conftest import TINY, first_mismatch, save_tiny_model
from tests.reference.test_llama_vs_hf import PROMPTS, ember_greedy_logits

NUM_STEPS = 12
WINDOW = 8  # shorter than most prompts, so that the window cuts keys off
HEAD = dict(head_dim=16)
# factors for head_dim 16: 8 frequencies
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.4 * i for i in range(8)],
            "original_max_position_embeddings": 48}

CASES = {
    "qwen3": ("Qwen3", dict(HEAD)),
    "gemma2": ("Gemma2", dict(HEAD, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3Text", dict(HEAD, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={
                                      "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 1e4}})),
    "phi3-longrope-window": ("Phi3", dict(pad_token_id=0, sliding_window=16,
                                          rope_parameters=LONGROPE)),
    "olmo2": ("Olmo2", dict(pad_token_id=0)),
    "mistral-window": ("Mistral", dict(sliding_window=WINDOW)),
}


def tiny_variant(kind: str, **overrides):
    """A tiny randomly initialised transformers model of `kind` (seeded), in float32."""
    import transformers
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**{**TINY, **overrides})
    model_cls = getattr(transformers, f"{kind.removesuffix('Text')}ForCausalLM")
    return model_cls(config).eval().float()


@pytest.fixture(scope="module", params=list(CASES))
def variant_pair(request, tmp_path_factory, tokenizer_files):
    kind, options = CASES[request.param]
    model = tiny_variant(kind, **options)
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), model, tokenizer_files)
    return folder, model


def hf_step_logits(model, prompt: list[int], num_steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logits [num_steps, vocab], token by token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def test_logits_match_transformers_at_prefill_and_every_decode_step(variant_pair):
    folder, hf_model = variant_pair
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32"))
    for prompt in PROMPTS:
        tokens, logits = ember_greedy_logits(engine, prompt, NUM_STEPS)
        want_tokens, want = hf_step_logits(hf_model, prompt, NUM_STEPS)
        assert tokens == want_tokens, f"diverged at {first_mismatch(want_tokens, tokens)}"
        for step, got in enumerate(logits):
            torch.testing.assert_close(got, want[step], atol=1e-4, rtol=0,
                                       msg=lambda m, step=step: f"step {step}: {m}")


@pytest.mark.parametrize("chunk", [None, 16])
def test_greedy_tokens_match_transformers_batched(variant_pair, chunk):
    """All prompts at once; with chunk=16 the long prompts' later chunks attend over the
    cache through the windowed path."""
    folder, hf_model = variant_pair
    options = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    llm = LLM(str(folder), dtype="float32", **options)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        want, _ = hf_step_logits(hf_model, prompt, 24)
        got = out.outputs[0].token_ids
        assert got == want, f"diverged at token {first_mismatch(want, got)}"
