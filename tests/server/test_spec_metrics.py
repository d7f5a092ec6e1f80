"""Speculative decoding through the HTTP API: the output is the one without it, and /metrics
counts drafted and accepted tokens as the engine does (vllm:spec_decode_* names)."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import LiveServer

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 6 + [5, 6, 7]   # repeats: the n-gram proposer drafts


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    live = LiveServer(folder, engine_options={"max_model_len": 512, "speculative": "ngram",
                                              "ngram_min": 1})
    yield live
    live.close()


def test_spec_metrics_count_what_the_engine_verified(spec_server, server):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    got = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=60).json()
    want = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    spec_server.wait_idle()
    stats = spec_server.scheduler.spec_stats
    name = spec_server.engine.model_name
    assert stats.num_draft_tokens > 0
    for metric, value in (("num_drafts", stats.num_drafts),
                          ("num_draft_tokens", stats.num_draft_tokens),
                          ("num_accepted_tokens", stats.num_accepted_tokens)):
        assert spec_server.metric(f'vllm:spec_decode_{metric}_total{{model_name="{name}"}}') \
            == value
    rate = spec_server.metric(f'ember_spec_decode_acceptance_rate{{model_name="{name}"}}')
    assert rate == pytest.approx(stats.num_accepted_tokens / stats.num_draft_tokens)
