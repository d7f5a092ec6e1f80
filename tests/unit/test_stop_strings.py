"""Stop strings across token boundaries: the text held back while it might start a stop string
never exceeds the longest stop string less one character, and the text shown equals the full
text cut at the first stop string (reference: str.find on the whole decoded text)."""
from __future__ import annotations

import random

import pytest

from ember.engine.output import SequenceText
from ember.request import FinishReason, Request, SamplingParams
from ember.tokenizer.tokenizer import Tokenizer

WORDS = ["abc", "ab", "a", "stop", "sto", "the", "end", " ", " ", "\n", "ending", "abcabc", "é"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_files) -> Tokenizer:
    return Tokenizer.from_hf_folder(tokenizer_files)


def reference(text: str, stops: tuple[str, ...], include: bool) -> str:
    hits = [(text.find(s), s) for s in stops if text.find(s) >= 0]
    if not hits:
        return text
    idx, stop = min(hits)
    return text[:idx + len(stop)] if include else text[:idx]


def stream(tokenizer: Tokenizer, ids: list[int], stops: tuple[str, ...],
           include: bool) -> tuple[str, str, int]:
    """Feed tokens one at a time like the engine: (streamed text, final text, most held)."""
    params = SamplingParams(max_tokens=len(ids), stop=stops, include_stop_str_in_output=include)
    request = Request("r", [1], params, frozenset({2}), len(ids))
    seq = SequenceText(tokenizer, request, 0)
    shown, most_held = "", 0
    for k, token_id in enumerate(ids):
        request.output_token_ids.append(token_id)
        if k == len(ids) - 1:
            request.finish_reason = FinishReason.LENGTH
        stopped = seq.update()
        shown += seq.stream_delta()
        most_held = max(most_held, len(seq.text) - seq.num_chars_streamed)
        if stopped:
            break
    return shown, seq.output().text, most_held


@pytest.mark.parametrize("seed", range(6))
def test_held_back_text_is_bounded_and_the_output_is_cut_at_the_first_stop(tokenizer, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(WORDS) for _ in range(3000))  # ~7000 characters
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # long stop strings whose prefixes recur all through the text; some never occur
    stops = tuple(rng.sample(["abc" * 20 + "Z", "the end" * 9, "stop" * 12, "ending" * 3,
                              text[-70:-5], text[4000:4040], "abcabcab"], 3))
    bound = max(len(s) for s in stops) - 1
    for include in (False, True):
        shown, final, most_held = stream(tokenizer, ids, stops, include)
        assert most_held <= bound
        assert shown == final == reference(text, stops, include)


def test_without_stop_strings_nothing_is_held_back(tokenizer):
    text = "plain words and more words " * 50
    ids = tokenizer.encode(text, add_special_tokens=False)
    shown, final, most_held = stream(tokenizer, ids, (), False)
    assert most_held == 0 and shown == final == text
