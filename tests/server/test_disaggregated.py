"""Disaggregated serving between real servers: a prefill replica computes the prompt and its
first token, a decode replica pulls the KV and goes on. The reference is one ordinary
replica of the same engine options answering the same request: greedy text, token counts
and usage must match. Afterwards every block of every replica is free again."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import LiveServer, free_port, start_server, wait_ready

# bf16 and int8 caches; the torch kernels (no compile) and a small pool (pins are counted)
CACHES = {"bfloat16": {"dtype": "bfloat16"}, "int8": {"kv_cache_dtype": "int8"}}
BASE = {"max_model_len": 512, "kernels": "torch", "num_blocks": 128}
PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3,
           "Once upon a time, in a land far away, there lived a king who",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18,"]
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


class Trio:
    """One ordinary replica (the reference), one prefill, one decode replica."""

    def __init__(self, folder, options: dict, transport: str = "auto", **extra) -> None:
        options = BASE | options
        self.single = LiveServer(folder, engine_options=options)
        self.prefill = LiveServer(folder, engine_options=options | {"role": "prefill"} | extra)
        self.decode = LiveServer(folder, engine_options=options | {
            "role": "decode", "kv_transport": transport})

    def close(self) -> None:
        for server in (self.single, self.prefill, self.decode):
            server.close()


@pytest.fixture(scope="module", params=sorted(CACHES))
def trio(request, tiny_llama_dir):
    folder, _ = tiny_llama_dir
    servers = Trio(folder, CACHES[request.param])
    yield servers
    servers.close()


def complete(url: str, prompt: str, **fields) -> dict:
    resp = httpx.post(url + "/v1/completions", json={"prompt": prompt} | GREEDY | fields,
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def disaggregated(trio: Trio, prompt: str, stream: bool = False) -> tuple[dict, str, dict]:
    """The prefill answer, the whole text, and the decode answer's usage."""
    first = complete(trio.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params is not None and params["do_remote_prefill"]
    assert first["choices"][0]["finish_reason"] is None
    body = {"prompt": prompt, "kv_transfer_params": params} | GREEDY
    if not stream:
        rest = complete(trio.decode.url, prompt, kv_transfer_params=params)
        return first, first["choices"][0]["text"] + rest["choices"][0]["text"], rest["usage"]
    text, usage = "", None
    with httpx.stream("POST", trio.decode.url + "/v1/completions", timeout=60, json=body | {
            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                text += "".join(c["text"] for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return first, first["choices"][0]["text"] + text, usage


def assert_all_free(*servers: LiveServer) -> None:
    for server in servers:
        server.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_text_and_usage_match_one_replica(trio, stream):
    for prompt in PROMPTS:
        prompt += " (streamed)" if stream else ""   # each prompt new to every cache
        want = complete(trio.single.url, prompt)
        first, text, usage = disaggregated(trio, prompt, stream)
        assert text == want["choices"][0]["text"]
        assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert usage["completion_tokens"] == want["usage"]["completion_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == \
            first["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["completion_tokens"] == 1
    name = trio.decode.state.model_name
    assert trio.decode.metric(f'ember_kv_transfer_loads_total{{model_name="{name}"}}') >= \
        len(PROMPTS)
    assert trio.decode.metric(
        f'ember_kv_transfer_bytes_total{{model_name="{name}",transport="shm"}}') > 0
    assert_all_free(trio.prefill, trio.decode)


def test_seeded_samples_match_one_replica(trio):
    """A seeded request's noise depends on its seed and the position drawn, so the decode
    replica draws what one replica would have, from the second token on."""
    prompt = "Sampled, with a seed, through two replicas:"
    fields = {"temperature": 0.9, "seed": 7, "ignore_eos": True, "max_tokens": 12}
    want = complete(trio.single.url, prompt, **fields)["choices"][0]["text"]
    first = complete(trio.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True},
                     **fields)
    rest = complete(trio.decode.url, prompt, kv_transfer_params=first["kv_transfer_params"],
                    **fields)
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == want
    assert_all_free(trio.prefill, trio.decode)


def test_chat_through_two_replicas(trio):
    def chat(url: str, **fields) -> dict:
        resp = httpx.post(url + "/v1/chat/completions", timeout=60, json={"messages": [
            {"role": "user", "content": "Say something, through two replicas."}]}
            | GREEDY | fields)
        assert resp.status_code == 200, resp.text
        return resp.json()
    want = chat(trio.single.url)
    first = chat(trio.prefill.url, kv_transfer_params={"do_remote_decode": True})
    rest = chat(trio.decode.url, kv_transfer_params=first["kv_transfer_params"])
    assert first["choices"][0]["message"]["content"] + \
        rest["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    assert rest["usage"] == want["usage"]
    assert_all_free(trio.prefill, trio.decode)


def test_text_held_back_for_a_stop_string_is_shown_once(trio):
    """With stop strings, the tail that could start one is held back: the prefill replica's
    answer leaves it out, the decode replica's shows it, and the two join into one text."""
    prompt = "Stop strings hold text back, here across two replicas:"
    fields = {"stop": ["never in this text, surely"]}
    want = complete(trio.single.url, prompt, **fields)["choices"][0]["text"]
    first = complete(trio.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True},
                     **fields)
    rest = complete(trio.decode.url, prompt, kv_transfer_params=first["kv_transfer_params"],
                    **fields)
    assert first["choices"][0]["text"] == ""   # one token is shorter than the holdback
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == want


def test_decode_pulls_only_the_blocks_it_lacks(trio):
    """The same prompt twice: the second time the decode replica's prefix cache holds its
    full blocks, so only the tail block moves. The answers are the ordinary replica's, asked
    twice too: the second time each prefills only the prompt's last token over its cache (a
    bfloat16 cache hit may change the answer, on any replica: docs/same-answer.md)."""
    prompt = "A long shared system prompt that fills several blocks of the cache. " * 5
    name = trio.decode.state.model_name
    skipped = trio.decode.metric(f'ember_kv_transfer_blocks_skipped_total{{model_name="{name}"}}')
    _, text1, _ = disaggregated(trio, prompt)
    after_first = trio.decode.metric(
        f'ember_kv_transfer_blocks_skipped_total{{model_name="{name}"}}')
    first, text2, _ = disaggregated(trio, prompt)
    full_blocks = first["kv_transfer_params"]["num_tokens"] // 16
    assert full_blocks >= 2
    assert after_first == skipped
    assert trio.decode.metric(f'ember_kv_transfer_blocks_skipped_total{{model_name="{name}"}}'
                              ) == after_first + full_blocks
    assert text1 == complete(trio.single.url, prompt)["choices"][0]["text"]
    assert text2 == complete(trio.single.url, prompt)["choices"][0]["text"]
    assert_all_free(trio.prefill, trio.decode)


def test_released_pin_makes_the_decode_replica_compute_the_prompt(trio):
    """A gateway that aborts releases the pin (DELETE); a decode replica sent the params
    anyway finds nothing to pull and computes the prompt itself, with the same answer."""
    prompt = "Abort this transfer, please, and compute it again"
    first = complete(trio.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    url = f"{trio.prefill.url}/kv_transfer/{params['transfer_id']}"
    assert httpx.delete(url).status_code == 200
    assert httpx.delete(url).status_code == 404
    trio.prefill.wait_idle()
    name = trio.decode.state.model_name
    metric = f'ember_kv_transfer_fallbacks_total{{model_name="{name}",reason="expired"}}'
    before = trio.decode.metric(metric)
    rest = complete(trio.decode.url, prompt, kv_transfer_params=params)
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == \
        complete(trio.single.url, prompt)["choices"][0]["text"]
    assert trio.decode.metric(metric) == before + 1
    assert_all_free(trio.prefill, trio.decode)


def test_a_mismatched_prompt_is_computed_here_and_the_pin_released(trio):
    first = complete(trio.prefill.url, "one prompt on the prefill replica",
                     kv_transfer_params={"do_remote_decode": True})
    name = trio.decode.state.model_name
    metric = f'ember_kv_transfer_fallbacks_total{{model_name="{name}",reason="prompt_mismatch"}}'
    before = trio.decode.metric(metric)
    rest = complete(trio.decode.url, "another prompt on the decode replica",
                    kv_transfer_params=first["kv_transfer_params"])
    assert rest["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert trio.decode.metric(metric) == before + 1
    assert_all_free(trio.prefill, trio.decode)   # the pin was released, not left to expire


def test_requests_a_replica_cannot_serve_get_a_400(trio):
    cases = [(trio.single.url, {"kv_transfer_params": {"do_remote_decode": True}}),
             (trio.decode.url, {"kv_transfer_params": {"do_remote_decode": True}}),
             (trio.prefill.url, {"kv_transfer_params": {"do_remote_decode": True},
                                 "stream": True}),
             (trio.prefill.url, {"kv_transfer_params": {"do_remote_decode": True}, "n": 2}),
             (trio.decode.url, {"kv_transfer_params": {"do_remote_prefill": True}}),
             (trio.prefill.url, {"kv_transfer_params": {"do_remote_decode": True,
                                                        "do_remote_prefill": True}})]
    for url, fields in cases:
        resp = httpx.post(url + "/v1/completions", json={"prompt": "hi"} | GREEDY | fields)
        assert resp.status_code == 400, (fields, resp.text)
        assert resp.json()["error"]["param"].startswith("kv_transfer_params"), resp.text
    assert httpx.post(trio.prefill.url + "/kv_transfer/nope/claim").status_code == 404


def test_a_decode_replica_pulls_only_from_its_peers(trio):
    """A request naming a prefill replica on a host outside --kv-peers (loopback without
    it) gets a 400 and the replica contacts nothing; a loopback one is served."""
    prompt = PROMPTS[1]
    first = complete(trio.prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    for elsewhere in ("http://169.254.169.254/latest", "http://example.com:8000",
                      "https://10.0.0.1"):
        resp = httpx.post(trio.decode.url + "/v1/completions", json={
            "prompt": prompt, "kv_transfer_params": params | {"remote_url": elsewhere}} | GREEDY)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "kv_transfer_params.remote_url" and "--kv-peers" in \
            error["message"]
    rest = complete(trio.decode.url, prompt, kv_transfer_params=params)
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == \
        complete(trio.single.url, prompt)["choices"][0]["text"]
    assert_all_free(trio.prefill, trio.decode)


def test_first_token_that_ends_the_request_keeps_nothing(trio):
    """max_tokens=1: the prefill replica's answer is the whole answer; nothing is pinned."""
    answer = complete(trio.prefill.url, "short", max_tokens=1,
                      kv_transfer_params={"do_remote_decode": True})
    assert answer["kv_transfer_params"] is None
    assert answer["choices"][0]["finish_reason"] == "length"
    assert_all_free(trio.prefill)


def test_pins_expire(tiny_llama_dir):
    """A pin nobody pulls goes back to the pool once it expires (counted)."""
    folder, _ = tiny_llama_dir
    prefill = LiveServer(folder, engine_options=BASE | {"role": "prefill",
                                                        "kv_pin_seconds": 2.0})
    try:
        first = complete(prefill.url, PROMPTS[0], kv_transfer_params={"do_remote_decode": True})
        num_blocks = len(first["kv_transfer_params"]["remote_block_ids"])
        kv = prefill.scheduler.kv
        assert kv.num_free_blocks <= kv.num_blocks - num_blocks   # pinned
        prefill.wait_idle(timeout_s=30)
        name = prefill.state.model_name
        assert prefill.metric(f'ember_kv_transfer_pins_released_total{{model_name="{name}",'
                              f'reason="expired"}}') == 1
        url = f"{prefill.url}/kv_transfer/{first['kv_transfer_params']['transfer_id']}"
        assert httpx.post(url + "/claim").status_code == 404
    finally:
        prefill.close()


def test_http_transport_matches_too(tiny_llama_dir):
    """Across hosts a decode replica streams the blocks from the prefill replica's server
    (forced here with kv_transport=http): same answer, bytes counted as http."""
    folder, _ = tiny_llama_dir
    servers = Trio(folder, CACHES["int8"], transport="http")
    try:
        for prompt in PROMPTS[:2]:
            _, text, _ = disaggregated(servers, prompt)
            assert text == complete(servers.single.url, prompt)["choices"][0]["text"]
        name = servers.decode.state.model_name
        assert servers.decode.metric(
            f'ember_kv_transfer_bytes_total{{model_name="{name}",transport="http"}}') > 0
        assert servers.decode.metric(
            f'ember_kv_transfer_bytes_total{{model_name="{name}",transport="shm"}}') == 0
        assert_all_free(servers.prefill, servers.decode)
    finally:
        servers.close()


@pytest.mark.slow
def test_compiled_copy_pulls_the_same_answer(tiny_llama_dir):
    """With the compiled kernels (every replica alike) the decode replica pulls over shared
    memory with kv_copy.cpp's copy: the same answer as one replica."""
    folder, _ = tiny_llama_dir
    servers = Trio(folder, CACHES["bfloat16"] | {"kernels": "auto"})
    try:
        assert servers.decode.engine.core.kernels is not None   # built, not the torch path
        for prompt in PROMPTS[:2]:
            _, text, _ = disaggregated(servers, prompt)
            assert text == complete(servers.single.url, prompt)["choices"][0]["text"]
        name = servers.decode.state.model_name
        assert servers.decode.metric(
            f'ember_kv_transfer_bytes_total{{model_name="{name}",transport="shm"}}') > 0
        assert_all_free(servers.prefill, servers.decode)
    finally:
        servers.close()


def test_client_gone_mid_pull_frees_both_sides(tiny_llama_dir):
    """The decode replica's client leaves while its blocks are being pulled: the request
    ends at once, but its blocks stay held until the pull stops writing them; then both
    replicas free everything (the prefill replica's pin is released)."""
    folder, _ = tiny_llama_dir
    servers = Trio(folder, CACHES["int8"], transport="http")
    try:
        leave_mid_pull(servers.prefill, servers.decode, PROMPTS[2])
    finally:
        servers.close()


def leave_mid_pull(prefill: LiveServer, decode: LiveServer, prompt: str) -> None:
    """Prefill `prompt`, then pull it into `decode` over HTTP with the prefill side's blocks
    held back, and leave (a client timeout): check the request ends at once while its blocks
    stay held, and that once the blocks flow both sides free everything."""
    gate = threading.Event()
    real_read = prefill.engine.kv_read

    def gated_read(transfer_id, block_ids):
        chunks = real_read(transfer_id, block_ids)
        if chunks is None:
            return None

        def held():
            gate.wait(30)
            yield from chunks
        return held()
    try:
        first = complete(prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
        prefill.engine.kv_read = gated_read
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(decode.url + "/v1/completions", timeout=1.0, json={
                "prompt": prompt, "kv_transfer_params": first["kv_transfer_params"]} | GREEDY)
        scheduler, kv = decode.scheduler, decode.scheduler.kv
        deadline = time.monotonic() + 30
        while scheduler.requests or not scheduler.loading:   # aborted, its copy still going
            assert time.monotonic() < deadline, "the request never ended while loading"
            time.sleep(0.01)
        assert kv.num_free_blocks < kv.num_blocks
        gate.set()
        assert_all_free(prefill, decode)
    finally:
        gate.set()
        prefill.engine.kv_read = real_read


def test_prefill_replica_killed_before_the_pull(tiny_llama_dir):
    """The prefill replica (a process) answers, then dies: the decode replica cannot reach
    it, computes the prompt itself (counted as unreachable), and the answer is still one
    replica's."""
    folder, _ = tiny_llama_dir
    port = free_port()
    proc = start_server(folder, port, "--role", "prefill", "--kernels", "torch", "--dtype",
                        "float32", "--max-model-len", "512")
    url = f"http://127.0.0.1:{port}"
    options = BASE | {"dtype": "float32"}
    single = LiveServer(folder, engine_options=options)
    decode = LiveServer(folder, engine_options=options | {"role": "decode"})
    try:
        wait_ready(proc, url)
        prompt = PROMPTS[1]
        first = complete(url, prompt, kv_transfer_params={"do_remote_decode": True})
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        rest = complete(decode.url, prompt, kv_transfer_params=first["kv_transfer_params"])
        assert first["choices"][0]["text"] + rest["choices"][0]["text"] == \
            complete(single.url, prompt)["choices"][0]["text"]
        name = decode.state.model_name
        assert decode.metric(f'ember_kv_transfer_fallbacks_total{{model_name="{name}",'
                             f'reason="unreachable"}}') == 1
        decode.wait_idle()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        single.close()
        decode.close()
