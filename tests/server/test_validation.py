"""Every request field is bounded at the HTTP edge: a bad value is a 400 in OpenAI's envelope
whose message names the allowed range, never a 5xx and never a dead engine.

Reference: OpenAI's documented ranges (temperature [0, 2], top_p (0, 1], penalties [-2, 2],
logit_bias [-100, 100], top_logprobs [0, 20], at most 16 stop... ember allows 16 stop strings
where OpenAI allows 4), vLLM's for its extensions, and torch.Generator's seed range.
"""
from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from ember.errors import BadSamplingParams
from ember.request import SamplingParams
from tests.server.test_errors import assert_error

SEED = "[-9223372036854775808, 18446744073709551615]"
INT32 = "[1, 2147483647]"


def post(server, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json"})


def raw(fields: str, prompt: str = '"hi"') -> bytes:
    """A completion body written by hand: NaN and Infinity are not JSON, but Python's json
    (and so the server) reads them."""
    return ('{"prompt": %s, "max_tokens": 2, %s}' % (prompt, fields)).encode()


COMPLETIONS = [  # (body, words in the message, param)
    (raw('"seed": 18446744073709551616'), [SEED], "seed"),
    (raw('"seed": -9223372036854775809'), [SEED], "seed"),
    (raw('"n": 17'), ["[1, 16]", "--max-n"], "n"),
    (raw('"n": 1000000000000000000000000000000'), ["[1, 16]"], "n"),
    (raw('"n": 2, "best_of": 17'), ["best_of", "[1, 16]"], "best_of"),
    (b'{"prompt": "hi", "max_tokens": 0}', ["max_tokens", INT32], "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": -5}', ["max_tokens", INT32], "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 1180591620717411303424}', [INT32], "max_tokens"),
    (raw('"min_tokens": 5'), ["min_tokens=5 must be in [0, max_tokens=2]"], "min_tokens"),
    (raw('"top_k": 1180591620717411303424'), ["top_k", "[0, 2147483647]"], "top_k"),
    (raw('"top_k": -2'), ["top_k", "0 or -1 turn it off"], "top_k"),
    (raw('"priority": 1208925819614629174706176'), ["[-2147483648, 2147483647]"], "priority"),
    (raw('"temperature": NaN'), ["finite", "[0, 2]"], "temperature"),
    (raw('"temperature": Infinity'), ["finite", "[0, 2]"], "temperature"),
    (raw('"temperature": 1e400'), ["finite", "[0, 2]"], "temperature"),
    (raw('"temperature": 2.5'), ["temperature=2.5", "[0, 2]"], "temperature"),
    (raw('"top_p": 0'), ["top_p", "(0, 1]"], "top_p"),
    (raw('"top_p": -Infinity'), ["finite", "(0, 1]"], "top_p"),
    (raw('"min_p": 1.5'), ["min_p", "[0, 1]"], "min_p"),
    (raw('"presence_penalty": -3'), ["presence_penalty", "[-2, 2]"], "presence_penalty"),
    (raw('"frequency_penalty": NaN'), ["finite", "[-2, 2]"], "frequency_penalty"),
    (raw('"repetition_penalty": 0'), ["repetition_penalty", "(0, 10]"], "repetition_penalty"),
    (raw('"logprobs": 21'), ["logprobs", "[0, 20]"], "logprobs"),
    (raw('"logit_bias": {%s}' % ", ".join(f'"{i}": 1' for i in range(1025))),
     ["1025 entries", "at most 1024"], "logit_bias"),
    (raw('"logit_bias": {"5": 101}'), ["[-100, 100]"], "logit_bias"),
    (raw('"logit_bias": {"5": NaN}'), ["finite", "[-100, 100]"], "logit_bias.5"),
    (raw('"logit_bias": {"-1": 1}'), ["not a token id"], "logit_bias"),
    (raw('"logit_bias": {"%s": 1}' % ("9" * 5000)), ["token ids"], "logit_bias"),
    (raw('"logit_bias": {"60000": 1}'), ["outside the vocabulary [0, 49152)"], None),
    (raw('"stop": %s' % json.dumps([f"s{i}" for i in range(17)])), ["at most 16"], "stop"),
    (raw('"stop": "%s"' % ("x" * 257)), ["1 to 256 characters"], "stop"),
    (raw('"stop": ""'), ["1 to 256 characters"], "stop"),
    (raw('"stop_token_ids": %s' % json.dumps(list(range(257)))), ["at most 256"],
     "stop_token_ids"),
    (raw('"stop_token_ids": [1180591620717411303424]'), ["vocabulary"], "stop_token_ids"),
    (raw('"stop_token_ids": [60000]'), ["outside the vocabulary [0, 49152)"], None),
    (raw('"stop_token_ids": ["a"]'), ["stop_token_ids"], "stop_token_ids.0"),
    (raw("", prompt="[1180591620717411303424]")[:-3] + b"}", ["outside the vocabulary"],
     "prompt"),
    (b'{"prompt": [-1]}', ["outside the vocabulary [0, 49152)"], "prompt"),
    (b'{"prompt": [1.5]}', ["prompt must be"], "prompt"),
    (b'{"prompt": [true]}', ["prompt must be"], "prompt"),
    (b'{"prompt": "\\ud800"}', ["surrogate"], None),
    (b'{"prompt": "\xff\xfe"}', ["not valid JSON"], None),
    (b'{"prompt": "hi", "n": ' + b"1" * 5000 + b"}", ["not valid JSON"], None),
    (b'{"prompt": "hi", "n": "many"}', ["'n'"], "n"),
    (raw('"structured_outputs": {"regex": "%s"}' % ("(" * 100 + "a" + ")" * 100)),
     ["nests 100 levels", "at most 64"], "structured_outputs.regex"),
    (raw('"structured_outputs": {"regex": "%s"}' % ("a" * 70000)),
     ["over 65536 bytes"], "structured_outputs.regex"),
    (raw('"structured_outputs": {"json": "not json"}'), ["not valid JSON"],
     "structured_outputs.json"),
    (raw('"structured_outputs": {"json": "%s"}' % ("[" * 5000)), ["nests 5000 levels"],
     "structured_outputs.json"),
    (raw('"structured_outputs": {"choice": %s}' % json.dumps([str(i) for i in range(1025)])),
     ["at most 1024"], "structured_outputs.choice"),
]


