"""LoRA adapters on a model split over processes: tensor parallel (each rank's A and B cut
like its base weights) and pipeline parallel (each stage its layers' factors).

Reference: the same engine in one process with the same adapters (itself checked against
peft in test_lora.py), float32 with unpacked weights: the split run's greedy tokens equal it
and its logits are within 1e-4 at every step, for a batch mixing the base model and two
adapters, one given at start and one loaded at run time, and again after an adapter is
unloaded and another file loaded under its name (the ranks drop the old one and take the
new one with the next step). The tiny Llama has 9 query heads over 3 KV heads and 3 layers,
so KV head 1 is on both ranks (query heads 0-5 and 3-8; layers 0-1 and 2). T=2 x P=2 runs four ranks
on this machine's cores with oversubscribe.
"""
from __future__ import annotations

import pytest
import torch

from ember import EngineConfig
from ember.engine.core import EngineCore
from tests.conftest import first_mismatch, save_tiny_model, tiny_hf_model
from tests.reference.test_lora import ALL_TARGETS, make_adapter, run_greedy

pytest.importorskip("peft")

UNEVEN = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16,
              num_hidden_layers=3, tie_word_embeddings=False)
OPTIONS = dict(dtype="float32", quantization="none", kv_cache_gib=0.05)
# (rank, alpha, rsLoRA, targets); "c" is loaded under the name "b" once "b" is unloaded
ADAPTERS = {"a": (8, 16, False, ALL_TARGETS),
            "b": (4, 8, True, ["q_proj", "v_proj", "o_proj", "down_proj"]),
            "c": (6, 12, False, ["k_proj", "gate_proj", "up_proj", "o_proj"])}
PROMPTS = [[1, 500, 77, 9000, 31, 2024, 17], list(range(1000, 1029)), [300, 301, 302]]
JOBS = [(None, PROMPTS[0]), ("a", PROMPTS[1]), ("b", PROMPTS[2]), ("a", PROMPTS[0]),
        ("b", PROMPTS[1])]
NUM_STEPS = 5
LAYOUTS = {"T=2": dict(tensor_parallel_size=2),
           "P=2": dict(pipeline_parallel_size=2),
           "T=2xP=2": dict(tensor_parallel_size=2, pipeline_parallel_size=2, oversubscribe=True)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_files):
    """(model folder, adapter folders by name, the one-process engine serving every one)."""
    base = tiny_hf_model("llama", **UNEVEN)
    folder = save_tiny_model(tmp_path_factory.mktemp("parallel_lora"), base, tokenizer_files)
    paths = {}
    for seed, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = tmp_path_factory.mktemp(f"parallel_lora_{name}")
        make_adapter(base, paths[name], rank, alpha, rslora, targets, seed)
    one = EngineCore(EngineConfig.from_options(model=str(folder), loras=tuple(paths.items()),
                                               **OPTIONS))
    return folder, paths, one


def assert_same_runs(one: EngineCore, split: EngineCore, jobs: list, names: dict) -> list:
    """`jobs` run as one batch on both engines (adapter names on `split` mapped to `one`'s
    by `names`): the same greedy tokens, logits within 1e-4; each job's tokens."""
    want = run_greedy(one, [(names.get(lora, lora), p) for lora, p in jobs], NUM_STEPS)
    got = run_greedy(split, jobs, NUM_STEPS)
    for job, (want_tokens, want_logits), (tokens, logits) in zip(jobs, want, got):
        assert tokens == want_tokens, f"{job[0]}: diverged at {first_mismatch(want_tokens, tokens)}"
        torch.testing.assert_close(torch.stack(logits), torch.stack(want_logits), atol=1e-4,
                                   rtol=0, msg=lambda m, job=job: f"{job[0]}: {m}")
    return [tokens for tokens, _ in got]


@pytest.mark.parametrize("layout", ["T=2", "P=2",
                                    pytest.param("T=2xP=2", marks=pytest.mark.heavy)])
def test_split_model_with_adapters_matches_one_process(setup, layout):
    folder, paths, one = setup
    split = EngineCore(EngineConfig.from_options(model=str(folder), loras=(("a", paths["a"]),),
                                                 **LAYOUTS[layout], **OPTIONS))
    try:
        split.loras.add("b", paths["b"])          # at run time, as the load endpoint does
        tokens = assert_same_runs(one, split, JOBS, {})
        assert tokens[0] != tokens[3]   # the adapter changes the base model's answer
        # another file under a name in use before: every rank drops the old part
        split.loras.remove("b")
        split.loras.add("b", paths["c"])
        assert_same_runs(one, split, JOBS, {"b": "c"})
        assert len(split.runner.rank_loras) == 2   # "a" and the new "b"
    finally:
        split.close()
