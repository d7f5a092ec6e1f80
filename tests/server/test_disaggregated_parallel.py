"""Disaggregated serving between replicas whose models are split over ranks (tensor parallel):
each rank's cache holds only its KV heads, and the prefill group's blocks move into the
decode group's ranks, whatever the two groups' sizes. The reference is one ordinary
one-process replica answering the same request, in float32 with unpacked weights (where
two ranks' logits are within 1e-4 of one process's: tests/reference/test_tensor_parallel.py):
greedy text and usage must match. The tiny model has 9 query heads over 3 KV heads, as the
default model has, so two ranks hold KV heads 0-1 and 1-2 (head 1 copied from either).
Afterwards every block of every replica is free again: the prefill group's pins are the
driver's, whose block ids are every rank's."""
from __future__ import annotations


import httpx
import pytest

from ember import EngineConfig
from ember.errors import ConfigError
from tests.conftest import save_tiny_model, tiny_hf_model
from tests.server.conftest import LiveServer
from tests.server.test_disaggregated import (PROMPTS, assert_all_free, complete,
                                             leave_mid_pull)

UNEVEN = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
# float32, unpacked weights, the torch kernels; every group's ranks may share this host's
# cores (one test process holds several groups)
BASE = {"max_model_len": 512, "kernels": "torch", "num_blocks": 128, "dtype": "float32",
        "quantization": "none", "oversubscribe": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tokenizer_files):
    model = tiny_hf_model("llama", tie_word_embeddings=False, **UNEVEN)
    return save_tiny_model(tmp_path_factory.mktemp("disagg-tp"), model, tokenizer_files)


class Fleet:
    """One ordinary replica (the reference) and prefill and decode replicas of one and two
    ranks; closed last made first (each group gives back the CPUs it bound)."""

    def __init__(self, folder) -> None:
        self.servers: dict[str, LiveServer] = {}
        self.add("single", folder)
        for size in (1, 2):
            self.add(f"prefill{size}", folder, role="prefill", tensor_parallel_size=size)
            self.add(f"decode{size}", folder, role="decode", tensor_parallel_size=size)
        self.add("decode2-http", folder, role="decode", tensor_parallel_size=2,
                 kv_transport="http")
        # two pipeline stages, a layer each (the decode group's pulls over HTTP)
        self.add("prefill-p2", folder, role="prefill", pipeline_parallel_size=2)
        self.add("decode-p2", folder, role="decode", pipeline_parallel_size=2,
                 kv_transport="http")

    def add(self, name: str, folder, **options) -> None:
        self.servers[name] = LiveServer(folder, engine_options=BASE | options)

    def __getitem__(self, name: str) -> LiveServer:
        return self.servers[name]

    def close(self) -> None:
        for server in reversed(list(self.servers.values())):
            server.close()


@pytest.fixture(scope="module")
def fleet(folder):
    servers = Fleet(folder)
    yield servers
    servers.close()


