"""`ember serve --simulate`: the real server over a core with no model. References: the
model's own tokenizer (usage counts), ember's block hash of its token ids (/kv/events), and,
in the slow test, a real replica of the default model."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import httpx
import openai
import pytest

from ember.cli import main
from ember.kv.prefix_cache import extend_keys
from ember.config import EngineConfig
from ember.plan.replica import PacedRunner, SimulatedCore
from ember.plan.simulate import SimRunner, TokenSource
from ember.plan.stepmodel import ServingOverhead, StepModel, step_shape
from ember.tokenizer.chat import ChatTemplate
from tests.plan.conftest import STEP_MODEL, SimulatedServer
from tests.plan.test_stepmodel import _request, _scheduler
from tests.server.conftest import TEST_KV_GIB, LiveServer
from tests.waiting import wait_for

PROMPT = ("The quick brown fox jumps over the lazy dog, and then it runs far away into the "
          "deep green forest where nobody can find it again, not even the hunters. ") * 2
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def sim(profile):
    server = SimulatedServer(profile)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(sim):
    return openai.OpenAI(base_url=sim.url + "/v1", api_key="unused", max_retries=0)


def chat_ids(tokenizer) -> list[int]:
    template = ChatTemplate.of(tokenizer)
    return tokenizer.encode(template.render(MESSAGES, True), add_special_tokens=False)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_report_the_real_tokenizers_counts(client, smollm_tokenizer, stream):
    want_prompt = len(smollm_tokenizer.encode(PROMPT))
    if not stream:
        out = client.completions.create(model=None, prompt=PROMPT, max_tokens=7)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want_prompt, 7)
        assert out.choices[0].finish_reason == "length" and out.choices[0].text
        return
    chunks = list(client.completions.create(model=None, prompt=PROMPT, max_tokens=7,
                                            stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == 7   # one step, one visible token
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (want_prompt, 7)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reports_the_templates_token_count(client, smollm_tokenizer, stream):
    want_prompt = len(chat_ids(smollm_tokenizer))
    if not stream:
        out = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=5)
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (want_prompt, 5)
        assert out.choices[0].message.content
        return
    chunks = list(client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=5,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == \
        (want_prompt, 5)


def stored_keys(url: str) -> set[int]:
    events = httpx.get(url + "/kv/events").json()["events"]
    return {e["block_hash"] for e in events if e["type"] == "stored" and e["num_tokens"] == 16}


def test_kv_events_hold_the_prompts_block_keys(sim, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT + " once more")
    httpx.post(sim.url + "/v1/completions", json={"prompt": PROMPT + " once more",
                                                  "max_tokens": 2}).raise_for_status()
    keys = extend_keys([], ids, 16)
    assert len(keys) >= 4 and set(keys) <= stored_keys(sim.url)
    again = httpx.post(sim.url + "/v1/completions", json={"prompt": PROMPT + " once more",
                                                          "max_tokens": 2}).json()
    # every prompt token but the last (recomputed to sample), the partial tail block too
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1


def test_a_full_queue_answers_429_and_metrics_show_the_load(profile):
    """One seat, one waiting place, slow steps: the first request runs, the second waits,
    the third is refused, as a real replica refuses it; /metrics shows 1 running, 1 waiting."""
    slow = replace(profile, step_model=StepModel((0.2, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0), 0.2))
    server = SimulatedServer(slow, engine_options={"max_num_seqs": 1}, max_waiting=1)
    try:
        body = {"prompt": "hello there", "max_tokens": 12}
        threads = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                    kwargs={"json": body, "timeout": 60}) for _ in range(2)]
        threads[0].start()
        wait_for(lambda: server.metric('vllm:num_requests_running{model_name="'
                                       f'{slow.model_name}"}}') == 1)
        threads[1].start()
        wait_for(lambda: server.metric('vllm:num_requests_waiting{model_name="'
                                       f'{slow.model_name}"}}') == 1)
        refused = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert refused.status_code == 429 and "Retry-After" in refused.headers
        for t in threads:
            t.join(60)
    finally:
        server.close()



def test_what_it_cannot_simulate_is_refused(client, sim):
    with pytest.raises(openai.BadRequestError, match="simulated replica"):
        client.embeddings.create(model=None, input=["hi"])
    with pytest.raises(openai.BadRequestError, match="simulated replica"):
        client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=3,
                                       response_format={"type": "json_object"})
    assert httpx.get(sim.url + "/health/ready").status_code == 200   # and it goes on


def test_the_paced_runner_waits_out_the_predicted_step():
    """The step returns when the predicted time has passed since it began: the runner's own
    work counts toward it, and a step that took longer does not wait at all."""
    now = [10.0]
    slept: list[float] = []
    runner = SimRunner(STEP_MODEL, TokenSource(range(100), seed=0))
    paced = PacedRunner(runner, clock=lambda: now[0], sleep=slept.append)
    sched = _scheduler(budget=64)
    sched.add(_request("a", 40, 2))
    plan = sched.schedule()
    out = paced.execute(plan)
    assert slept == [pytest.approx(STEP_MODEL.predict(step_shape(plan)))]
    assert list(out.sampled_token_ids) == ["a"]
    clock = iter([0.0, 5.0])   # the drawing took 5 s: longer than the step
    PacedRunner(runner, clock=lambda: next(clock), sleep=slept.append).execute(plan)
    assert len(slept) == 1


def test_a_simulated_replica_waits_out_the_serving_overhead_too(profile):
    """`ember serve --simulate` with a profile that measured serving: a step streaming one
    token waits the step model's time plus per_step + per_token."""
    serving = ServingOverhead(2e-3, 5e-4, measured=True)
    core = SimulatedCore(EngineConfig.from_options(model=profile.model_path,
                                                   kv_cache_gib=TEST_KV_GIB),
                         replace(profile, serving=serving))
    now, slept = [0.0], []
    paced = PacedRunner(core.runner.runner, clock=lambda: now[0], sleep=slept.append)
    sched = _scheduler(budget=64)
    sched.add(_request("a", 40, 2))
    plan = sched.schedule()
    paced.execute(plan)
    assert slept == [pytest.approx(STEP_MODEL.predict(step_shape(plan)) + 2e-3 + 5e-4)]


