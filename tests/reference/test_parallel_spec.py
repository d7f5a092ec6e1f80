"""Speculative decoding on a model split over processes: a draft model (whole, in the
driver's process, beside the target's split) and n-gram drafts, with the target tensor- or
pipeline-parallel, and the self-draft (the target's first layers, split as they are).

Reference: the target in one process without speculation, float32: greedy tokens identical,
drafts made and some accepted (a vocabulary of 32 ids makes a random model repeat itself),
and every block back in the pool once the requests end; a split self-draft drafts what it
drafts in one process (the same acceptance counts). The default model's self-draft
over two ranks follows one process's by the closeness rule.
"""
from __future__ import annotations

import pytest

from ember import LLM, SamplingParams
from tests.conftest import assert_greedy_close
from tests.reference.test_spec_decode import REPEATING, outputs
from tests.reference.test_spec_proposers import COMMON, GREEDY, models  # noqa: F401 - fixture

CASES = {"T=2 draft": (dict(tensor_parallel_size=2), "draft"),
         "P=2 ngram": (dict(pipeline_parallel_size=2), "ngram"),
         "P=2 draft": (dict(pipeline_parallel_size=2), "draft")}


# ngram at P=2 drafts as at P=1 (no model); P=2 with a draft model covers stages that verify
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c == "P=2 ngram"
                                  else c for c in CASES])
def test_split_target_with_speculation_matches_one_process_without(models, case):  # noqa: F811
    target, _, draft = models
    layout, proposer = CASES[case]
    want = outputs(LLM(str(target), **COMMON), REPEATING, GREEDY)
    spec = f"draft:{draft}" if proposer == "draft" else "ngram"
    llm = LLM(str(target), speculative=spec, ngram_min=1, min_acceptance=0.0, **layout,
              **COMMON)
    try:
        got = outputs(llm, REPEATING, GREEDY)
        assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got]
        stats = llm.engine.scheduler.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
        kv = llm.engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.close()


SELF_CASES = {"T=2": dict(tensor_parallel_size=2),
              # over gloo the draft runs layer by layer (over shared memory the decode stack
              # all-reduces itself, where there is one)
              "T=2 gloo": dict(tensor_parallel_size=2, all_reduce="gloo"),
              # 3 of 4 layers: one stage runs all its layers, the other one and the LM head
              "P=2": dict(pipeline_parallel_size=2),
              # 1 of 4: the second stage runs none, only the final norm and the LM head
              "P=2 one layer": dict(pipeline_parallel_size=2, self_draft_layers=1),
              "T=2 x P=2": dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                oversubscribe=True)}


@pytest.mark.parametrize("case", [c if c in ("T=2", "P=2 one layer")
                                  else pytest.param(c, marks=pytest.mark.heavy)
                                  for c in SELF_CASES])
def test_self_draft_over_ranks_drafts_as_one_process(models, case):  # noqa: F811
    """The self-draft's layers split over ranks as the target's are, its logits gathered on
    the driver (or sent from the last stage): the same greedy tokens as one process without
    speculation and with it, and the same drafts accepted as one process's (every draft is
    the same token)."""
    target = str(models[0])
    layout = dict(SELF_CASES[case])
    options = dict(speculative="self", self_draft_layers=layout.pop("self_draft_layers", 3),
                   min_acceptance=0.0, quantization="none", **COMMON)
    want = outputs(LLM(target, quantization="none", **COMMON), REPEATING, GREEDY)
    alone = LLM(target, **options)
    alone_tokens = outputs(alone, REPEATING, GREEDY)
    llm = LLM(target, **layout, **options)
    try:
        got = outputs(llm, REPEATING, GREEDY)
        assert [w[0].token_ids for w in want] == [g[0].token_ids for g in got] == \
            [a[0].token_ids for a in alone_tokens]
        stats, ref = llm.engine.scheduler.spec_stats, alone.engine.scheduler.spec_stats
        assert ref.num_draft_tokens > ref.num_accepted_tokens > 0
        assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == \
            (ref.num_drafts, ref.num_draft_tokens, ref.num_accepted_tokens)
        kv = llm.engine.scheduler.kv
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.heavy   # a minute of CPU: the tiny model above checks the split self-draft
def test_default_model_self_draft_over_two_ranks_is_close_to_one_process():
    """The shipped int4 model drafting with its first layers: one process (with the prompt
    matmuls two ranks run, bfloat16) and two ranks give the same greedy tokens, or the
    closeness rule holds, and both accept drafts."""
    prompts = ["Once upon a time", "The three primary colours are"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    options = dict(speculative="self", min_acceptance=0.0, kv_cache_gib=0.05)
    alone = LLM(prefill_matmul="bfloat16", **options)
    ref = alone.generate(prompts, params)
    llm = LLM(tensor_parallel_size=2, **options)
    try:
        assert_greedy_close(ref, llm.generate(prompts, params))
        for engine in (alone.engine, llm.engine):
            assert engine.scheduler.spec_stats.num_accepted_tokens > 0
    finally:
        llm.close()
