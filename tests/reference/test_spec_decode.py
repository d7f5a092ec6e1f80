"""Speculative decoding keeps the output: greedy tokens identical with it on and off (tiny
random models in float32, the default model in its default bfloat16 setup), every sampling
feature unchanged, and for temperature > 0 the target distribution (chi-square against
transformers' exact marginals on a tiny-vocabulary model)."""
from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from tests.conftest import save_tiny_model, tiny_hf_model

VOCAB = 32   # a vocabulary this small makes a random model repeat itself: drafts get accepted
REPEATING = [[5, 6, 7, 8, 9, 10, 11, 12] * 4 + [5, 6, 7],
             [3, 17, 9, 22, 5, 17, 9, 30, 12, 5, 17],
             list(range(3, 32))]
# every token but the special 0-2, so that any first token recurs and gets drafts
PROMPT = [3, 17, 9, 22, 5, 30, 12, 4, 28, 6, 7, 8, 10, 11, 13, 14, 15, 16, 18, 19, 20, 21, 23,
          24, 25, 26, 27, 29, 31, 5, 17]


def outputs(llm: LLM, prompts: list, params: SamplingParams) -> list:
    return [o.outputs for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory, tokenizer_files):
    model = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=False)
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny_vocab"), model, tokenizer_files)
    return folder, model


@pytest.fixture(scope="module")
def tiny_pair(tiny_vocab):
    folder, _ = tiny_vocab
    off = LLM(str(folder), dtype="float32", num_blocks=256, block_size=4)
    on = LLM(str(folder), dtype="float32", num_blocks=256, block_size=4, speculative="ngram",
             ngram_min=1)
    return off, on


def test_greedy_tokens_are_identical_and_drafts_are_verified(tiny_pair):
    off, on = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want, got = outputs(off, REPEATING, params), outputs(on, REPEATING, params)
    assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got]
    stats = on.engine.scheduler.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
    kv = on.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks   # rejected drafts' blocks all came back


@pytest.mark.parametrize("options", [
    dict(logprobs=3),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
    dict(min_tokens=20, logit_bias={7: 2.0}, ignore_eos=False),
    dict(max_tokens=7),
    dict(n=3, temperature=0.8, seed=1, top_k=20),
], ids=["logprobs", "penalties", "min_tokens+bias", "max_tokens", "n+seed"])
def test_sampling_features_agree_with_speculation_off(tiny_pair, options):
    """Greedy rows must match exactly (tokens and logprobs); seeded random rows make as many
    tokens, each a token the model can emit (their draws differ: verification draws its own
    uniforms)."""
    off, on = tiny_pair
    params = SamplingParams(**{"temperature": 0, "max_tokens": 24, "ignore_eos": True,
                               **options})
    want, got = outputs(off, REPEATING, params), outputs(on, REPEATING, params)
    for w_seqs, g_seqs in zip(want, got, strict=True):
        assert len(w_seqs) == len(g_seqs)
        for w, g in zip(w_seqs, g_seqs):
            assert len(w.token_ids) == len(g.token_ids) == params.max_tokens
            if params.greedy:
                assert w.token_ids == g.token_ids and w.text == g.text
            if w.logprobs is not None:
                assert [t.token_id for t in w.logprobs] == [t.token_id for t in g.logprobs]
                assert [t.logprob for t in w.logprobs] == pytest.approx(
                    [t.logprob for t in g.logprobs], abs=1e-4)
                assert [[x.token_id for x in t.top] for t in w.logprobs] == \
                    [[x.token_id for x in t.top] for t in g.logprobs]


def test_stop_strings_and_stop_tokens_cut_at_the_same_place(tiny_pair):
    off, on = tiny_pair
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = outputs(off, REPEATING, base)
    # stop on the 12th token of each greedy output, as a token id and as its text
    for prompt, w in zip(REPEATING, want):
        stop_id = w[0].token_ids[11]
        p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                           stop_token_ids=[stop_id])
        a, b = outputs(off, [prompt], p)[0][0], outputs(on, [prompt], p)[0][0]
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        text = w[0].text[len(w[0].text) // 2:][:6]
        if text.strip():
            p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text])
            a, b = outputs(off, [prompt], p)[0][0], outputs(on, [prompt], p)[0][0]
            assert a.text == b.text and a.finish_reason == b.finish_reason


