"""Expert parallel (ember/distributed/parallel.py): a mixture's experts shared out whole over
two local processes, attention and the rest tensor-parallel as before.

Reference: the same engine in one process (itself tested against transformers), float32 with
unpacked weights: the two-rank run's greedy tokens equal it and its logits are within 1e-4 at
the prefill and every decode step. The tiny models have 9 query heads over 3 KV heads (uneven
attention parts, as in test_tensor_parallel.py), 4 experts top-2 (2 + 2 per rank), or 3
experts (2 + 1); Qwen2-MoE's shared expert is column/row-sliced beside them. Packed int8 and
int4 experts follow one process by the closeness rule (STYLE.md): their attention sums round
in another order. Bad layouts fail at start, naming the numbers.
"""
from __future__ import annotations

import logging
import re

import pytest

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.core import EngineCore
from ember.errors import ConfigError
from ember.weights.gguf import GGUFFile
from tests.conftest import assert_greedy_close, save_tiny_model
from tests.reference.test_llama_vs_hf import PROMPTS
from tests.reference.test_tensor_parallel import assert_same_steps
from tests.reference.test_variants_gguf import write_variant_gguf
from tests.reference.test_variants_vs_hf import tiny_variant

NUM_STEPS = 8
UNEVEN = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)
OPTIONS = dict(dtype="float32", quantization="none", kv_cache_gib=0.05)
QWEN2_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)

CASES = {   # name: (model, each rank's experts as the start-up log gives them)
    "mixtral": (lambda: tiny_variant("Mixtral", num_local_experts=4, num_experts_per_tok=2,
                                     **UNEVEN), ("0-1", "2-3")),
    "qwen2moe-shared": (lambda: tiny_variant("Qwen2Moe", mlp_only_layers=[1], **QWEN2_MOE,
                                             **UNEVEN), ("0-1", "2-3")),
    "mixtral-3-experts": (lambda: tiny_variant("Mixtral", num_local_experts=3,
                                               num_experts_per_tok=2, **UNEVEN), ("0-1", "2")),
}


@pytest.fixture(scope="module", params=list(CASES))
def moe_case(request, tmp_path_factory, tokenizer_files):
    make, spans = CASES[request.param]
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), make(), tokenizer_files)
    return folder, spans


@pytest.fixture(scope="module")
def three_experts(tmp_path_factory, tokenizer_files):
    make, _ = CASES["mixtral-3-experts"]
    return save_tiny_model(tmp_path_factory.mktemp("ep-3"), make(), tokenizer_files)


def assert_two_ranks_match_one_process(model: str, options: dict,
                                       **layout: object) -> EngineCore:
    """One process and two expert-parallel ranks (per stage of `layout`) step by step: the
    same greedy tokens and logits within 1e-4 (the parallel engine comes back, closed)."""
    one = EngineCore(EngineConfig.from_options(model=model, **options))
    two = EngineCore(EngineConfig.from_options(model=model, tensor_parallel_size=2,
                                               expert_parallel=True, **layout, **options))
    try:
        assert_same_steps(one, two)
    finally:
        two.close()
    return two


def test_expert_parallel_matches_one_process_step_by_step(moe_case, caplog):
    folder, spans = moe_case
    with caplog.at_level(logging.INFO, logger="ember.engine.tensor_parallel"):
        two = assert_two_ranks_match_one_process(str(folder), OPTIONS)
    # the driver (rank 0) holds its experts only, whole; the log says who holds which
    moe = two.runner.model.model.layers[0].mlp
    assert (moe.first_expert, len(moe.experts), moe.num_experts) == \
        (0, 2, moe.gate.weight.shape[0])
    assert moe.experts[0].down_proj.weight.shape[1] == two.model_config.moe_intermediate_size
    for rank, span in enumerate(spans):
        assert re.search(f"rank {rank}: [^;]*, experts {span}, vocabulary", caplog.text)


@pytest.mark.heavy   # four processes; the stage split is tested at T=2 alone
def test_expert_parallel_within_pipeline_stages_matches_one_process(tmp_path,
                                                                    tokenizer_files):
    """T=2 x P=2: each stage shares out its own layers' experts (stage 0: layers 0-1, the
    second dense; stage 1: layer 2)."""
    model = tiny_variant("Qwen2Moe", mlp_only_layers=[1], num_hidden_layers=3, **QWEN2_MOE,
                         **UNEVEN)
    folder = save_tiny_model(tmp_path, model, tokenizer_files)
    assert_two_ranks_match_one_process(str(folder), OPTIONS, pipeline_parallel_size=2,
                                       oversubscribe=True)


@pytest.mark.heavy   # a GGUF rank's slice is checked in tests/unit/test_expert_parallel_plan.py
def test_expert_parallel_from_a_gguf_file_matches_one_process(tmp_path, smollm_path):
    """The experts stacked in one GGUF tensor per projection: each rank dequantizes only its
    own (tests/unit/test_expert_parallel_plan.py checks the slicing of packed blocks)."""
    model = tiny_variant("Qwen2Moe", mlp_only_layers=[], **QWEN2_MOE, **UNEVEN)
    path = tmp_path / "tiny-qwen2moe.gguf"
    write_variant_gguf(path, model, "qwen2moe", GGUFFile(smollm_path).metadata)  # its vocab
    assert_two_ranks_match_one_process(str(path), OPTIONS)


@pytest.mark.parametrize("quantization", [pytest.param("int8", marks=pytest.mark.heavy),
                                          "int4"])
def test_packed_experts_on_two_ranks_are_close_to_one_process(quantization, tmp_path,
                                                              tokenizer_files):
    """Each rank packs its own experts after loading, as one process packs them all."""
    model = tiny_variant("Qwen2Moe", hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64,
                         shared_expert_intermediate_size=64, mlp_only_layers=[1])
    folder = str(save_tiny_model(tmp_path, model, tokenizer_files))
    options = dict(dtype="bfloat16", quantization=quantization, kv_cache_gib=0.05,
                   prefill_matmul="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    ref = LLM(folder, **options).generate(PROMPTS, params)
    llm = LLM(folder, tensor_parallel_size=2, expert_parallel=True, **options)
    try:
        assert_greedy_close(ref, llm.generate(PROMPTS, params))
    finally:
        llm.close()


def test_more_ranks_than_experts_fail_at_start_naming_both(three_experts):
    with pytest.raises(ConfigError, match="expert_parallel over tensor_parallel_size=4 ranks "
                                          "needs an expert per rank, and the model has 3 "
                                          "experts; use tensor_parallel_size=3 or less"):
        EngineCore(EngineConfig.from_options(model=str(three_experts), tensor_parallel_size=4,
                                             expert_parallel=True, **OPTIONS))


def test_a_dense_model_or_one_rank_fails_at_start_saying_what_to_use(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    with pytest.raises(ConfigError, match="LlamaForCausalLM is a dense model \\(0 experts\\); "
                                          "drop expert_parallel"):
        EngineCore(EngineConfig.from_options(model=str(folder), tensor_parallel_size=2,
                                             expert_parallel=True, **OPTIONS))
    with pytest.raises(ConfigError, match="tensor_parallel_size=1 is one rank; use "
                                          "tensor_parallel_size=2 or more"):
        LLM(str(folder), expert_parallel=True, **OPTIONS)
