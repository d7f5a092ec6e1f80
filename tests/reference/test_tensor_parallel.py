"""Tensor parallel (ember/distributed/): one model over two local processes.

Reference: the same engine in one process (itself tested against transformers), float32 with
unpacked weights: the two-rank run's greedy tokens equal it and its logits are within 1e-4 at
the prefill and every decode step. The tiny models have 9 query heads over 3 KV heads, as
the default model has, so KV head 1 (query heads 3-5) is on both ranks (0-1 and 1-2), each
request attending it on one of them.
The default model's int4 run follows the closeness rule (STYLE.md): its row-parallel sums
round in another order. A worker that dies or hangs makes the engine fail (EngineDead).
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ember
from ember import LLM, EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine, EngineState
from ember.engine.core import EngineCore
from ember.errors import ConfigError, EngineDead
from tests.conftest import assert_greedy_close, first_mismatch, save_tiny_model, tiny_hf_model
from tests.reference.test_llama_vs_hf import PROMPTS, ember_greedy_logits
from tests.reference.test_variants_vs_hf import tiny_variant

NUM_STEPS = 8
UNEVEN = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
OPTIONS = dict(dtype="float32", quantization="none", kv_cache_gib=0.05)
DEADLINE_S = 120   # a failure must surface well within this (a hang would never)

CASES = {
    "llama": lambda: tiny_hf_model("llama", tie_word_embeddings=False, **UNEVEN),
    "qwen2-bias-tied": lambda: tiny_hf_model("qwen2", tie_word_embeddings=True, **UNEVEN),
    "mixtral": lambda: tiny_variant("Mixtral", num_local_experts=4, num_experts_per_tok=2,
                                    **UNEVEN),
    "gemma2-softcap": lambda: tiny_variant("Gemma2", sliding_window=8,
                                           attn_logit_softcapping=2.0,
                                           final_logit_softcapping=3.0, **UNEVEN),
}


@pytest.fixture(scope="module", params=[  # softcapped Gemma 2 on -m heavy
    pytest.param(c, marks=pytest.mark.heavy) if c == "gemma2-softcap" else c for c in CASES])
def tiny_folder(request, tmp_path_factory, tokenizer_files):
    model = CASES[request.param]()
    return save_tiny_model(tmp_path_factory.mktemp(request.param), model, tokenizer_files)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer_files):
    model = CASES["llama"]()
    return save_tiny_model(tmp_path_factory.mktemp("tp-llama"), model, tokenizer_files)


def assert_same_steps(one: EngineCore, split: EngineCore, num_steps: int = NUM_STEPS) -> None:
    """`split` (the model over ranks, in any layout) against one process, prompt by prompt
    and step by step: the same greedy tokens, and logits within 1e-4."""
    for prompt in PROMPTS:
        want_tokens, want = ember_greedy_logits(one, prompt, num_steps)
        tokens, logits = ember_greedy_logits(split, prompt, num_steps)
        assert tokens == want_tokens, f"diverged at {first_mismatch(want_tokens, tokens)}"
        for step, (got, ref) in enumerate(zip(logits, want)):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0,
                                       msg=lambda m, step=step: f"step {step}: {m}")


def test_two_ranks_match_one_process_step_by_step(tiny_folder):
    one = EngineCore(EngineConfig.from_options(model=str(tiny_folder), **OPTIONS))
    two = EngineCore(EngineConfig.from_options(model=str(tiny_folder), tensor_parallel_size=2,
                                               **OPTIONS))
    try:
        assert_same_steps(one, two)
    finally:
        two.close()


def test_two_ranks_of_whole_groups_match_one_process(llama_folder):
    """kv_head_split "groups": 6 + 3 query heads and 2 + 1 KV heads, none on both ranks."""
    one = EngineCore(EngineConfig.from_options(model=str(llama_folder), **OPTIONS))
    two = EngineCore(EngineConfig.from_options(model=str(llama_folder), tensor_parallel_size=2,
                                               kv_head_split="groups", **OPTIONS))
    try:
        assert [s.q_heads for s in two.rank_setup.shards] == [(0, 6), (6, 9)]
        assert_same_steps(one, two)
    finally:
        two.close()


def test_two_ranks_batched_chunked_and_cached_match_one_process(llama_folder):
    """Every prompt at once in steps of 16 tokens (chunked prompts beside decodes), then
    again from the prefix cache: the same greedy tokens as one process."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    options = dict(OPTIONS, max_num_batched_tokens=16)
    want = LLM(str(llama_folder), **options).generate(PROMPTS, params)
    llm = LLM(str(llama_folder), tensor_parallel_size=2, **options)
    try:
        for _ in range(2):   # the second run reads the prompts' blocks from the cache
            for ref, out in zip(want, llm.generate(PROMPTS, params)):
                a, b = ref.outputs[0].token_ids, out.outputs[0].token_ids
                assert a == b, f"diverged at {first_mismatch(a, b)}"
    finally:
        llm.close()