def test_serve_refuses_a_model_other_than_the_profiles(tmp_path, profile, capsys):
    path = tmp_path / "profile.json"
    profile.save(path)
    assert main(["serve", "--simulate", str(path), "--model", "other.gguf"]) == 2
    assert "leave out --model" in capsys.readouterr().err
    assert main(["serve", "--simulate", str(tmp_path / "missing.json")]) == 2
    assert "ember plan profile" in capsys.readouterr().err


@pytest.mark.slow
def test_block_keys_and_usage_equal_a_real_replicas(sim, smollm_path):
    """The default model served for real, and simulated: the same prompt (a completion and
    a chat) gives the same usage counts and the same stored block keys."""
    real = LiveServer(smollm_path)   # (float32: the keys do not depend on it)
    try:
        # prompts no other test of the module sent: the simulated replica lives on
        fresh = [{"role": "system", "content": "[k] You answer."},
                 {"role": "user", "content": PROMPT}]
        for path, body in (("/v1/completions", {"prompt": "[c] " + PROMPT}),
                           ("/v1/chat/completions", {"messages": fresh})):
            body = body | {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
            before = {url: stored_keys(url) for url in (real.url, sim.url)}
            answers = [httpx.post(url + path, json=body, timeout=120).json()
                       for url in (real.url, sim.url)]
            assert answers[0]["usage"] == answers[1]["usage"]
            # a finished request's blocks are logged as it is freed, after its answer
            deadline = time.monotonic() + 30
            while True:
                new = [stored_keys(url) - before[url] for url in (real.url, sim.url)]
                if (new[0] == new[1] and len(new[0]) >= 4) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert new[0] == new[1] and len(new[0]) >= 4
    finally:
        real.close()

