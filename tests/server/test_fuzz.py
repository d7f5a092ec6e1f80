"""Generated request bodies against the five POST endpoints: no input makes the server fail.

Hypothesis draws bodies that mix valid requests with hostile field values (ints past 64 bits,
NaN and Infinity as raw JSON, wrong types, nested junk, lone surrogates, long stop lists, odd
logit_bias keys, token ids outside the vocabulary) and fully random JSON. For each body:
- the status is below 500;
- a 4xx carries the OpenAI error envelope {"error": {"message": str, "type": str, ...}};
- a 200 stream ends with `data: [DONE]`;
- the engine is still ready afterwards (GET /health/ready is 200).
After the run a plain request is still answered and every KV block is free once idle.

Why Hypothesis and not schemathesis: the handlers read raw bodies and check them with their own
messages (a prompt may be a string, a list of strings, ids or lists of ids), so the OpenAPI
schema says little about what a body may hold; the hostile cases here (raw NaN, 2**64, lone
surrogates, out-of-vocabulary ids) are the ones that matter, and a schema-driven generator would
mostly produce bodies the schema already rejects. A strategy per field says what is being tried.

Each number-taking field is also tried alone at every extreme, as explicit examples run every
time. The default run is otherwise small and derandomized (the same examples every time, so
CI is stable); `pytest -m fuzz tests/server/test_fuzz.py` runs 2500 examples from a fresh seed.
"""
from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server.conftest import LiveServer

VOCAB_SIZE = 49152  # the tiny model's (tests/conftest.py TINY)
MAX_MODEL_LEN = 128

# The values that break parsers and tensors most often, each drawn as often as any other kind.
HOSTILE_INTS = st.sampled_from([-1, VOCAB_SIZE, 2**31, 2**63, 2**64, -2**63 - 1, 10**30])
HOSTILE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324])
# Every code point, lone surrogates included (json.dumps writes them as \ud800 escapes).
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)
SCALARS = (st.none() | st.booleans() | st.integers() | st.floats() | HOSTILE_INTS
           | HOSTILE_FLOATS | ANY_TEXT)
JUNK = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=12)


HOSTILE = st.one_of(HOSTILE_INTS, HOSTILE_INTS, HOSTILE_FLOATS, HOSTILE_FLOATS, JUNK)

TOKEN_IDS = st.lists(st.integers(0, 3000), max_size=12)
BAD_TOKEN_IDS = st.lists(st.integers(0, 3000) | HOSTILE_INTS, min_size=1, max_size=12)
TEXT = st.text(max_size=40)
PROMPT = st.one_of(TEXT, TOKEN_IDS, st.lists(TEXT, min_size=1, max_size=3),
                   st.lists(TOKEN_IDS, min_size=1, max_size=3))
BAD_PROMPT = st.one_of(ANY_TEXT, BAD_TOKEN_IDS, st.lists(ANY_TEXT, max_size=3),
                       st.lists(BAD_TOKEN_IDS, max_size=3), st.just([]), st.just([[]]))
LOGIT_BIAS_KEYS = st.sampled_from(["0", "2", "49151", "49152", "-1", "1e3", " 5", "0x10", "",
                                   "18446744073709551616", "NaN"]) | ANY_TEXT
BOOL = st.booleans()

# Per field: (valid values, hostile values). A body holds valid values, or valid values with one
# field hostile, so that most bodies reach the engine and each hostile value is tried alone.
SAMPLING: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.sampled_from(["SmolLM2", "tiny"]), st.sampled_from(["", "\x00"]) | HOSTILE),
    "n": (st.integers(1, 3), st.sampled_from([0, -1, 64, 10**6, 2**63]) | HOSTILE),
    "max_tokens": (st.integers(0, 4), HOSTILE),
    "temperature": (st.floats(0, 2), HOSTILE),
    "top_p": (st.floats(0.01, 1), HOSTILE),
    "top_k": (st.integers(-1, 100), HOSTILE),
    "min_p": (st.floats(0, 1), HOSTILE),
    "seed": (st.integers(0, 2**32), HOSTILE),
    "presence_penalty": (st.floats(-2, 2), HOSTILE),
    "frequency_penalty": (st.floats(-2, 2), HOSTILE),
    "repetition_penalty": (st.floats(0.5, 2), HOSTILE),
    "logit_bias": (st.dictionaries(st.integers(0, VOCAB_SIZE - 1).map(str),
                                   st.integers(-100, 100), max_size=4),
                   st.dictionaries(LOGIT_BIAS_KEYS, st.integers(-100, 100) | HOSTILE_FLOATS,
                                   min_size=1, max_size=4) | HOSTILE),
    "stop": (TEXT | st.lists(TEXT, max_size=4),
             st.lists(ANY_TEXT, min_size=100, max_size=300) | ANY_TEXT | HOSTILE),
    "stop_token_ids": (TOKEN_IDS, BAD_TOKEN_IDS | HOSTILE),
    "stream": (BOOL, HOSTILE),
    "stream_options": (st.fixed_dictionaries({"include_usage": BOOL}), HOSTILE),
    "min_tokens": (st.integers(0, 8), HOSTILE),
    "ignore_eos": (BOOL, HOSTILE),
    "skip_special_tokens": (BOOL, HOSTILE),
    "include_stop_str_in_output": (BOOL, HOSTILE),
    "priority": (st.integers(-10, 10), HOSTILE),
    "cache_salt": (TEXT, ANY_TEXT | HOSTILE),
    "prefix_cache": (BOOL, HOSTILE),
    "user": (TEXT, ANY_TEXT | HOSTILE),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
                        st.sampled_from([{"type": "json_schema"}, {"type": "nope"}, {}])
                        | HOSTILE),
    "structured_outputs": (st.sampled_from([{"choice": ["yes", "no"]}, {"regex": "[a-c]{1,3}"},
                                            {"json": {"type": "integer"}}]),
                           st.sampled_from([{"choice": []}, {"regex": "("}, {},
                                            {"json": "nope"}]) | HOSTILE),
}
COMPLETION = {**SAMPLING, "prompt": (PROMPT, BAD_PROMPT | HOSTILE),
              "logprobs": (st.integers(0, 5), HOSTILE), "echo": (BOOL, HOSTILE),
              "best_of": (st.integers(1, 3), HOSTILE), "suffix": (TEXT, ANY_TEXT | HOSTILE)}
CONTENT = TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
                          min_size=1, max_size=3)
BAD_CONTENT = ANY_TEXT | st.lists(st.fixed_dictionaries({"type": JUNK, "text": JUNK}),
                                  max_size=3) | HOSTILE
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": CONTENT})
BAD_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["developer", "tool", "nobody", ""]) | HOSTILE},
    optional={"content": CONTENT | BAD_CONTENT, "name": ANY_TEXT | HOSTILE,
              "tool_call_id": ANY_TEXT | HOSTILE, "tool_calls": JUNK})
MESSAGES = (st.lists(MESSAGE, min_size=1, max_size=3),
            st.lists(MESSAGE | BAD_MESSAGE, max_size=4) | HOSTILE)
CHAT = {**SAMPLING, "messages": MESSAGES, "max_completion_tokens": SAMPLING["max_tokens"],
        "logprobs": (BOOL, HOSTILE), "top_logprobs": (st.integers(0, 5), HOSTILE),
        "tools": (st.just([]), JUNK), "tool_choice": (st.just("none"), JUNK),
        "add_generation_prompt": (BOOL, HOSTILE)}
TOKENIZE_PROMPT = {"prompt": (TEXT, ANY_TEXT | HOSTILE), "add_special_tokens": (BOOL, HOSTILE),
                   "model": (TEXT, HOSTILE)}
TOKENIZE_CHAT = {"messages": MESSAGES, "add_special_tokens": (BOOL, HOSTILE),
                 "add_generation_prompt": (BOOL, HOSTILE)}
DETOKENIZE = {"tokens": (TOKEN_IDS, BAD_TOKEN_IDS | HOSTILE), "model": (TEXT, HOSTILE)}
EMBEDDINGS = {"input": (PROMPT, BAD_PROMPT | HOSTILE), "model": SAMPLING["model"],
              "encoding_format": (st.sampled_from(["float", "base64"]), ANY_TEXT | HOSTILE),
              "dimensions": (st.integers(1, 64), st.sampled_from([0, 65, 2**31]) | HOSTILE),
              **{k: SAMPLING[k] for k in ("user", "priority", "cache_salt")}}


def with_one_hostile(valid: dict, fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]
                     ) -> st.SearchStrategy:
    """A valid body with one field (named, possibly absent before) set to a hostile value."""
    return st.tuples(valid, st.sampled_from(sorted(fields))).flatmap(
        lambda pair: fields[pair[1]][1].map(lambda value: {**pair[0], pair[1]: value}))


def body(fields: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]], required: tuple[str, ...]
         ) -> st.SearchStrategy:
    """Mostly valid bodies, one hostile field, a required field left out or an unknown one
    added, or random JSON of any shape."""
    valid = st.fixed_dictionaries({k: fields[k][0] for k in required},
                                  optional={k: v for k, (v, _) in fields.items()
                                            if k not in required})
    missing = st.fixed_dictionaries({}, optional={k: v for k, (v, _) in fields.items()})
    unknown = st.tuples(valid, ANY_TEXT, JUNK).map(lambda t: {**t[0], t[1]: t[2]})
    hostile = with_one_hostile(valid, fields)
    return st.one_of(valid, valid, hostile, hostile, hostile, missing, unknown, JUNK)


