"""The embeddings workload: its requests (seeded, texts on their token targets) and the load
generator's figures against a fake /v1/embeddings whose answer times are scripted on a fake
clock, so inputs/s can be checked exactly."""
from __future__ import annotations

import asyncio
import json
import random
from contextlib import asynccontextmanager

import pytest

from ember.bench.client import LoadConfig, Runner
from ember.bench.metrics import summarize
from ember.bench.report import table
from ember.bench.workloads import (LengthDist, PromptMaker, default_corpus, embedding_batches,
                                   local_tokenizer)
from tests.bench.test_client import FakeClock


class Answer:
    def __init__(self, status: int, body: dict) -> None:
        self.status, self._body = status, body

    async def text(self) -> str:
        return json.dumps(self._body)

    def chunks(self):
        raise AssertionError("an embeddings answer is read whole, not streamed")


class FakeEmbeddings:
    """Answers each request `seconds` after it is sent, with one vector per input, or with
    the scripted status."""

    def __init__(self, clock: FakeClock, seconds: list[float], statuses: dict[int, int]
                 ) -> None:
        self.clock, self.seconds, self.statuses = clock, seconds, statuses
        self.bodies: list[dict] = []
        self.urls: list[str] = []

    @asynccontextmanager
    async def post(self, url: str, body: dict):
        self.urls.append(url)
        self.bodies.append(body)
        k = len(self.bodies) - 1
        self.clock.now += self.seconds[k]
        if k in self.statuses:
            yield Answer(self.statuses[k], {"error": {"message": "busy"}})
            return
        data = [{"object": "embedding", "index": i, "embedding": [0.6, 0.8]}
                for i in range(len(body["input"]))]
        yield Answer(200, {"object": "list", "data": data,
                           "usage": {"prompt_tokens": 5 * len(data), "total_tokens": 0}})


def test_inputs_per_second_from_scripted_answers(smollm_path):
    encode, decode = local_tokenizer(str(smollm_path))
    maker = PromptMaker(default_corpus(), encode, decode, random.Random(0))
    requests = embedding_batches(maker, 4, 3, LengthDist.parse("fixed:20"), random.Random(0))
    assert all(len(r.inputs) == 3 for r in requests)
    assert all(abs(len(encode(t)) - 20) <= 2 for r in requests for t in r.inputs)
    clock = FakeClock()
    server = FakeEmbeddings(clock, [0.5, 0.25, 0.25, 1.0], statuses={3: 429})
    config = LoadConfig(base_url="http://fake/v1", model="m", endpoint="embeddings",
                        concurrency=1)
    records = asyncio.run(Runner(config, clock=clock, post=server.post).run(requests))
    assert server.urls[0] == "http://fake/v1/embeddings"
    assert server.bodies[0] == {"input": requests[0].inputs, "model": "m"}
    summary = summarize(records)
    assert summary["completed"] == 3 and summary["errors"] == {"http_429": 1}
    assert summary["duration_s"] == pytest.approx(2.0)
    assert summary["embedded_inputs"] == 9
    assert summary["inputs_per_s"] == pytest.approx(9 / 2.0)
    assert summary["prompt_tokens"] == 45 and summary["output_tokens"] == 0
    assert summary["e2e_s"]["max"] == pytest.approx(0.5)
    assert "4.5 inputs/s" in table(summary)


def test_same_seed_same_embedding_requests(smollm_path):
    encode, decode = local_tokenizer(str(smollm_path))

    def build(seed: int) -> list[list[str]]:
        maker = PromptMaker(default_corpus(), encode, decode, random.Random(seed))
        return [r.inputs for r in embedding_batches(maker, 3, 2, LengthDist.parse(
            "uniform:5,30"), random.Random(seed))]
    assert build(1) == build(1) != build(2)
