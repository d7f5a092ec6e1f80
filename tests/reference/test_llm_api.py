"""The LLM API end to end on a tiny random model: stops, streaming, n, seeds, errors.

Reference: the same engine's own unconstrained greedy output (a stop string must cut exactly
there), and repeated runs for seeds.
"""
from __future__ import annotations

import pytest

from ember import LLM, ConfigError, ContextTooLong, FinishReason, InvalidRequest, SamplingParams

PROMPT = [1, 500, 77, 9000, 31, 2024, 17]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    folder, _ = tiny_llama_dir
    return LLM(str(folder), dtype="float32", max_model_len=256)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": 40, **kw})


def boundary_substring(llm: LLM, token_ids: list[int]) -> tuple[str, str]:
    """A substring of the text that spans a token boundary, and the text before it."""
    pieces = [llm.tokenizer.decode([t]) for t in token_ids]
    for k in range(5, len(pieces) - 1):
        left, right = pieces[k], pieces[k + 1]
        if len(left) >= 2 and len(right) >= 2 and "\ufffd" not in left + right:
            before = "".join(pieces[:k]) + left[:-2]
            return left[-2:] + right[:2], before
    raise AssertionError("no suitable token boundary in the output")


def test_stop_string_across_tokens_cuts_the_text_there(llm):
    full = llm.generate([PROMPT], greedy())[0].outputs[0]
    stop, before = boundary_substring(llm, full.token_ids)
    assert full.text.startswith(before + stop)
    first = full.text.find(stop)
    out = llm.generate([PROMPT], greedy(stop=[stop, "never-generated-zzz"]))[0].outputs[0]
    assert out.text == full.text[:first]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert len(out.token_ids) < len(full.token_ids)
    kept = llm.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full.text[:first] + stop


def test_streaming_yields_the_same_text_and_never_shows_a_stop_string(llm):
    full = llm.generate([PROMPT], greedy())[0].outputs[0]
    assert "".join(llm.stream(PROMPT, greedy())) == full.text
    stop, _ = boundary_substring(llm, full.token_ids)
    deltas = list(llm.stream(PROMPT, greedy(stop=[stop])))
    assert "".join(deltas) == full.text[:full.text.find(stop)]
    assert all(stop not in d for d in deltas)


def test_closing_a_stream_aborts_and_frees_its_blocks(llm):
    stream = llm.stream(PROMPT, greedy(max_tokens=100))
    next(stream)
    assert llm.engine.scheduler.kv.num_free_blocks < llm.engine.scheduler.kv.num_blocks
    stream.close()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    assert not llm.engine.has_unfinished()


def test_max_tokens_ends_with_length(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=5))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason is FinishReason.LENGTH


def test_n_completions_are_seeded_and_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0]
    b = llm.generate([PROMPT, [5, 6, 7]], params)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3


def test_seed_gives_the_same_tokens_whatever_shares_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate([[9, 9, 9], PROMPT, list(range(40))], [others, params, others])
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_carry_token_text(llm):
    out = llm.generate([PROMPT], greedy(max_tokens=4, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token_id and len(lp.top) == 2
        assert lp.top[0].token_id == token_id  # greedy: the chosen token is the most likely
        assert lp.token == llm.tokenizer.token_text(token_id)


def test_chat_goes_through_the_template(llm):
    messages = [{"role": "user", "content": "hello"}]
    via_chat = llm.chat(messages, greedy(max_tokens=6))[0]
    ids = llm.chat_prompt(messages)
    assert via_chat.prompt_token_ids == ids
    assert llm.tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n")
    assert via_chat.outputs[0].token_ids == llm.generate([ids], greedy(max_tokens=6))[0] \
        .outputs[0].token_ids


def test_text_prompts_are_tokenized_and_kept(llm):
    out = llm.generate("Once upon a time", greedy(max_tokens=3))[0]
    assert out.prompt == "Once upon a time"
    assert out.prompt_token_ids == llm.tokenizer.encode("Once upon a time")


def test_bad_requests_raise_and_leave_the_engine_healthy(llm):
    with pytest.raises(ContextTooLong, match="256 tokens and max_tokens=10.*holds 256"):
        llm.generate([[5] * 256], greedy(max_tokens=10))  # the prompt alone fills the context
    cut = llm.generate([[5] * 250], greedy(max_tokens=10))[0].outputs[0]
    assert len(cut.token_ids) == 6  # max_tokens cut to the room the prompt leaves
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        llm.generate([[10 ** 6]], greedy())
    with pytest.raises(InvalidRequest, match="empty"):
        llm.generate([[]], greedy())
    with pytest.raises(InvalidRequest, match="logit_bias"):
        llm.generate([PROMPT], greedy(logit_bias={10 ** 6: 1.0}))
    with pytest.raises(InvalidRequest, match="one per prompt"):
        llm.generate([PROMPT, PROMPT], [greedy(), greedy(), greedy()])
    # a batch with one bad prompt queues nothing
    with pytest.raises(InvalidRequest):
        llm.generate([PROMPT, [10 ** 6]], greedy())
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks
    assert len(llm.generate([PROMPT], greedy(max_tokens=3))[0].outputs[0].token_ids) == 3


def test_max_tokens_none_fills_the_context(llm):
    out = llm.generate([[5] * 250], SamplingParams(temperature=0, max_tokens=None,
                                                   ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason is FinishReason.LENGTH


def test_config_errors_name_the_fix(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    with pytest.raises(ConfigError, match="did you mean max_num_seqs"):
        LLM(str(folder), max_num_seq=4)
    with pytest.raises(ConfigError, match="exceeds the model's context of 512"):
        LLM(str(folder), max_model_len=4096)
    with pytest.raises(ConfigError, match="power of two"):
        LLM(str(folder), block_size=12)
