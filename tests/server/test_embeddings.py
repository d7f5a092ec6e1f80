"""/v1/embeddings over HTTP on the tiny random model: the OpenAI shape (through the openai
SDK too), vectors equal to transformers' pooled hidden states, base64 == float, Matryoshka
truncation, usage, and a 400 naming the rule for each bad input."""
from __future__ import annotations

import base64
import threading

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ember.config import ServerConfig
from tests.server.conftest import LiveServer

MAX_INPUTS = 8
MAX_LEN = 64


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    # a 16-token budget: longer inputs are prefilled in chunks, beside other requests
    live = LiveServer(folder, engine_options={"max_model_len": MAX_LEN,
                                              "max_num_batched_tokens": 16},
                      max_embedding_inputs=MAX_INPUTS)
    yield live
    live.close()


def hf_last(hf, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(hidden[-1][:dimensions], dim=0).numpy()


def embed(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_openai_sdk_embeddings_match_transformers(server, tiny_llama_dir):
    import openai
    _, hf = tiny_llama_dir
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["Hello there, how are you?", "A longer sentence, long enough to be prefilled in "
             "more than one chunk of sixteen tokens by the scheduler of the engine."]
    result = client.embeddings.create(input=texts, model=server.state.model_name)
    assert [d.index for d in result.data] == [0, 1]
    ids = [server.engine.tokenizer.encode(t) for t in texts]
    assert result.usage.prompt_tokens == result.usage.total_tokens == sum(map(len, ids))
    for item, prompt in zip(result.data, ids):
        got = np.asarray(item.embedding)
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        assert float(got @ hf_last(hf, prompt)) >= 0.9999


def test_base64_decodes_to_the_float_vectors(server):
    ids = [[5, 6, 7, 8], list(range(300, 340))]
    # salted apart: the second request computes what the first did, not a prefix-cache hit
    floats = embed(server, input=ids, encoding_format="float", cache_salt="a").json()
    packed = embed(server, input=ids, encoding_format="base64", cache_salt="b").json()
    for f, b in zip(floats["data"], packed["data"]):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == f["embedding"]
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"
    assert floats["model"] == server.state.model_name


def test_token_id_inputs_and_dimensions(server, tiny_llama_dir):
    _, hf = tiny_llama_dir
    one = embed(server, input=list(range(40, 60)), dimensions=24).json()
    (item,) = one["data"]
    assert len(item["embedding"]) == 24
    got = np.asarray(item["embedding"])
    assert abs(np.linalg.norm(got) - 1) < 1e-5
    assert float(got @ hf_last(hf, list(range(40, 60)), 24)) >= 0.9999
    full = np.asarray(embed(server, input=list(range(40, 60))).json()["data"][0]["embedding"])
    assert np.allclose(got, full[:24] / np.linalg.norm(full[:24]), atol=1e-6)
    assert one["usage"] == {"prompt_tokens": 20, "total_tokens": 20}


def test_embeddings_beside_streamed_generation(server, tiny_llama_dir):
    """Embeddings while a completion streams: both correct; the completion's tokens are those
    it makes alone."""
    _, hf = tiny_llama_dir
    body = {"prompt": [7, 8, 9, 10], "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    results = {}

    def complete() -> None:
        results["gen"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    thread = threading.Thread(target=complete)
    thread.start()
    inputs = [list(range(500 + 7 * i, 540 + 7 * i)) for i in range(4)]
    data = embed(server, input=inputs).json()["data"]
    thread.join(60)
    assert results["gen"]["choices"][0]["text"] == alone["choices"][0]["text"]
    for item, ids in zip(data, inputs):
        assert float(np.asarray(item["embedding"]) @ hf_last(hf, ids)) >= 0.9999
    server.wait_idle()


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "input must be a non-empty string"),
    ({"input": ""}, "input", r"input\[0\] is an empty string"),
    ({"input": ["fine", ""]}, "input", r"input\[1\] is an empty string"),
    ({"input": [[]]}, "input", "input must be"),
    ({"input": ["text", [1, 2]]}, "input", "input must be"),
    ({"input": 42}, "input", "input must be"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"input": [[5, 6], list(range(MAX_LEN + 1))]}, "input",
     rf"input\[1\] has {MAX_LEN + 1} tokens, but the model embeds at most {MAX_LEN}"),
    ({"input": [[10**7]]}, "prompt", "outside the vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions", r"must be an integer in \[1, "),
    ({"input": "x", "dimensions": 65}, "dimensions", r"dimensions=65 must be in \[1, 64\]"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
    ({"input": "x", "pooling": "mean"}, "pooling", "unknown parameter"),
])
def test_bad_requests_get_a_clear_4xx(server, body, param, message):
    r = embed(server, **body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert pytest.importorskip("re").search(message, error["message"]), error["message"]
    server.wait_idle()


def test_embeddings_count_in_the_metrics(server):
    before = server.metric("ember_prompt_tokens_total")
    embed(server, input=[[1, 2, 3], [4, 5]])
    assert server.metric("ember_prompt_tokens_total") == before + 5


def test_ember_serve_task_embed_on_minilm_matches_sentence_transformers(minilm_path):
    """`ember serve --task embed` on all-MiniLM-L6-v2 (a BERT): the openai SDK's vectors equal
    sentence-transformers' on the same weights; the flags bound the inputs; no completions."""
    import openai
    st = pytest.importorskip("sentence_transformers")
    from tests.server.conftest import free_port, start_server, wait_ready
    port = free_port()
    proc = start_server(minilm_path, port, "--task", "embed", "--dtype", "float32",
                        "--max-embedding-inputs", "3")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url)
        texts = ["A man is eating food.", "The new movie is awesome!", "ok"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(input=texts, model="model")
        got = np.asarray([d.embedding for d in result.data])
        want = st.SentenceTransformer(str(minilm_path), device="cpu").encode(
            texts, normalize_embeddings=True)
        assert np.all((got * want).sum(axis=1) >= 0.9999)
        r = httpx.post(url + "/v1/embeddings", json={"input": texts + ["four"]})
        assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/embeddings", json={"input": "word " * 300})
        assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                                  "content": "hi"}]}),
                           ("/v1/completions", {"prompt": "hi"})):
            r = httpx.post(url + path, json=body)
            assert r.status_code == 400 and "--task generate" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(30)


def test_inputs_count_against_max_waiting(server):
    """Each input is one waiting sequence: with a request waiting, an embeddings request that
    would pass --max-waiting gets 429 with Retry-After; with nothing waiting, one of more
    inputs than --max-waiting is let in, so it is never refused for good."""
    engine, gate = server.engine, threading.Event()
    real_step, engine.max_waiting = engine.core.step, 4
    try:
        r = embed(server, input=[[5, 6, 7]] * 8)   # 8 inputs > 4, nothing waiting
        assert r.status_code == 200 and len(r.json()["data"]) == 8
        server.delay_steps(gate=gate)              # the engine holds what it has queued
        waiting = threading.Thread(target=lambda: embed(server, input=[[5, 6]]))
        waiting.start()
        while engine.stats.num_waiting + len(engine._inbox) == 0:
            waiting.join(0.01)
        r = embed(server, input=[[5, 6, 7]] * 4)   # 1 waiting + 4 > 4
        assert r.status_code == 429 and r.headers["retry-after"]
        assert "takes at most 4" in r.json()["error"]["message"]
        gate.set()
        waiting.join(30)
    finally:
        gate.set()
        engine.core.step, engine.max_waiting = real_step, ServerConfig().max_waiting
        server.wait_idle()
