"""Speculative decoding on a model split over processes: a draft model (whole, in the
driver's process, beside the target's split) and n-gram drafts, with the target tensor- or
pipeline-parallel.

Reference: the target in one process without speculation, float32: greedy tokens identical,
drafts made and some accepted (a vocabulary of 32 ids makes a random model repeat itself),
and every block back in the pool once the requests end.
"""
from __future__ import annotations

import pytest

from ember import LLM
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
