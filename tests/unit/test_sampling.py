"""Sampling parameters, logits processors and the sampler, on hand-made logits.

References: the formulas themselves (penalties, bias), exact allowed sets (top-k/p, min-p), and
softmax for the distribution of draws, checked statistically with a stated tolerance.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from ember.errors import BadSamplingParams
from ember.request import Request, SamplingParams
from ember.sampling import processors as P
from ember.sampling.sampler import (ARGMAX_BLOCK, Sampler, argmax_alone, argmax_rows,
                                    build_sampling_batch, process_logits, sampling_probs)

VOCAB = 8
_ids = itertools.count()


def req(prompt: list[int] | None = None, output: list[int] | None = None, **params) -> Request:
    r = Request(f"r{next(_ids)}", prompt or [0], SamplingParams(**params), frozenset({7}), 100)
    for t in output or []:
        r.append_output(t)
    return r


LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0, -0.5, 1.5]])


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0.0), ("max_tokens", 0), ("min_tokens", -1), ("n", 0),
    ("logprobs", 21), ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0}), ("stop", ("",)),
    ("stop_token_ids", (-4,)),
])
def test_invalid_values_raise_typed_errors_that_say_what_is_allowed(field, value):
    with pytest.raises(BadSamplingParams, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and info.value.http_status == 400


def test_min_tokens_cannot_exceed_max_tokens():
    with pytest.raises(BadSamplingParams, match="must not exceed max_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_stop_accepts_a_single_string_and_top_k_minus_one_is_off():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(top_k=-1).top_k == 0


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    seen = torch.tensor([[True, False, False, True, False, False, False, False]])
    out = P.apply_repetition_penalty(LOGITS, seen, torch.tensor([2.0]))
    want = LOGITS.clone()
    want[0, 0], want[0, 3] = 1.0, -2.0
    assert torch.equal(out, want)


@pytest.mark.parametrize("penalty", [5e-324, 1e-40, 1e-30])
def test_a_vanishing_repetition_penalty_keeps_banned_tokens_banned(penalty):
    """A request may ask for any penalty in (0, 10]; one below float32's range reaches the
    logits as 0, and -inf * 0 is NaN. A banned token (-inf: a grammar's mask) must stay
    banned, and nothing may become NaN; a seen positive logit may grow without bound."""
    logits = LOGITS.clone()
    logits[0, [0, 3]] = float("-inf")                 # banned, and seen
    r = req(prompt=[0, 3, 4, 6], repetition_penalty=penalty, temperature=0)
    out = process_logits(logits, build_sampling_batch([r], VOCAB, torch.device("cpu")))
    assert not out.isnan().any(), out
    assert out[0, 0] == out[0, 3] == float("-inf")
    assert out[0, 4] >= LOGITS[0, 4] and -0.5 <= out[0, 6] <= 0    # 3.0 / p, -0.5 * p
    assert torch.equal(out[0, [1, 2, 5, 7]], LOGITS[0, [1, 2, 5, 7]])  # not seen


def test_a_token_forced_to_infinity_takes_all_the_probability():
    """+inf (a vanishing penalty on a seen token) is the most likely token, not a NaN row."""
    logits = LOGITS.clone()
    logits[0, 2] = float("inf")
    logits[0, 5] = float("-inf")
    batch = build_sampling_batch([req(temperature=0.5, top_p=0.9, min_p=0.1)], VOCAB,
                                 torch.device("cpu"))
    probs = sampling_probs(logits, batch)
    assert torch.equal(probs, torch.nn.functional.one_hot(torch.tensor([2]), VOCAB).float())


def test_presence_and_frequency_penalties_follow_openai():
    counts = torch.tensor([[3.0, 0, 1, 0, 0, 0, 0, 0]])
    out = P.apply_presence_frequency_penalties(LOGITS, counts, torch.tensor([0.5]),
                                               torch.tensor([0.25]))
    want = LOGITS.clone()
    want[0, 0] -= 0.5 + 0.75
    want[0, 2] -= 0.5 + 0.25
    assert torch.equal(out, want)


def test_logit_bias_is_added_exactly():
    sampler = Sampler(0, torch.device("cpu"))
    r = req(temperature=0, logit_bias={6: 10.0})
    [token], _ = sampler.sample(LOGITS.clone(), [r])
    assert token == 6  # -0.5 + 10 beats 3.0
    [token], _ = sampler.sample(LOGITS.clone(), [req(temperature=0, logit_bias={4: -100.0})])
    assert token == 0


def test_logit_bias_lands_on_its_own_row_and_tokens():
    """Several rows, each its own bias (one none): the processed logits are the logits plus
    each row's bias at its tokens, nothing else."""
    logits = torch.arange(3 * VOCAB, dtype=torch.float32).view(3, VOCAB)
    biases = [{1: 2.0, 3: -1.5}, None, {0: 0.25, 7: -100.0}]
    batch = build_sampling_batch([req(temperature=0, logit_bias=b) for b in biases], VOCAB,
                                 torch.device("cpu"))
    want = logits.clone()
    for row, bias in enumerate(biases):
        for token_id, value in (bias or {}).items():
            want[row, token_id] += value
    assert torch.equal(process_logits(logits, batch), want)
    assert torch.equal(logits, torch.arange(3 * VOCAB, dtype=torch.float32).view(3, VOCAB))


def test_greedy_sees_penalties():
    sampler = Sampler(0, torch.device("cpu"))
    [token], _ = sampler.sample(LOGITS.clone(), [req(output=[4], temperature=0,
                                                     presence_penalty=2.0)])
    assert token == 0  # 3.0 - 2.0 = 1.0 < 2.0
    [token], _ = sampler.sample(LOGITS.clone(), [req(prompt=[4], temperature=0,
                                                     repetition_penalty=2.0)])
    assert token == 0  # 3.0 / 2 = 1.5 < 2.0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 7] = 5.0  # EOS is by far the most likely
    sampler = Sampler(0, torch.device("cpu"))
    early = req(output=[1], temperature=0, min_tokens=3, stop_token_ids=(4,), max_tokens=10)
    [token], _ = sampler.sample(logits.clone(), [early])
    assert token not in (7, 4)
    late = req(output=[1, 1, 1], temperature=0, min_tokens=3, max_tokens=10)
    assert sampler.sample(logits.clone(), [late])[0] == [7]


def draw(params: dict, num: int, logits: torch.Tensor = LOGITS) -> torch.Tensor:
    """Token counts over `num` draws from one request's distribution."""
    sampler = Sampler(1234, torch.device("cpu"))
    requests = [req(**params) for _ in range(num)]
    tokens, _ = sampler.sample(logits.expand(num, -1).clone(), requests)
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


def test_top_k_never_leaves_the_k_most_likely():
    counts = draw(dict(temperature=1.5, top_k=3), 4000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {0, 4, 7}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)[0]  # sorted: 4 (.52), 0 (.19), 7 (.12), 1 (.07) ...
    assert probs[4] + probs[0] < 0.8 < probs[4] + probs[0] + probs[7]
    counts = draw(dict(temperature=1.0, top_p=0.8), 4000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {4, 0, 7}


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    counts = draw(dict(temperature=1.0, min_p=0.3), 4000)
    probs = LOGITS.softmax(-1)[0]
    allowed = set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    assert set(torch.nonzero(counts).flatten().tolist()) == allowed == {0, 4}


def test_temperature_sampling_matches_softmax():
    """20k draws; each frequency within 0.015 of softmax(logits / T) (> 4 standard errors)."""
    num = 20000
    for temperature in (0.7, 1.0, 1.8):
        counts = draw(dict(temperature=temperature), num)
        want = (LOGITS[0] / temperature).softmax(-1)
        assert (counts / num - want).abs().max() < 0.015, temperature


def test_same_seed_same_tokens_whatever_shares_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))

    def run(batch_rows: list[int], seeded_row: int) -> list[int]:
        sampler = Sampler(99, torch.device("cpu"))
        seeded = req(temperature=1.0, seed=42)
        others = [req(temperature=1.0) for _ in batch_rows]
        tokens = []
        for _ in range(20):
            rows = batch_rows[:]
            rows.insert(seeded_row, 0)
            reqs = others[:]
            reqs.insert(seeded_row, seeded)
            out, _ = sampler.sample(logits[rows].clone(), reqs)
            tokens.append(out[seeded_row])
            seeded.append_output(out[seeded_row])   # the next draw is at the next position
        return tokens

    alone = run([], 0)
    assert run([1, 2, 3], 2) == alone
    assert run([5], 0) == alone
    assert len(set(alone)) > 1  # it really samples