def test_big_plain_greedy_steps_take_the_ranks_best_tokens_not_their_logits(llama_folder):
    """Steps of 8 or more plain greedy rows get each rank's best token and logit (8 bytes a
    row, where the logits are 4 per vocabulary row; GatheredHead.argmax) instead of the
    gathered logits: the same tokens as the same requests asking for logprobs, whose steps
    gather the logits whole (and match one process: the tests above)."""
    prompts = [[1, 500 + i, 77, 9000, 31][:2 + i % 4] for i in range(10)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    llm = LLM(str(llama_folder), tensor_parallel_size=2, **OPTIONS)
    head, rows = llm.engine.runner.model.lm_head, []
    argmax = head.argmax
    head.argmax = lambda hidden: rows.append(len(hidden)) or argmax(hidden)
    try:
        best = llm.generate(prompts, params)
        assert rows and min(rows) >= 8 and sum(rows) >= len(prompts) * 11, rows
        taken = len(rows)
        gathered = llm.generate(prompts, with_logprobs)
        assert len(rows) == taken
    finally:
        llm.close()
    for a, b in zip(best, gathered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.slow
@pytest.mark.heavy   # a minute of CPU
def test_default_model_int4_on_two_ranks_is_close_to_one_process():
    """The shipped int4 model with bfloat16 prompt matmuls: one process and two ranks give
    the same greedy tokens, or the closeness rule holds (int8 ones:
    tests/reference/test_parallel_int8.py)."""
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    ref = LLM(prefill_matmul="bfloat16", kv_cache_gib=0.1).generate(prompts, params)
    llm = LLM(tensor_parallel_size=2, prefill_matmul="bfloat16", kv_cache_gib=0.1)
    try:
        assert_greedy_close(ref, llm.generate(prompts, params))
    finally:
        llm.close()


def _generate_with_deadline(llm: LLM) -> BaseException | None:
    """llm.generate's exception, from a thread given DEADLINE_S to end (None: none)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4))
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(DEADLINE_S)
    assert outcome, f"generate neither failed nor ended within {DEADLINE_S} s"
    return outcome[0]


def test_a_killed_worker_rank_ends_the_engine(llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, **OPTIONS)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2))
        worker = llm.engine.executor.workers[0]
        worker.kill()
        worker.wait()
        assert isinstance(_generate_with_deadline(llm), EngineDead)
    finally:
        llm.close()


def test_a_hung_worker_rank_ends_the_engine_after_the_collective_timeout(llama_folder):
    llm = LLM(str(llama_folder), tensor_parallel_size=2, collective_timeout_s=2, **OPTIONS)
    worker = llm.engine.executor.workers[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        assert isinstance(_generate_with_deadline(llm), EngineDead)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.close()


def test_an_idle_engine_dies_with_its_worker(llama_folder):
    """No request needs to run: the idle engine notices, and liveness turns false."""
    engine = AsyncEngine(EngineConfig.from_options(model=str(llama_folder),
                                                   tensor_parallel_size=2, **OPTIONS))
    engine.start()
    asyncio.run(engine.wait_ready())
    try:
        assert engine.ready
        engine.core.executor.workers[0].kill()
        engine._thread.join(DEADLINE_S)   # the engine thread ends once it has noticed
        assert engine.state is EngineState.DEAD and not engine.ready
        assert isinstance(engine.error, EngineDead)
    finally:
        engine.shutdown()


# an engine whose process is killed while idle, after a step: prints its worker's pid
KILLED_DRIVER = """
import os, signal, sys
from ember import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", quantization="none",
          kv_cache_gib=0.05)
llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2))
executor = llm.engine.executor
print(executor.workers[0].pid, executor.steps.kind, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _exited(pid: int) -> bool:
    """Whether process `pid` has ended (gone, or a zombie no one has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_killed_driver_ends_its_idle_worker(llama_folder):
    """The worker waits for its next step with no time limit (an idle engine is not a
    failed one), yet ends once its driver is gone; the plans went over shared memory."""
    root = str(Path(ember.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    driver = subprocess.Popen([sys.executable, "-c", KILLED_DRIVER, str(llama_folder)],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid, kind = driver.stdout.readline().split()
        assert driver.wait(DEADLINE_S) == -signal.SIGKILL
        assert kind == "shm"
        deadline = time.monotonic() + DEADLINE_S
        while not _exited(int(pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _exited(int(pid)), f"the worker still runs {DEADLINE_S} s after its driver died"
    finally:
        driver.kill()
        driver.stdout.close()


def test_more_ranks_than_query_heads_fail_at_start_naming_them(llama_folder):
    with pytest.raises(ConfigError, match="tensor_parallel_size=10 exceeds the model's 9 "
                                          "query heads"):
        EngineCore(EngineConfig.from_options(model=str(llama_folder), tensor_parallel_size=10,
                                             **OPTIONS))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="the OS binds no threads")
def test_one_process_cpu_bind_pins_the_engine_until_it_closes(llama_folder):
    """cpu_bind at one rank binds the engine's own process (there are no workers to bind):
    every thread on those CPUs, as many torch threads, given back at close."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    cpu = min(before[0])
    engine = EngineCore(EngineConfig.from_options(model=str(llama_folder), cpu_bind=str(cpu),
                                                  **OPTIONS))
    try:
        assert os.sched_getaffinity(0) == {cpu}
        assert torch.get_num_threads() == 1
        threads = [int(t) for t in os.listdir("/proc/self/task")]
        assert all(os.sched_getaffinity(t) == {cpu} for t in threads)
    finally:
        engine.close()
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before


def test_one_process_cpu_bind_outside_this_process_cpus_fails_naming_them(llama_folder):
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=f"names CPUs \\[{outside}\\]"):
        EngineCore(EngineConfig.from_options(model=str(llama_folder), cpu_bind=str(outside),
                                             **OPTIONS))
