"""Speculative decoding beside LoRA adapters and sliding windows: greedy tokens identical with
speculation on and off, drafts verified (tiny random models in float32)."""
from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from ember.request import RequestOptions
from tests.conftest import save_tiny_model, tiny_hf_model
from tests.reference.test_lora import make_adapter
from tests.reference.test_spec_decode import REPEATING, VOCAB

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def pair(folder, **options) -> tuple[LLM, LLM]:
    common = dict(dtype="float32", num_blocks=256, block_size=4, **options)
    return LLM(str(folder), **common), LLM(str(folder), speculative="ngram", ngram_min=1,
                                           **common)


def tokens(llm: LLM, options: RequestOptions | None = None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(REPEATING, GREEDY, options)]


def test_drafts_verified_under_a_lora_adapter(tmp_path_factory, tokenizer_files):
    pytest.importorskip("peft")
    base = tiny_hf_model("llama", vocab_size=VOCAB, tie_word_embeddings=False)
    folder = save_tiny_model(tmp_path_factory.mktemp("spec_lora"), base, tokenizer_files)
    adapter = tmp_path_factory.mktemp("spec_lora_adapter")
    make_adapter(base, adapter, 8, 16, False, ["q_proj", "v_proj", "down_proj"], seed=0)
    off, on = pair(folder, loras=(("a", str(adapter)),))
    for options in (RequestOptions(lora="a"), None):
        assert tokens(off, options) == tokens(on, options)
    assert tokens(off, RequestOptions(lora="a")) != tokens(off)   # the adapter counts
    assert on.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_drafts_verified_under_a_sliding_window(tmp_path_factory, tokenizer_files):
    model = tiny_hf_model("mistral", vocab_size=VOCAB, tie_word_embeddings=False,
                          sliding_window=8)
    folder = save_tiny_model(tmp_path_factory.mktemp("spec_window"), model, tokenizer_files)
    off, on = pair(folder)
    assert on.engine.scheduler.kv.window == 8
    assert tokens(off) == tokens(on)
    assert on.engine.scheduler.spec_stats.num_accepted_tokens > 0
    kv = on.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks
