"""The OpenAI API through the official `openai` client and raw HTTP, on a real server.

Reference: ember's offline LLM on the same model (itself checked against transformers) for
tokens, text and logprobs; OpenAI's published shapes for everything else.
"""
from __future__ import annotations

import json

import httpx
import pytest

from ember import LLM, SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def offline(tiny_llama_dir) -> LLM:
    folder, _ = tiny_llama_dir
    return LLM(str(folder), dtype="float32", max_model_len=512)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def sse_events(response: httpx.Response) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n")
    events = body.split("\n\n")[:-2]  # then "data: [DONE]" and the empty tail
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: "):] for e in events]


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.state.model_name]
    assert client.models.retrieve(server.state.model_name).id == server.state.model_name


def test_completion_matches_offline_greedy(client, offline):
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                    max_tokens=12, temperature=0)
    want = offline.generate(PROMPT, greedy(max_tokens=12))[0].outputs[0]
    assert out.choices[0].text == want.text
    assert out.choices[0].finish_reason == want.finish_reason.value
    assert out.object == "text_completion"
    assert out.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == len(want.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_matches_offline_greedy_through_the_template(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = client.chat.completions.create(model=None,
                                         messages=messages, max_completion_tokens=10,
                                         temperature=0)
    want = offline.chat(messages, greedy(max_tokens=10))[0]
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.outputs[0].text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    assert out.usage.completion_tokens == len(want.outputs[0].token_ids)
    assert out.object == "chat.completion"


def test_chat_stream_framing_and_usage(server, offline):
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 15,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(httpx.post(server.url + "/v1/chat/completions", json=body))
    chunks = [json.loads(e) for e in events]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    *content, final, usage = chunks
    assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 15
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content)
    want = offline.chat(body["messages"], greedy(max_tokens=15))[0].outputs[0].text
    assert text == want
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_matches_non_stream(client):
    stream = client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       model=None)
    pieces = list(stream)
    whole = client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model=None)
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    assert all(p.choices[0].finish_reason is None for p in pieces[:-1])


def test_stream_without_usage_has_no_usage_field(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    for event in sse_events(httpx.post(server.url + "/v1/completions", json=body)):
        assert "usage" not in json.loads(event)


def test_n_with_seed_is_reproducible_and_counts_usage(client):
    kw = dict(prompt=PROMPT, max_tokens=8, temperature=1.0, seed=11, n=3, model=None)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) == 3
    assert a.usage.completion_tokens == 24


def test_several_prompts_index_choices_prompt_major(client, offline):
    prompts = [PROMPT, "Hello there"]
    out = client.completions.create(prompt=prompts, max_tokens=4, temperature=0, n=2, model=None)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    want = offline.generate(prompts, greedy(max_tokens=4))
    assert out.choices[0].text == out.choices[1].text == want[0].outputs[0].text
    assert out.choices[2].text == out.choices[3].text == want[1].outputs[0].text
    assert out.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    ids = [[5, 6, 7, 8], [9, 10]]
    ids_out = client.completions.create(prompt=ids, max_tokens=4, temperature=0, model=None)
    want = offline.generate(ids, greedy(max_tokens=4))
    assert [c.text for c in ids_out.choices] == [w.outputs[0].text for w in want]
    one = client.completions.create(prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, model=None)
    assert one.choices[0].text == want[0].outputs[0].text


def test_completion_logprobs_shape_and_values(client, offline):
    out = client.completions.create(prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                    model=None)
    lp = out.choices[0].logprobs
    want = offline.generate(PROMPT, greedy(max_tokens=5, logprobs=3))[0].outputs[0].logprobs
    assert lp.tokens == [w.token for w in want]
    assert lp.token_logprobs == pytest.approx([w.logprob for w in want], abs=1e-5)
    assert [list(t) for t in lp.top_logprobs] == [[x.token for x in w.top] for w in want]
    assert lp.text_offset == [sum(len(w.token) for w in want[:i]) for i in range(5)]