@pytest.mark.parametrize("body,words,param", COMPLETIONS, ids=range(len(COMPLETIONS)))
def test_bad_completion_fields_get_400_naming_the_range(server, body, words, param):
    assert_error(post(server, "/v1/completions", body), 400, *words, param=param)


HI = [{"role": "user", "content": "hi"}]
CHAT = [
    ({"messages": HI * 2049}, ["2049 entries", "at most 2048"], "messages"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                for i in range(129)]}, ["at most 128"], "tools"),
    ({"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "description": "x" * 300_000}}]}, ["the limit is 262144"], "tools"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 21}, ["[0, 20]"], "top_logprobs"),
    ({"messages": HI, "max_completion_tokens": 0}, [INT32], "max_completion_tokens"),
    ({"messages": HI, "max_tokens": 2, "max_completion_tokens": 4, "min_tokens": 5},
     ["min_tokens=5 must be in [0, max_completion_tokens=4]"], "min_tokens"),
    ({"messages": HI, "n": 17}, ["[1, 16]"], "n"),
    ({"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(" * 80 + ")" * 80}}}},
     ["nests", "at most 64"], "response_format.json_schema"),
]


@pytest.mark.parametrize("body,words,param", CHAT, ids=range(len(CHAT)))
def test_bad_chat_fields_get_400_naming_the_range(server, body, words, param):
    assert_error(post(server, "/v1/chat/completions", body), 400, *words, param=param)


def test_detokenize_huge_ids_get_400(server):
    assert_error(post(server, "/detokenize", {"tokens": [2**70]}), 400, "token ids",
                 param="tokens")


def test_seed_past_the_generator_range_leaves_the_engine_serving(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "seed": 2**64})
    assert_error(r, 400, SEED, param="seed")
    # the top of the range, fanned out to n=2: completion 1's seed wraps to 0
    r = post(server, "/v1/completions", {"prompt": "hi", "seed": 2**64 - 1, "n": 2,
                                         "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2 and r.json()["usage"]["completion_tokens"] == 6
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(server.url + "/health/ready").status_code == 200


def test_seeds_that_torch_reads_alike_sample_alike(server):
    """-1 and 2**64 - 1 are the same generator state (torch reads seeds mod 2**64)."""
    texts = [post(server, "/v1/completions", {"prompt": [5, 6, 7], "seed": seed,
                                              "temperature": 1.0, "max_tokens": 6,
                                              "ignore_eos": True}).json()["choices"][0]["text"]
             for seed in (-1, 2**64 - 1)]
    assert texts[0] == texts[1]


def test_max_tokens_past_the_context_is_cut_to_the_room_left(server):
    r = post(server, "/v1/completions", {"prompt": [5] * 500, "max_tokens": 10**6,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 512 - 500
    assert body["choices"][0]["finish_reason"] == "length"


def test_a_prompt_that_fills_the_context_alone_is_still_refused(server):
    r = post(server, "/v1/completions", {"prompt": [5] * 512, "max_tokens": 1})
    assert_error(r, 400, "prompt has 512 tokens", "holds 512")


def test_sampling_params_refuse_what_the_engine_step_cannot_hold():
    """Defence in depth: the engine's own check, for callers that skip the server."""
    for field, value in (("seed", 2**64), ("top_k", 2**70), ("n", 2**40),
                         ("stop_token_ids", (2**70,)), ("logit_bias", {2**70: 1.0})):
        with pytest.raises(BadSamplingParams, match=field):
            SamplingParams(**{field: value})
    assert [p.seed for p in SamplingParams(n=3, seed=2**64 - 2).fan_out()] == [2**64 - 2,
                                                                               2**64 - 1, 0]


def test_max_n_comes_from_the_server_config(server):
    config = server.state.config
    server.state.config = dataclasses.replace(config, max_n=2)
    try:
        r = post(server, "/v1/completions", {"prompt": "hi", "n": 3, "max_tokens": 1})
        assert_error(r, 400, "n=3 must be an integer in [1, 2]", "--max-n", param="n")
        r = post(server, "/v1/completions", {"prompt": "hi", "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    finally:
        server.state.config = config


def test_prompts_times_n_count_against_max_waiting(server):
    """Every sequence a request asks for (prompts x n) is counted at once: a request the
    queue cannot take whole is refused whole, before any of it runs."""
    engine = server.engine
    limit = engine.max_waiting
    engine.max_waiting = 4
    try:
        r = post(server, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
        assert_error(r, 429, "takes at most 4", "adds 6")
        assert r.headers["retry-after"]
        server.wait_idle()
        r = post(server, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
    finally:
        engine.max_waiting = limit
