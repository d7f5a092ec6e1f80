"""SentencePiece vocabularies in GGUF files (tokenizer.ggml.model "llama").

The vocabulary is made here: `tokenizers`' SentencePiece-style BPE trainer on the shipped
corpus and a few languages, written as llama.cpp lays such a vocabulary out (<unk>, <s>, </s>,
the 256 byte pieces, then the pieces with scores falling in merge order, plus a control and a
user-defined token). Reference: transformers reading the same GGUF file, over multilingual and
code-heavy texts.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFWriter

from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf_metadata import read_gguf_metadata
from tests.conftest import SHAKESPEARE

TRAIN = ["Le cœur a ses raisons que la raison ne connaît point.",
         "Über allen Gipfeln ist Ruh, in allen Wipfeln spürest du kaum einen Hauch.",
         "Все счастливые семьи похожи друг на друга.", "学而时习之，不亦说乎。",
         "def main(argv: list[str]) -> int:\n    return 0\n", '{"key": [1, 2, 3]}']
TEXTS = [
    "Hello world", " leading space", "two  spaces and\ttabs\n\nnew lines ",
    "Où est la bibliothèque ? Très bien, merci.", "Grüße aus München — straße",
    "Привет, как дела?", "東京は日本の首都です。漢字とかなカナ", "مرحبا بالعالم", "emoji 🎉👍🏽 ok",
    "def f(x):\n    if x > 0:\n        return x ** 2\n    return -x  # neg\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }", '{"a": [1, 2.5e-3, null], "b": "c"}',
    "<|im_start|>user\nhi<|im_end|>", "call <tool_call> now", "    indented\n\tand tabbed",
    "ÿ þ ß ĳ Ω ≈ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "",
]
CONTROL_TOKEN, USER_TOKEN = "<|im_start|>", "<tool_call>"


def train_pieces(vocab_size: int) -> list[str]:
    from tokenizers import SentencePieceBPETokenizer
    trainer = SentencePieceBPETokenizer()
    text = SHAKESPEARE.read_text(encoding="utf-8").splitlines()[:400] + TRAIN * 3
    trainer.train_from_iterator(text, vocab_size=vocab_size, show_progress=False)
    vocab = trainer.get_vocab()
    return sorted(vocab, key=vocab.get)


def write_sentencepiece_gguf(path: Path, arch: str, add_space_prefix: bool = True) -> None:
    pieces = [p for p in train_pieces(800) if not p.startswith("<")]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces,
              CONTROL_TOKEN, "<|im_end|>", USER_TOKEN]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 3, 3, 4]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0] * 3
    writer = GGUFWriter(path, arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["llama", "gemma2", "phi3"])
def sentencepiece_gguf(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sp") / f"vocab-{request.param}.gguf"
    write_sentencepiece_gguf(path, request.param)
    return path


def test_token_ids_equal_transformers(sentencepiece_gguf):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(sentencepiece_gguf.parent,
                                                           gguf_file=sentencepiece_gguf.name)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(sentencepiece_gguf))
    for text in TEXTS:
        want = reference(text)["input_ids"]
        assert ours.encode(text) == want, text
        assert ours.decode(want) == reference.decode(want, skip_special_tokens=True), text
    assert ours.encode("hi <|im_start|>")[-1] == ours.backend.token_to_id(CONTROL_TOKEN)


def test_add_space_prefix_false_puts_no_space_before_the_text(tmp_path):
    """llama.cpp's reading of the flag (transformers' GGUF reader ignores it for llama files):
    the first word's pieces start without "▁"."""
    path = tmp_path / "vocab.gguf"
    write_sentencepiece_gguf(path, "llama", add_space_prefix=False)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    with_prefix = tmp_path / "prefix.gguf"
    write_sentencepiece_gguf(with_prefix, "llama")
    prefixed = Tokenizer.from_gguf_metadata(read_gguf_metadata(with_prefix))
    word = ours.backend.id_to_token(ours.encode("the", add_special_tokens=False)[0])
    assert not word.startswith("▁")
    assert prefixed.backend.id_to_token(prefixed.encode("the")[1]) == "▁the"
    assert ours.decode(ours.encode(" the end")) == " the end"


def test_byte_fallback_spells_unseen_characters_in_bytes(sentencepiece_gguf):
    """A character the pieces lack becomes its UTF-8 bytes (<0xE2>...), and decodes back."""
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(sentencepiece_gguf))
    ids = ours.encode("☃", add_special_tokens=False)
    assert b"".join(ours.token_bytes(i) for i in ids).endswith("☃".encode())
    assert ours.decode(ids) == "☃"


@pytest.fixture(scope="module")
def small_byte_level(smollm_path) -> dict:
    """SmolLM2's first 4000 tokens and the merges among them: a byte-level vocabulary small
    enough for transformers to read in a moment."""
    source = read_gguf_metadata(smollm_path)
    tokens = source["tokenizer.ggml.tokens"][:4000]
    known = set(tokens)
    merges = [m for m in source["tokenizer.ggml.merges"]
              if "".join(m.split(" ")) in known and set(m.split(" ")) <= known]
    return {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": source["tokenizer.ggml.token_type"][:4000]}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "tekken", "gpt-4o", "smollm"])
def test_byte_level_pre_tokenizers_equal_transformers(tmp_path, small_byte_level, pre):
    """A byte-level vocabulary under each GGUF pre-tokenizer name: the text is split as
    transformers splits it for that name."""
    transformers = pytest.importorskip("transformers")
    source = small_byte_level
    path = tmp_path / f"bpe-{pre}.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    for text in TEXTS + ["I'M HAPPY they're 12345 and 3.14159", "CamelCaseWords andMore"]:
        assert ours.encode(text) == reference(text)["input_ids"], text
