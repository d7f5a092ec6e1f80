"""Tensor parallel with the whole-model decode stack (ember/kernels/cpu/decode_stack.cpp):
each rank's stack holds its heads and MLP columns and all-reduces the o and down
projections' partial sums itself, through the shared-memory all-reduce.

Reference: the same two ranks over gloo, where steps run layer by layer with the same int4
kernels and the all-reduce adds the same partials in the same rank order, rounding once: so
greedy tokens and logprobs are the same bit for bit, at 1 row (the stack's one parallel
region) and at 11 (its region per op; deterministic, so that the layers' decode rows stay on
the int4 kernels at any count, as the stack's do).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from ember import LLM, SamplingParams
from ember.models.parallel import HeadShare
from ember.request import SHARE_KEYS, RequestOptions, share_key
from tests.conftest import first_mismatch, save_tiny_model, tiny_hf_model

# head_dim 64 (the stack's), 3 KV heads: KV head 1 on both ranks (query heads 0-3 and 2-5,
# each request attending it on one), every rank's projection inputs whole int4 groups of 32
STACKABLE = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
                 intermediate_size=256)
OPTIONS = dict(dtype="bfloat16", quantization="int4", kv_cache_gib=0.05,
               tensor_parallel_size=2, deterministic=True)
PARAMS = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
COLD = RequestOptions(prefix_cache=False)


@pytest.fixture(scope="module")
def stackable_folder(tmp_path_factory, tokenizer_files):
    model = tiny_hf_model("llama", tie_word_embeddings=False, **STACKABLE)
    return save_tiny_model(tmp_path_factory.mktemp("tp-stack"), model, tokenizer_files)


def has_stack_kernels(llm: LLM) -> bool:
    kernels = llm.engine.kernels
    return kernels is not None and kernels.has_bf16_dot


def run(folder, all_reduce: str, prompts: list[list[int]]) -> tuple[list, bool]:
    """(outputs of each prompt set, whether the driver decoded in the stack), the engine
    closed."""
    llm = LLM(str(folder), all_reduce=all_reduce, **OPTIONS)
    try:
        if not has_stack_kernels(llm):
            pytest.skip("the decode stack needs AVX-512 BF16")
        stacked = llm.engine.runner.model.decode_stack is not None
        assert llm.engine.executor.steps.kind == all_reduce   # the plans go the same way
        return [llm.generate(p, PARAMS, COLD) for p in prompts], stacked
    finally:
        llm.close()


def assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        a, b = w.outputs[0], g.outputs[0]
        assert a.token_ids == b.token_ids, f"diverged at {first_mismatch(a.token_ids, b.token_ids)}"
        assert a.logprobs == b.logprobs


def test_stack_on_two_ranks_equals_their_layers(stackable_folder):
    one = [[[1, 504, 3458, 282, 4649, 314]]]
    many = [[[1, 504 + i, 3458, 282] * (1 + i % 4) for i in range(11)]]
    stack, stacked = run(stackable_folder, "shm", one + many)
    layers, layered = run(stackable_folder, "gloo", one + many)
    assert stacked and not layered
    for got, want in zip(stack, layers):
        assert_same(got, want)


def test_an_answer_on_two_ranks_sharing_a_kv_head_does_not_depend_on_its_batch(
        stackable_folder):
    """KV head 1 is on both ranks and each request attends it on the one its prompt picks:
    eleven prompts, some on each rank, answered alone and together, give the same tokens
    and logprobs, bit for bit (a rank chosen by the batch would round o's partial sums in
    another rank's and change them)."""
    prompts = [[1, 504 + i, 3458, 282] * (1 + i % 4) for i in range(11)]
    share = HeadShare(rank=0, world_size=2, kv_first=0, kv_count=2, num_kv_heads=3,
                      keys=SHARE_KEYS)   # rank 0's: KV heads 0-1 of 3
    assert len({share.skip_bits(share_key(p)) for p in prompts}) == 2   # both ranks attend
    outputs, stacked = run(stackable_folder, "shm", [[p] for p in prompts] + [prompts])
    assert stacked
    assert_same(outputs[-1], [alone[0] for alone in outputs[:-1]])


def test_stack_on_two_ranks_adds_adapters_as_their_layers(stackable_folder, tmp_path):
    """A batch mixing the base model and an adapter on every projection: each rank's stack
    adds its part of the adapter before the all-reduce, as its layers do; the same greedy
    tokens and logits, bit for bit."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from ember import EngineConfig
    from ember.engine.core import EngineCore
    from tests.reference.test_lora import ALL_TARGETS, make_adapter, run_greedy
    base = AutoModelForCausalLM.from_pretrained(stackable_folder)
    make_adapter(base, tmp_path / "a", 8, 16, False, ALL_TARGETS, 0)
    jobs = [(None, [1, 500, 77, 9000]), ("a", [1, 500, 77, 9000]), ("a", [300, 301, 302])]
    runs = {}
    for kind in ("shm", "gloo"):
        engine = EngineCore(EngineConfig.from_options(model=str(stackable_folder),
                                                      loras=(("a", tmp_path / "a"),),
                                                      all_reduce=kind, **OPTIONS))
        try:
            model, with_adapters = engine.runner.model, []
            if kind == "shm":
                if model.decode_stack is None:
                    pytest.skip("the decode stack needs AVX-512 BF16")
                model.decode_stack = counting_adapters(model.decode_stack, with_adapters)
            runs[kind] = run_greedy(engine, jobs, 8)
            assert kind == "gloo" or (with_adapters and all(with_adapters)), with_adapters
        finally:
            engine.close()
    for (tokens, logits), (want_tokens, want_logits) in zip(runs["shm"], runs["gloo"]):
        assert tokens == want_tokens
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))


def counting_adapters(stack, calls: list[bool]) -> SimpleNamespace:
    """`stack`, its forward noting in `calls` whether each step had adapters."""
    def forward(*args):
        calls.append(len(args[-1]) > 0)
        return stack.forward(*args)
    return SimpleNamespace(forward=forward, forward_mixed=stack.forward_mixed)


@pytest.mark.parametrize("rows", [1, 11])
def test_a_peer_gone_in_the_stacks_all_reduce_raises(stackable_folder, rows):
    """A peer that left while the stack waits in its all-reduce makes the step raise with
    the all-reduce's reason (at 1 row from inside the stack's one parallel region, at 11
    from its op-by-op path on the int8 weights), in this one process standing for rank 0 of
    two whose rank 1 has closed its end. Prompt steps run layer by layer meanwhile (no
    int8_decode), so the first all-reduce is a decode step's in the stack."""
    llm = LLM(str(stackable_folder), dtype="bfloat16", quantization="int4", kv_cache_gib=0.05)
    model, kernels = llm.engine.runner.model, llm.engine.kernels
    if model.decode_stack is None:
        pytest.skip("the decode stack needs AVX-512 BF16")
    name = f"/ember-test-{os.getpid()}-{rows}"
    mine = kernels.shm_all_reduce(name, 0, 2, 4096, True)
    theirs = kernels.shm_all_reduce(name, 1, 2, 4096, False)
    kernels.shm_unlink(name)
    theirs.close()
    model.decode_stack.use_all_reduce(mine, 5.0, 0.0)
    model.int8_decode = False
    prompts = [[1, 504 + i, 3458] for i in range(rows)]
    with pytest.raises(Exception, match="closed its all-reduce"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3))


@pytest.mark.slow
@pytest.mark.heavy   # the default model on two ranks, twice
def test_default_model_stack_on_two_ranks_equals_their_layers():
    """The shipped int4 model at T=2: the stack (shared memory) and the layers (gloo) give
    the same greedy tokens over 32 steps."""
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    outputs = {}
    for kind in ("shm", "gloo"):
        llm = LLM(tensor_parallel_size=2, kv_cache_gib=0.1, all_reduce=kind)
        try:
            if kind == "shm" and llm.engine.runner.model.decode_stack is None:
                pytest.skip("the decode stack needs AVX-512 BF16 and int4 weights")
            outputs[kind] = llm.generate(prompts, PARAMS, COLD)
        finally:
            llm.close()
    assert_same(outputs["shm"], outputs["gloo"])
