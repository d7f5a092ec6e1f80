"""The proposers that run a model, self-draft (the target's first layers) and a draft model,
keep the output as n-gram drafts do: greedy tokens identical with speculation on and off,
every sampling feature unchanged, and for temperature > 0 the target distribution
(chi-square against transformers' exact marginals). Tiny random models in float32 sharing a
vocabulary of 32 ids; the default model in its served setup."""
from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.errors import ConfigError
from tests.conftest import save_tiny_model, tiny_hf_model
from tests.reference.test_spec_decode import (REPEATING, VOCAB,
                                              assert_target_marginals, outputs)

COMMON = dict(dtype="float32", num_blocks=256, block_size=4)
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_files):
    """(target folder, its transformers model, a smaller draft's folder): 4 and 1 layers."""
    target = tiny_hf_model("llama", vocab_size=VOCAB, num_hidden_layers=4,
                           tie_word_embeddings=False)
    draft = tiny_hf_model("llama", vocab_size=VOCAB, num_hidden_layers=1, hidden_size=32,
                          tie_word_embeddings=False)
    return (save_tiny_model(tmp_path_factory.mktemp("spec_target"), target, tokenizer_files),
            target,
            save_tiny_model(tmp_path_factory.mktemp("spec_draft"), draft, tokenizer_files))


@pytest.fixture(scope="module")
def off(models):
    return LLM(str(models[0]), **COMMON)


@pytest.fixture(scope="module", params=["self", "draft", "itself"])
def on(request, models):
    """Speculation by each model proposer; `itself`: the target as its own draft model."""
    target, _, draft = models
    spec = {"self": "self", "draft": f"draft:{draft}", "itself": f"draft:{target}"}
    return request.param, LLM(str(target), speculative=spec[request.param], min_acceptance=0.0,
                              **COMMON)


def test_greedy_tokens_are_identical_and_blocks_come_back(off, on):
    name, llm = on
    want, got = outputs(off, REPEATING, GREEDY), outputs(llm, REPEATING, GREEDY)
    assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got]
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    if name == "itself":   # the same model drafts what it then verifies
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks   # lookahead and rejected drafts' blocks


@pytest.mark.parametrize("options", [
    dict(logprobs=3),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    dict(max_tokens=7, stop_token_ids=[9]),
    dict(n=2, temperature=0.8, seed=1, top_k=20),
], ids=["logprobs", "penalties", "max_tokens+stop", "n+seed"])
def test_sampling_features_agree_with_speculation_off(off, on, options):
    params = SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True,
                               **options})
    want, got = outputs(off, REPEATING, params), outputs(on[1], REPEATING, params)
    for w_seqs, g_seqs in zip(want, got, strict=True):
        assert len(w_seqs) == len(g_seqs)
        for w, g in zip(w_seqs, g_seqs):
            if params.greedy:
                assert w.token_ids == g.token_ids and w.finish_reason == g.finish_reason
            else:
                assert len(w.token_ids) == len(g.token_ids) == params.max_tokens
            if w.logprobs is not None:   # a rejected draft's row never shows
                assert [t.token_id for t in g.logprobs] == g.token_ids
                assert [t.logprob for t in w.logprobs] == pytest.approx(
                    [t.logprob for t in g.logprobs], abs=1e-4)


def test_a_batch_with_preemptions_keeps_greedy_tokens(models, off):
    """Few blocks: requests lose theirs and recompute; the draft model's caches must then
    be recomputed too (its positions are counted per preemption)."""
    target, _, draft = models
    small = dict(COMMON, num_blocks=40)
    llm = LLM(str(target), speculative=f"draft:{draft}", min_acceptance=0.0, **small)
    prompts = REPEATING * 2
    want = outputs(LLM(str(target), **small), prompts, GREEDY)
    got = outputs(llm, prompts, GREEDY)
    assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got]
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("spec", ["self", "draft"])
def test_rejection_sampling_keeps_the_target_distribution(models, spec):
    """1000 samples of three tokens at temperature 0.5, drafts on every step: the 2nd and 3rd
    tokens follow transformers' exact marginals (chi-square, p > 0.001)."""
    target, model, draft = models
    llm = LLM(str(target), speculative="self" if spec == "self" else f"draft:{draft}",
              max_spec_rows=100_000, min_acceptance=0.0, max_num_seqs=128,
              max_num_batched_tokens=4096, num_blocks=2048, block_size=4, dtype="float32",
              seed=7)
    assert_target_marginals(llm, model, 1000)


def test_a_draft_of_another_vocabulary_is_refused(models, tmp_path_factory, tokenizer_files):
    other = save_tiny_model(tmp_path_factory.mktemp("spec_other_vocab"),
                            tiny_hf_model("llama", vocab_size=64, num_hidden_layers=1),
                            tokenizer_files)
    with pytest.raises(ConfigError, match="vocabulary.*share the target's tokenizer"):
        LLM(str(models[0]), speculative=f"draft:{other}", **COMMON)


def test_self_draft_layers_must_leave_some_out(models):
    with pytest.raises(ConfigError, match=r"self_draft_layers=4 must be in \[1, 3\]"):
        LLM(str(models[0]), speculative="self", self_draft_layers=4, **COMMON)


@pytest.mark.heavy   # the tiny models above check both proposers by default
@pytest.mark.parametrize("spec", ["self", "draft"])
def test_default_model_greedy_is_identical(smollm_path, spec):
    """The default model as served (bfloat16, int4 weights, int8 KV, compiled kernels) with
    its first layers, or itself, drafting 4 tokens a step for two requests at once: tokens
    and logprobs match exactly (each row of a verification step is computed as a one-row
    decode step would), and the model drafting for itself is accepted nearly always."""
    off = LLM(str(smollm_path), kv_cache_gib=0.05)
    on = LLM(str(smollm_path), min_acceptance=0.0, kv_cache_gib=0.05,
             speculative="self" if spec == "self" else f"draft:{smollm_path}")
    prompts = [off.tokenizer.encode("Once upon a time"),
               off.tokenizer.encode("The three primary colours are")]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    for want, got in zip(outputs(off, prompts, params), outputs(on, prompts, params)):
        assert want[0].token_ids == got[0].token_ids
        assert [t.logprob for t in want[0].logprobs] == [t.logprob for t in got[0].logprobs]
    stats = on.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0
    if spec == "draft":
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