def test_logprobs_are_the_model_distribution():
    sampler = Sampler(0, torch.device("cpu"))
    _, [lp] = sampler.sample(LOGITS.clone(), [req(temperature=0, logprobs=3,
                                                  presence_penalty=1.0)])
    want = LOGITS.log_softmax(-1)[0]
    assert lp.logprob == pytest.approx(float(want[4]))
    assert [t for t, _ in lp.top] == [4, 0, 7]
    assert [v for _, v in lp.top] == pytest.approx(want[[4, 0, 7]].tolist())
    _, [none] = sampler.sample(LOGITS.clone(), [req(temperature=0)])
    assert none is None
    # a bias (applied in place where no logprobs are asked) never reaches them either
    [token], [lp] = sampler.sample(LOGITS.clone(), [req(temperature=0, logprobs=1,
                                                       logit_bias={7: 100.0})])
    assert token == 7 and lp.logprob == pytest.approx(float(want[7]))


def test_in_place_processing_equals_the_copy():
    biases = [{1: 2.0, 3: -1.5}, None, {0: 0.25, 7: -100.0}]
    requests = [req(temperature=0, logit_bias=b, min_tokens=2) for b in biases]
    batch = build_sampling_batch(requests, VOCAB, torch.device("cpu"))
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    want = process_logits(logits, batch)
    mine = logits.clone()
    assert process_logits(mine, batch, in_place=True) is mine
    assert torch.equal(mine, want) and not torch.equal(logits, want)