@pytest.mark.heavy   # by default the same-answer matrix runs n-gram drafts on SmolLM2
def test_default_model_greedy_is_identical(smollm_path):
    """The default model as served (bfloat16, int4 weights, int8 KV, compiled kernels): a
    verified token runs through the same kernels as a decoded one, each row of a step as it
    would alone, so tokens and logprobs match exactly (three requests batched, 4 drafts)."""
    off = LLM(str(smollm_path), kv_cache_gib=0.05)
    on = LLM(str(smollm_path), kv_cache_gib=0.05, speculative="ngram")
    text = "The quick brown fox jumps over the lazy dog. " * 3 + "The quick"
    prompts = [off.tokenizer.encode(text), off.tokenizer.encode("1, 2, 3, 4, 5,"),
               off.tokenizer.encode("Once upon a time")]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=1)
    want, got = outputs(off, prompts, params), outputs(on, prompts, params)
    assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got]
    assert [[t.logprob for t in w[0].logprobs] for w in want] == \
        [[t.logprob for t in g[0].logprobs] for g in got]
    assert on.engine.scheduler.spec_stats.num_accepted_tokens > 0


def exact_marginals(model, prompt: list[int], temperature: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' distributions of the 2nd and 3rd generated tokens, summed over every
    first and second token."""
    def probs(seqs: list[list[int]]) -> torch.Tensor:
        return (model(torch.tensor(seqs)).logits[:, -1] / temperature).softmax(-1)
    with torch.no_grad():
        p1 = probs([prompt])[0]                                                   # [V]
        p2 = probs([prompt + [a] for a in range(VOCAB)])                          # [V, V]
        p3 = probs([prompt + [a, b] for a in range(VOCAB)
                    for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2
    return joint12.sum(0), (joint12[:, :, None] * p3).sum((0, 1))


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness of fit; cells expecting under 5 draws pooled into one."""
    from scipy.stats import chisquare
    n = counts.sum().item()
    expected = probs.double() * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy() * obs[keep].sum().item()
                           / exp[keep].sum().item()).pvalue)


def test_rejection_sampling_keeps_the_target_distribution(tiny_vocab):
    """2000 samples of three tokens at temperature 0.5 with n-gram drafts on every step: the
    2nd and 3rd tokens (chosen by verification) follow transformers' exact marginals
    (chi-square, p > 0.001; a verifier that kept every draft fails it by far)."""
    folder, model = tiny_vocab
    llm = LLM(str(folder), dtype="float32", speculative="ngram", ngram_min=1,
              max_spec_rows=100_000, min_acceptance=0.0, max_num_seqs=256,
              max_num_batched_tokens=8192, num_blocks=4096, block_size=4, seed=123)
    assert_target_marginals(llm, model, 2000)


def assert_target_marginals(llm: LLM, model, num: int) -> None:
    """`num` samples of PROMPT's next three tokens at temperature 0.5 from a speculating
    `llm`: drafts were made and some rejected, and the 2nd and 3rd tokens follow `model`'s
    exact marginals (chi-square, p > 0.001)."""
    params = SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True)
    got = llm.generate([PROMPT] * num, params)
    tokens = torch.tensor([o.outputs[0].token_ids for o in got])
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts >= num / 2
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    want2, want3 = exact_marginals(model, PROMPT, params.temperature)
    for column, want in ((1, want2), (2, want3)):
        counts = torch.bincount(tokens[:, column], minlength=VOCAB)
        assert chi_square_p(counts, want) > 1e-3, f"token {column + 1}: {counts.tolist()}"


def test_rejection_walk_emits_the_target_distribution_at_each_position():
    """verify's walk alone, on fixed distributions over 8 tokens and drafts of a likely and an
    unlikely token: the first emitted token follows p0, the second (after an accepted first
    draft) follows p1, and the number of kept drafts follows p0(d0) and p1(d1)."""
    from ember.spec.verify import rejection_walk
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.05, 0.5, 0.1, 0.05, 0.1, 0.1, 0.05, 0.05],
                          [0.3, 0.05, 0.05, 0.2, 0.1, 0.1, 0.1, 0.1],
                          [0.125] * 8])
    drafts = (1, 6)                 # p0(1) = 0.5: often kept; p1(6) = 0.1: seldom
    num = 20000
    walks = [rejection_walk(drafts, probs, gen) for _ in range(num)]
    first = torch.bincount(torch.tensor([w[0] for w in walks]), minlength=8)
    assert chi_square_p(first, probs[0]) > 1e-3
    second = torch.bincount(torch.tensor([w[1] for w in walks if w[0] == 1]), minlength=8)
    assert chi_square_p(second, probs[1]) > 1e-3
    kept_both = sum(len(w) == 3 for w in walks)
    assert abs(kept_both / num - 0.5 * 0.1) < 4 * (0.05 * 0.95 / num) ** 0.5