def through(prefill: LiveServer, decode: LiveServer, prompt: str) -> tuple[str, dict]:
    """The whole text through the two replicas, and the decode answer's usage."""
    first = complete(prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert params is not None and first["usage"]["completion_tokens"] == 1
    rest = complete(decode.url, prompt, kv_transfer_params=params)
    return first["choices"][0]["text"] + rest["choices"][0]["text"], rest["usage"]


def layout(server: LiveServer) -> str:
    parallel = server.engine.config.parallel
    return f"T={parallel.tensor_parallel_size} P={parallel.pipeline_parallel_size}"


def metric(server: LiveServer, name: str, **labels: str) -> float:
    fields = {"model_name": server.state.model_name} | labels
    return server.metric(name + "{" + ",".join(f'{k}="{v}"' for k, v in fields.items()) + "}")


@pytest.mark.parametrize("prefill,decode,transport", [
    ("prefill2", "decode2", "shm"), ("prefill2", "decode2-http", "http"),
    ("prefill2", "decode1", "shm"), ("prefill1", "decode2", "shm"),
    ("prefill-p2", "decode2", "shm"), ("prefill2", "decode-p2", "http")])
def test_groups_of_any_size_answer_as_one_replica(fleet, prefill, decode, transport):
    """Two ranks to two (shared memory and HTTP), two to one and one to two, two stages to
    two tensor-parallel ranks and back: every rank's layers and heads land where the decode
    group holds them."""
    prefill, decode = fleet[prefill], fleet[decode]
    loads = metric(decode, "ember_kv_transfer_loads_total")
    moved = metric(decode, "ember_kv_transfer_bytes_total", transport=transport)
    for prompt in PROMPTS:
        prompt = f"{prompt} ({transport}, {layout(prefill)} -> {layout(decode)})"   # (new)
        want = complete(fleet["single"].url, prompt)
        text, usage = through(prefill, decode, prompt)
        assert text == want["choices"][0]["text"]
        assert usage["completion_tokens"] == want["usage"]["completion_tokens"]
    assert metric(decode, "ember_kv_transfer_loads_total") == loads + len(PROMPTS)
    assert metric(decode, "ember_kv_transfer_bytes_total", transport=transport) > moved
    assert metric(decode, "ember_kv_transfer_fallbacks_total", reason="incompatible") == 0
    assert_all_free(prefill, decode)


def test_a_released_pin_makes_the_two_rank_group_compute_the_prompt(fleet):
    """The pin is gone when the decode group claims it: the decode group computes the
    prompt itself on its two ranks (counted), with the same answer; nothing stays pinned."""
    prefill, decode = fleet["prefill2"], fleet["decode2"]
    prompt = "Release this pin before the two-rank pull, then decode anyway"
    first = complete(prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    params = first["kv_transfer_params"]
    assert httpx.delete(f"{prefill.url}/kv_transfer/{params['transfer_id']}").status_code == 200
    before = metric(decode, "ember_kv_transfer_fallbacks_total", reason="expired")
    rest = complete(decode.url, prompt, kv_transfer_params=params)
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == \
        complete(fleet["single"].url, prompt)["choices"][0]["text"]
    assert metric(decode, "ember_kv_transfer_fallbacks_total", reason="expired") == before + 1
    assert metric(prefill, "ember_kv_transfer_pinned_blocks") == 0
    assert_all_free(prefill, decode)


def test_a_two_rank_prefill_group_gone_before_the_pull(folder, fleet):
    """The prefill group (both ranks) stops after its answer: the decode group cannot
    reach it, computes the prompt itself (counted as unreachable), and answers as one
    replica does."""
    prefill = LiveServer(folder, engine_options=BASE | {"role": "prefill",
                                                        "tensor_parallel_size": 2})
    decode = fleet["decode2"]
    prompt = PROMPTS[1] + " (its prefill group stops)"
    try:
        first = complete(prefill.url, prompt, kv_transfer_params={"do_remote_decode": True})
    finally:
        prefill.close()
    before = metric(decode, "ember_kv_transfer_fallbacks_total", reason="unreachable")
    rest = complete(decode.url, prompt, kv_transfer_params=first["kv_transfer_params"])
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == \
        complete(fleet["single"].url, prompt)["choices"][0]["text"]
    assert metric(decode, "ember_kv_transfer_fallbacks_total", reason="unreachable") == \
        before + 1
    assert_all_free(decode)


def test_roles_over_ray_ranks_are_refused_naming_the_fix():
    """The driver maps each rank's cache: ranks elsewhere (Ray) cannot be mapped."""
    with pytest.raises(ConfigError, match="--distributed-executor mp"):
        EngineConfig.from_options(role="decode", tensor_parallel_size=2,
                                  distributed_executor="ray")
    EngineConfig.from_options(role="decode", tensor_parallel_size=2)   # (mp: fine)


@pytest.mark.slow
@pytest.mark.heavy   # three two-rank replicas of the shipped model: a minute or more of CPU
def test_default_model_two_rank_groups_answer_as_a_two_rank_replica(smollm_path):
    """The shipped int4 model (its own KV cache dtype, the compiled kernels): a two-rank
    prefill group's KV, moved bit for bit into a two-rank decode group, gives the greedy
    tokens of one ordinary two-rank replica (itself within the closeness rule of one
    process: tests/reference/test_tensor_parallel.py)."""
    options = {"max_model_len": 512, "kv_cache_gib": 0.1, "tensor_parallel_size": 2,
               "oversubscribe": True}
    servers = [LiveServer(smollm_path, engine_options=options | extra)
               for extra in ({}, {"role": "prefill"}, {"role": "decode"})]
    try:
        single, prefill, decode = servers
        for prompt in ("What is the capital of France? Answer in one sentence.",
                       "Write a haiku about the sea, then explain it."):
            text, usage = through(prefill, decode, prompt)
            assert text == complete(single.url, prompt)["choices"][0]["text"]
        assert metric(decode, "ember_kv_transfer_loads_total") == 2
        assert_all_free(prefill, decode)
    finally:
        for server in reversed(servers):
            server.close()


def test_client_gone_mid_pull_holds_the_two_rank_slots_until_the_pull_ends(fleet):
    """The decode group's client leaves while its blocks stream in (HTTP, held back here):
    the request ends at once, but its slots, which the pull writes on both ranks, stay held
    until the pull stops; then both groups free everything."""
    leave_mid_pull(fleet["prefill2"], fleet["decode2-http"],
                   PROMPTS[2] + " (its client leaves mid-pull)")