def test_chat_logprobs_shape_and_values(client, offline):
    messages = [{"role": "user", "content": "Hello"}]
    out = client.chat.completions.create(messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2, model=None)
    content = out.choices[0].logprobs.content
    want = offline.chat(messages, greedy(max_tokens=4, logprobs=2))[0].outputs[0].logprobs
    assert [c.token for c in content] == [w.token for w in want]
    assert [c.logprob for c in content] == pytest.approx([w.logprob for w in want], abs=1e-5)
    for c, w in zip(content, want):
        assert bytes(c.bytes) == offline.tokenizer.token_bytes(w.token_id)
        assert [t.token for t in c.top_logprobs] == [x.token for x in w.top]
    no_top = client.chat.completions.create(messages=messages, max_tokens=2, logprobs=True,
                                            model=None)
    assert all(c.top_logprobs == [] for c in no_top.choices[0].logprobs.content)


def test_stop_strings_cut_the_text(client, offline):
    full = offline.generate(PROMPT, greedy(max_tokens=30, ignore_eos=True))[0].outputs[0].text
    stop = full[8:11]
    out = client.completions.create(prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
                                    model=None, extra_body={"ignore_eos": True})
    assert out.choices[0].text == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        prompt=PROMPT, max_tokens=30, temperature=0, stop=stop, model=None, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == out.choices[0].text


def test_penalties_bias_and_extensions_reach_the_sampler(client, offline):
    kw = dict(max_tokens=6, temperature=0)
    banned = offline.generate(PROMPT, greedy(max_tokens=1))[0].outputs[0].token_ids[0]
    out = client.completions.create(prompt=PROMPT, logit_bias={str(banned): -100}, model=None,
                                    **kw)
    want = offline.generate(PROMPT, greedy(max_tokens=6, logit_bias={banned: -100}))[0]
    assert out.choices[0].text == want.outputs[0].text
    out = client.completions.create(prompt=PROMPT, presence_penalty=1.5, frequency_penalty=0.5,
                                    model=None, extra_body={"repetition_penalty": 1.3,
                                                            "top_k": 5, "min_tokens": 6}, **kw)
    want = offline.generate(PROMPT, greedy(max_tokens=6, presence_penalty=1.5,
                                           frequency_penalty=0.5, repetition_penalty=1.3,
                                           top_k=5, min_tokens=6))[0]
    assert out.choices[0].text == want.outputs[0].text


def test_echo_prepends_the_prompt(client):
    out = client.completions.create(prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                    model=None)
    plain = client.completions.create(prompt=PROMPT, max_tokens=3, temperature=0, model=None)
    assert out.choices[0].text == PROMPT + plain.choices[0].text


def test_tokenize_detokenize_version(server, offline):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == offline.tokenizer.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    chat = httpx.post(server.url + "/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == offline.chat_prompt([{"role": "user", "content": "hi"}])
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": PROMPT}
    assert httpx.get(server.url + "/version").json()["version"]


def test_user_and_text_parts_are_accepted(client, offline):
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                               {"type": "text", "text": "lo"}]}],
        max_tokens=3, temperature=0, user="tenant-1", model=None)
    want = offline.chat([{"role": "user", "content": "Hello"}], greedy(max_tokens=3))[0]
    assert out.choices[0].message.content == want.outputs[0].text


def test_the_page_is_served(server):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "<title>ember</title>" in page.text


def test_seeded_sampling_matches_offline_for_every_sampling_knob(client, offline):
    """temperature, top_p, top_k, min_p and seed reach the sampler exactly as offline."""
    knobs = dict(temperature=0.9, top_p=0.8, seed=5)
    extra = dict(top_k=20, min_p=0.05)
    out = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=12, model=None, extra_body=extra, **knobs)
    want = offline.chat([{"role": "user", "content": "Hi"}],
                        SamplingParams(max_tokens=12, **knobs, **extra))[0].outputs[0]
    assert out.choices[0].message.content == want.text
