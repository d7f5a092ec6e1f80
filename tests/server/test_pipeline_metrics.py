"""The pipeline bubble as served: `ember_pipeline_bubble_ratio` on /metrics of a server whose
model runs in two pipeline stages. Reference: the schedule's idle share, (P-1)/(M+P-1) for a
forward of M micro-batches (docs/parallel.md): one request alone is one micro-batch, so
every forward idles a stage half the time; a batch of several fills the pipeline better."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer

BUBBLE = "ember_pipeline_bubble_ratio"


def bubble(server: LiveServer) -> float:
    """The gauge's one sample (it carries the model's name as a label)."""
    text = httpx.get(server.url + "/metrics").text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == BUBBLE]
    [sample] = family.samples
    return sample.value


@pytest.fixture(scope="module")
def staged(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    server = LiveServer(folder, {"quantization": "none", "pipeline_parallel_size": 2,
                                         "oversubscribe": True})
    yield server
    server.close()
    server.engine.core.close()


def test_the_bubble_gauge_reports_the_schedules_idle_share(staged):
    body = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(staged.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert bubble(staged) == 0.5      # every forward so far: one micro-batch of 2 stages
    batch = dict(body, prompt=[f"Prompt number {i}" for i in range(4)])
    r = httpx.post(staged.url + "/v1/completions", json=batch, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert 1 / 3 <= bubble(staged) < 0.5   # forwards of 2 micro-batches: 1/3 each

