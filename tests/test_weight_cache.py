"""The weight cache (ember/weights/cache.py): an engine started from it runs the very model a
full load built (same greedy tokens, same logprobs, bit for bit), and a cache that is stale or
broken is passed over and written again."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ember.config import PREFILL_MATMULS
from ember.engine.llm import LLM
from ember.request import SamplingParams
from ember.weights.cache import CHOICES, META, TENSORS, SUMMARIES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]
# long enough for a prompt chunk of more than 8 rows: the int8 prompt matmuls run
LONG = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    outputs = llm.generate([*PROMPTS, LONG], params)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs])
            for o in outputs]


def cached_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir()
                  if not p.name.startswith(".") and p.name not in (SUMMARIES, CHOICES))


def assert_same_tokenizer(a: LLM, b: LLM) -> None:
    """A second start (from a GGUF's summary) has the same tokenizer and architecture."""
    text = [*PROMPTS, LONG, "<|im_start|>user\nhi ü 😀<|im_end|>"]
    assert [b.tokenizer.encode(t) for t in text] == [a.tokenizer.encode(t) for t in text]
    assert (b.tokenizer.bos_token, b.tokenizer.eos_token, b.tokenizer.eos_token_ids,
            b.tokenizer.chat_template) == (a.tokenizer.bos_token, a.tokenizer.eos_token,
                                           a.tokenizer.eos_token_ids, a.tokenizer.chat_template)
    assert b.engine.model_config == a.engine.model_config


def start(model: str | None, root: Path, **options: object) -> LLM:
    return LLM(model, weight_cache_dir=str(root), max_num_batched_tokens=64, kv_cache_gib=0.05,
               **options)


def same_choice(first: LLM) -> dict[str, str]:
    """The prefill matmuls `first` ran, asked for by name: `auto` measures again where the
    first load's machine was busy, and a measured switch would be another cache."""
    chosen = first.engine.prefill_matmul
    return {"prefill_matmul": chosen} if chosen in PREFILL_MATMULS else {}


TINY_OPTIONS = {
    "packed": dict(dtype="bfloat16", quantization="int4"),   # packed + calibrated int8
    "int8": dict(dtype="bfloat16", quantization="int8", prefill_matmul="bfloat16"),
    "dense": dict(dtype="float32", quantization="none"),
}


@pytest.mark.parametrize("kind", list(TINY_OPTIONS))
def test_an_engine_from_the_cache_matches_a_full_load(tiny_llama_dir, tmp_path, kind):
    folder, _ = tiny_llama_dir
    first = start(str(folder), tmp_path, **TINY_OPTIONS[kind])
    assert not first.engine.weights_cached
    [cache] = cached_folders(tmp_path)
    assert (cache / TENSORS).is_file() and (cache / META).is_file()
    second = start(str(folder), tmp_path, **(TINY_OPTIONS[kind] | same_choice(first)))
    assert second.engine.weights_cached
    assert run(second) == run(first)
    assert not (tmp_path / "files").exists()   # a folder's files are summarized by nothing
    assert_same_tokenizer(first, second)


def test_other_options_do_not_share_a_cache(tiny_llama_dir, tmp_path):
    folder, _ = tiny_llama_dir
    start(str(folder), tmp_path, **TINY_OPTIONS["dense"])
    other = start(str(folder), tmp_path, dtype="bfloat16", quantization="none")
    assert not other.engine.weights_cached
    assert len(cached_folders(tmp_path)) == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage", "metadata"])
def test_a_broken_cache_is_ignored_and_rebuilt(tiny_llama_dir, tmp_path, damage):
    folder, _ = tiny_llama_dir
    options = TINY_OPTIONS["packed"]
    reference = run(start(str(folder), tmp_path, **options))
    [cache] = cached_folders(tmp_path)
    tensors = cache / TENSORS
    if damage == "truncate":
        tensors.write_bytes(tensors.read_bytes()[:1000])
    elif damage == "garbage":
        tensors.write_bytes(b"\xff" * tensors.stat().st_size)
    else:   # the metadata names a tensor the file does not hold
        meta = json.loads((cache / META).read_text())
        meta["kinds"]["model.no_such.weight"] = "buffer"
        (cache / META).write_text(json.dumps(meta))
    rebuilt = start(str(folder), tmp_path, **options)
    assert not rebuilt.engine.weights_cached
    assert run(rebuilt) == reference
    again = start(str(folder), tmp_path, **options)   # and the rewritten cache serves
    assert again.engine.weights_cached
    assert run(again) == reference


def test_a_changed_model_file_misses_the_cache(tiny_llama_dir, tmp_path):
    import shutil
    folder, _ = tiny_llama_dir
    copy = Path(shutil.copytree(folder, tmp_path / "model"))
    start(str(copy), tmp_path / "cache", **TINY_OPTIONS["dense"])
    weights = next(copy.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())   # a new modification time
    again = start(str(copy), tmp_path / "cache", **TINY_OPTIONS["dense"])
    assert not again.engine.weights_cached


@pytest.mark.slow   # two full loads of the default model (~1.5 min on 2 busy cores)
def test_the_default_model_from_the_cache_matches_a_full_load(tmp_path):
    first = start(None, tmp_path)
    second = start(None, tmp_path, **same_choice(first))
    assert (first.engine.weights_cached, second.engine.weights_cached) == (False, True)
    assert run(second) == run(first)
    assert len(list((tmp_path / "files").glob("*.json"))) == 1   # the GGUF's summary
    assert_same_tokenizer(first, second)


def test_prune_keeps_the_newest_caches_of_models_that_still_exist(tmp_path):
    import os

    from ember.weights.cache import prune
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    root = tmp_path / "cache"
    for i, source in enumerate([model, model, model, tmp_path / "gone.gguf"]):
        folder = root / f"key{i}"
        folder.mkdir(parents=True)
        (folder / META).write_text(json.dumps({"model_path": str(source)}))
        os.utime(folder, (1000 + i, 1000 + i))
    partial = root / ".partial-x"
    partial.mkdir()
    os.utime(partial, (0, 0))
    removed = prune(root, keep=2, now=10_000)
    assert sorted(p.name for p in removed) == [".partial-x", "key0", "key3"]
    assert sorted(p.name for p in root.iterdir()) == ["key1", "key2"]


def test_serve_caches_under_xdg_cache_home_unless_told_not_to(tmp_path, monkeypatch):
    from ember.cli import build_parser, engine_config
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    on = engine_config(build_parser().parse_args(["serve"]))
    off = engine_config(build_parser().parse_args(["serve", "--no-weight-cache"]))
    assert (on.weight_cache_dir, off.weight_cache_dir) == \
        (str(tmp_path / "ember" / "weights"), None)