ENDPOINTS = {
    # max_tokens always set in valid bodies: a chat left to fill the context under a grammar
    # is slow on a loaded machine without testing anything more.
    "/v1/completions": body(COMPLETION, ("prompt", "max_tokens")),
    "/v1/chat/completions": body(CHAT, ("messages", "max_tokens")),
    "/tokenize": body(TOKENIZE_PROMPT, ("prompt",)) | body(TOKENIZE_CHAT, ("messages",)),
    "/detokenize": body(DETOKENIZE, ("tokens",)),
    "/v1/embeddings": body(EMBEDDINGS, ("input",)),
}
# Every number-taking field of a valid body, alone, at each extreme: always run (Hypothesis
# would draw one field at one extreme rarely), as explicit examples before the generated ones.
EXTREMES = [-1, 2**64, -2**63 - 1, 10**30, math.nan, math.inf, -math.inf]
NUMBER_FIELDS = ["n", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                 "priority", "logprobs"]
# The smallest float, in each float field of a constrained body: float32 reads it as 0, and
# the grammar's banned tokens (-inf) must stay banned through every processor.
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty"]
YES_NO = {"max_tokens": 2, "structured_outputs": {"choice": ["yes", "no"]}}
EXPLICIT = {
    "/v1/completions": [{"prompt": "Hi", "max_tokens": 2, field: value}
                        for field in NUMBER_FIELDS + ["best_of"] for value in EXTREMES]
    + [{"prompt": "yes no yes", field: 5e-324} | YES_NO for field in FLOAT_FIELDS],
    "/v1/chat/completions": [{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                              field: value}
                             for field in NUMBER_FIELDS + ["top_logprobs",
                                                           "max_completion_tokens"]
                             if field != "logprobs" for value in EXTREMES]
    + [{"messages": [{"role": "user", "content": "yes no yes"}], field: 5e-324} | YES_NO
       for field in FLOAT_FIELDS],
    "/tokenize": [{"prompt": "Hi", "add_special_tokens": value} for value in EXTREMES],
    "/detokenize": [{"tokens": [value]} for value in EXTREMES],
    "/v1/embeddings": [{"input": "Hi", field: value} for field in ("dimensions", "priority")
                       for value in EXTREMES] + [{"input": [[value]]} for value in EXTREMES],
}
DEFAULT_EXAMPLES = 15   # per endpoint: 75 in all
FUZZ_EXAMPLES = 500     # per endpoint under -m fuzz: 2500 in all


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_model_len": MAX_MODEL_LEN})
    yield live
    live.close()


def post(server: LiveServer, path: str, payload: object) -> httpx.Response:
    """The body as raw JSON text: Python's json writes NaN and Infinity, which is the point."""
    return httpx.post(server.url + path, content=json.dumps(payload).encode(), timeout=120,
                      headers={"Content-Type": "application/json"})


def check_response(server: LiveServer, path: str, payload: object) -> None:
    r = post(server, path, payload)
    assert r.status_code < 500, f"{r.status_code} for {json.dumps(payload)[:2000]}: {r.text}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        data = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "data: [DONE]", r.text[-2000:]
    ready = httpx.get(server.url + "/health/ready", timeout=30)
    assert ready.status_code == 200, f"not ready after {json.dumps(payload)[:2000]}: {ready.text}"


def run_property(server: LiveServer, path: str, max_examples: int, derandomize: bool) -> None:
    @settings(max_examples=max_examples, deadline=None, derandomize=derandomize, database=None,
              suppress_health_check=list(HealthCheck))
    @given(payload=ENDPOINTS[path])
    def property_holds(payload: object) -> None:
        check_response(server, path, payload)
    for payload in EXPLICIT[path]:
        property_holds = example(payload=payload)(property_holds)
    property_holds()


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_generated_bodies_never_fail_the_server(fuzz_server, path):
    run_property(fuzz_server, path, DEFAULT_EXAMPLES, derandomize=True)


@pytest.mark.fuzz
@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_many_generated_bodies_never_fail_the_server(fuzz_server, path):
    run_property(fuzz_server, path, FUZZ_EXAMPLES, derandomize=False)


def test_after_fuzzing_a_plain_request_is_answered_and_kv_is_free(fuzz_server):
    r = httpx.post(fuzz_server.url + "/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    fuzz_server.wait_idle()
    kv = fuzz_server.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