@pytest.mark.parametrize("vocab", [1000, 8 * ARGMAX_BLOCK, 49152, 49152 + 77])
def test_argmax_rows_is_torch_argmax_first_index_on_ties(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g).half().float()   # coarse values: natural ties
    x[1, 3] = x[1, vocab - 1] = 50.0           # a tie across the first block and the tail
    x[2, vocab - 1] = 60.0                     # the tail alone holds the maximum
    x[3, ARGMAX_BLOCK + 5] = x[3, 2 * ARGMAX_BLOCK - 1] = 70.0   # a tie within one block
    x[4] = float("-inf")                       # nothing allowed: index 0, as torch says
    x[5, 7] = x[5, vocab // 2] = 80.0          # a tie across blocks
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    strided = x.t().contiguous().t()           # the same rows, not contiguous
    assert torch.equal(argmax_rows(strided), x.argmax(dim=-1))


def test_greedy_batches_build_no_temperatures_and_mixed_ones_do():
    """Greedy rows read no temperature: an all-greedy batch has none (and random choice on
    it is refused with the fix named); one random row brings the column for every row."""
    cpu = torch.device("cpu")
    greedy = build_sampling_batch([req(temperature=0), req(temperature=0)], VOCAB, cpu)
    assert greedy.temperature is None
    with pytest.raises(ValueError, match="argmax_rows"):
        sampling_probs(LOGITS.repeat(2, 1), greedy)
    mixed = build_sampling_batch([req(temperature=0), req(temperature=0.5)], VOCAB, cpu)
    assert mixed.temperature.tolist() == [0.0, 0.5]
    want = (LOGITS[0] / 0.5).softmax(-1)
    torch.testing.assert_close(sampling_probs(LOGITS.repeat(2, 1), mixed)[1], want)


@pytest.mark.parametrize("params,alone", [
    ({"temperature": 0}, True), ({"temperature": 0, "top_k": 3, "stop": "x"}, True),
    ({"temperature": 0.7}, False), ({"temperature": 0, "logprobs": 0}, False),
    ({"temperature": 0, "logit_bias": {1: 1.0}}, False),
    ({"temperature": 0, "presence_penalty": 0.5}, False),
    ({"temperature": 0, "frequency_penalty": 0.5}, False),
    ({"temperature": 0, "repetition_penalty": 1.1}, False),
    ({"temperature": 0, "min_tokens": 2, "max_tokens": 9}, False),
])
def test_only_plain_greedy_rows_skip_the_processing(params, alone):
    """A greedy row with nothing that changes or reads its logits takes their argmax alone;
    in a batch with any other row, every row goes through the processors."""
    assert argmax_alone(req(**params)) is alone
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    requests = [req(temperature=0), req(**params)]
    tokens, logprobs = Sampler(0, torch.device("cpu")).sample(logits.clone(), requests)
    assert tokens[0] == int(logits[0].argmax())
    assert (logprobs[1] is None) is ("logprobs" not in params)
