"""Pipeline parallel (ember/distributed/): one model's layers over two stages of processes,
alone and with tensor parallel inside each stage.

Reference: the same engine in one process (itself tested against transformers), float32 with
unpacked weights: the staged run's greedy tokens equal it and its logits are within 1e-4 at
the prefill and every decode step. The tiny models have 3 layers, so the stages hold uneven
parts (layers 0-1 and 2); the layer kinds that depend on a layer's index (Gemma 2's sliding
layers, Qwen2-MoE's dense MLP layers) sit on both sides of the cut. T=2 x P=2 runs four ranks
on this machine's cores with oversubscribe.
"""
from __future__ import annotations

import pytest
import torch

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.core import EngineCore
from ember.errors import ConfigError
from ember.request import PoolingParams
from tests.conftest import first_mismatch, save_tiny_model, tiny_hf_model
from tests.reference.test_llama_vs_hf import PROMPTS
from tests.reference.test_tensor_parallel import assert_same_steps
from tests.reference.test_variants_vs_hf import tiny_variant

NUM_STEPS = 6
UNEVEN = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
              num_hidden_layers=3)
OPTIONS = dict(dtype="float32", quantization="none", kv_cache_gib=0.05)

CASES = {
    "llama": lambda: tiny_hf_model("llama", tie_word_embeddings=False, **UNEVEN),
    "qwen2-bias-tied": lambda: tiny_hf_model("qwen2", tie_word_embeddings=True, **UNEVEN),
    "gemma2-softcap": lambda: tiny_variant("Gemma2", sliding_window=8,
                                           attn_logit_softcapping=2.0,
                                           final_logit_softcapping=3.0, **UNEVEN),
    "qwen2moe-dense-last": lambda: tiny_variant("Qwen2Moe", num_experts=4,
                                                num_experts_per_tok=2,
                                                moe_intermediate_size=32,
                                                shared_expert_intermediate_size=48,
                                                mlp_only_layers=[2], **UNEVEN),
}
LAYOUTS = {"P=2": dict(pipeline_parallel_size=2),
           "T=2xP=2": dict(pipeline_parallel_size=2, tensor_parallel_size=2,
                           oversubscribe=True)}


@pytest.fixture(scope="module", params=[  # every case on -m heavy (tensor parallel runs them)
    pytest.param(c, marks=pytest.mark.heavy) if c in ("qwen2-bias-tied", "gemma2-softcap")
    else c for c in CASES])
def tiny_folder(request, tmp_path_factory, tokenizer_files):
    model = CASES[request.param]()
    return save_tiny_model(tmp_path_factory.mktemp(request.param), model, tokenizer_files)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer_files):
    return save_tiny_model(tmp_path_factory.mktemp("pp-llama"), CASES["llama"](),
                           tokenizer_files)


def test_two_stages_match_one_process_step_by_step(tiny_folder):
    one = EngineCore(EngineConfig.from_options(model=str(tiny_folder), **OPTIONS))
    staged = EngineCore(EngineConfig.from_options(model=str(tiny_folder),
                                                  pipeline_parallel_size=2, **OPTIONS))
    try:
        # the driver's stage holds and caches layers 0-1, and no output projection
        assert len(staged.runner.model.model.layers) == len(staged.runner.kv_caches) == 2
        assert not any(name.startswith("lm_head.")
                       for name, _ in staged.runner.model.named_parameters())
        assert staged.executor.steps.kind == "shm"   # the plans' own segment: one host
        assert_same_steps(one, staged, NUM_STEPS)
    finally:
        staged.close()


@pytest.mark.slow
def test_tensor_parallel_stages_match_one_process_step_by_step(llama_folder):
    """T=2 x P=2: four ranks, each a stage's layers cut to its heads."""
    one = EngineCore(EngineConfig.from_options(model=str(llama_folder), **OPTIONS))
    staged = EngineCore(EngineConfig.from_options(model=str(llama_folder),
                                                  **LAYOUTS["T=2xP=2"], **OPTIONS))
    try:
        assert_same_steps(one, staged, NUM_STEPS)
    finally:
        staged.close()


@pytest.mark.parametrize("layout", ["P=2", pytest.param("T=2xP=2", marks=pytest.mark.heavy)])
def test_stages_batched_and_chunked_match_one_process(llama_folder, layout):
    """Every prompt at once in steps of 16 tokens (chunked prompts beside decodes), then
    again from the prefix cache: the same greedy tokens as one process. The steps' requests
    go through the stages as two micro-batches (P of them), so a stage idled less than the
    (P-1)/P of one micro-batch at a time, and no less than (P-1)/(M+P-1)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    options = dict(OPTIONS, max_num_batched_tokens=16)
    want = LLM(str(llama_folder), **options).generate(PROMPTS, params)
    llm = LLM(str(llama_folder), **LAYOUTS[layout], **options)
    try:
        for _ in range(2):   # the second run reads the prompts' blocks from the cache
            for ref, out in zip(want, llm.generate(PROMPTS, params)):
                a, b = ref.outputs[0].token_ids, out.outputs[0].token_ids
                assert a == b, f"diverged at {first_mismatch(a, b)}"
        assert 1 / 3 <= llm.engine.runner.bubble.share < 1 / 2
    finally:
        llm.close()


@pytest.mark.parametrize("layout", ["P=2", "T=2"])
def test_split_models_embed_as_one_process(llama_folder, layout):
    """Embeddings at P=2 (the last stage's final hidden states pooled on the driver) and
    T=2: each method, in chunks of 16 tokens beside a generating request, gives one
    process's vectors; and `--task embed` starts at P=2."""
    prompts = [list(range(5, 45)), [3, 4, 5], list(range(1000, 1033))]
    options = dict(OPTIONS, max_num_batched_tokens=16)
    split = dict(pipeline_parallel_size=2) if layout == "P=2" else dict(tensor_parallel_size=2)
    one = LLM(str(llama_folder), **options)
    staged = LLM(str(llama_folder), **split, **options)
    try:
        for method in ("last", "mean", "cls"):
            want = one.embed(prompts, PoolingParams(method))
            staged.engine.add_request("beside", list(range(60, 80)),
                                      SamplingParams(temperature=0, max_tokens=4))
            got = staged.embed(prompts, PoolingParams(method))
            for w, g in zip(want, got, strict=True):
                torch.testing.assert_close(torch.tensor(g.embedding),
                                           torch.tensor(w.embedding), atol=1e-5, rtol=0)
            while staged.engine.has_unfinished():
                staged.engine.step()
    finally:
        staged.close()
    if layout != "P=2":
        return
    embedder = LLM(str(llama_folder), pipeline_parallel_size=2, task="embed", **options)
    try:
        torch.testing.assert_close(torch.tensor(embedder.embed(prompts[:1])[0].embedding),
                                   torch.tensor(one.embed(prompts[:1])[0].embedding),
                                   atol=1e-5, rtol=0)
    finally:
        embedder.close()


def test_more_stages_than_layers_fail_at_start_naming_them(llama_folder):
    with pytest.raises(ConfigError, match="pipeline_parallel_size=4 exceeds the model's 3 "
                                          "layers"):
        EngineCore(EngineConfig.from_options(model=str(llama_folder), pipeline_parallel_size=4,
                                             oversubscribe=True, **OPTIONS))
