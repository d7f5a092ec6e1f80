"""Batching, chunked prefill and preemption never change greedy tokens.

Reference: the same prompts run one at a time, with a KV cache big enough and no chunking.
"""
from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from tests.conftest import CHAT_PROMPTS, first_mismatch

TINY_PROMPTS = [list(range(100 + 7 * i, 100 + 7 * i + n)) for i, n in
                enumerate([5, 37, 1, 60, 16, 17, 90, 3])]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run_alone(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    folder, _ = tiny_llama_dir
    # the plain torch path, one request at a time: the engines below run the compiled
    # kernels (the default) on batches, chunks and preemptions
    return run_alone(LLM(str(folder), dtype="float32", kernels="torch"), TINY_PROMPTS, GREEDY)


def assert_same(want: list[list[int]], got: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(want, got)):
        assert a == b, f"prompt {i} diverged at token {first_mismatch(a, b)}"


@pytest.mark.parametrize("options", [
    dict(),                                          # continuous batching of all prompts
    dict(max_num_batched_tokens=16),                 # chunked prefill
    dict(max_num_batched_tokens=3),                  # tiny chunks, decodes share the budget
    dict(max_num_batched_tokens=1),                  # one token per step
    dict(max_num_seqs=3),                            # a seat limit: requests queue and join
    dict(block_size=4, max_num_batched_tokens=7),    # chunks straddle block boundaries
], ids=["batch", "chunk16", "chunk3", "chunk1", "max-seqs-3", "block4-chunk7"])
def test_batching_and_chunking_keep_greedy_tokens(tiny_llama_dir, reference, options):
    folder, _ = tiny_llama_dir
    llm = LLM(str(folder), dtype="float32", **options)
    outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert_same(reference, [o.outputs[0].token_ids for o in outputs])
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.scheduler.kv.num_blocks


def test_preemption_keeps_greedy_tokens(tiny_llama_dir, reference):
    """A cache of 12 blocks x 16 tokens holds the longest request (110 tokens) but never all."""
    folder, _ = tiny_llama_dir
    llm = LLM(str(folder), dtype="float32", num_blocks=12, block_size=16)
    outputs = llm.generate(TINY_PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must actually preempt"
    assert_same(reference, [o.outputs[0].token_ids for o in outputs])
    assert llm.engine.scheduler.kv.num_free_blocks == 12


@pytest.mark.heavy   # by default test_same_answer.py batches, chunks and preempts SmolLM2
def test_smollm_batch_chunk_preempt_keep_greedy_tokens(smollm_path, smollm_llm):
    """The real model: all three features at once against each prompt alone."""
    prompts = [smollm_llm.chat_prompt([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = run_alone(smollm_llm, prompts, params)
    # 9 blocks x 16 = 144 tokens: fits any one request (<= 80 tokens), not all six at once
    llm = LLM(str(smollm_path), dtype="float32", num_blocks=9, max_num_batched_tokens=13)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(want, got)


def test_prefix_cache_never_changes_greedy_tokens(tiny_llama_dir):
    """Prompts sharing prefixes (and one repeated whole) run one by one, so later ones hit the
    cache, and batched; both equal the same prompts with the cache off."""
    folder, _ = tiny_llama_dir
    shared = list(range(300, 360))
    prompts = [shared + [7 * i, 7 * i + 1] for i in range(4)] + [shared, shared[:33], shared]
    off = LLM(str(folder), dtype="float32", enable_prefix_caching=False)
    want = run_alone(off, prompts, GREEDY)
    on = LLM(str(folder), dtype="float32", block_size=16)
    assert_same(want, run_alone(on, prompts, GREEDY))
    kv = on.engine.scheduler.kv
    # 16-token blocks, never the last token; past the whole blocks, the longest run of a
    # cached block's leading tokens. The first prompt caches [0, 48) and [48, 64) (its last
    # 14 prompt tokens, then 2 generated); the other 62-token prompts reuse 48 + 12 (they
    # differ at token 60), the 60-token prompt 48 + 11, the 33-token one 2 blocks:
    # 3 * 60 + 59 + 32 + 59
    assert kv.num_hit_tokens == 330
    batched = LLM(str(folder), dtype="float32", block_size=4, max_num_batched_tokens=24)
    assert_same(want, [o.outputs[0].token_ids for o in batched.generate(prompts, GREEDY)])
    assert batched.engine.scheduler.kv.num_hit_tokens > 0


def test_partial_block_copies_carry_int8_kv_scales(tiny_llama_dir):
    """int8 KV with the cache on equals int8 KV with it off: a copied slot is the same bytes
    and scales (prompts share 37 tokens, so every hit ends inside a 16-token block)."""
    folder, _ = tiny_llama_dir
    shared = list(range(400, 437))
    prompts = [shared + [11 * i + 3, 5] for i in range(3)]
    options = dict(dtype="float32", kv_cache_dtype="int8", block_size=16)
    want = run_alone(LLM(str(folder), enable_prefix_caching=False, **options), prompts, GREEDY)
    on = LLM(str(folder), **options)
    assert_same(want, run_alone(on, prompts, GREEDY))
    assert on.engine.scheduler.kv.num_hit_tokens == 2 * 37
