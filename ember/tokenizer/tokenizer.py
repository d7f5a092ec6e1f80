"""Tokenizers from the model files, built on the `tokenizers` library.

A GGUF file carries a byte-level BPE vocabulary, its merges and the name of its pre-tokenizer,
or a SentencePiece vocabulary with scores (sentencepiece.py); a Hugging Face folder carries
tokenizer.json. Both become one `tokenizers.Tokenizer`, so encoding,
decoding and streaming work the same way whichever the source.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

from ember.errors import ModelLoadError, UnsupportedModel
from ember.tokenizer.sentencepiece import sentencepiece_backend

log = logging.getLogger(__name__)

# How text is split before BPE, by GGUF `tokenizer.ggml.pre`. These are the split patterns the
# models were trained with (published with llama.cpp and the models' tokenizer.json files).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken (Nemo, Pixtral) and GPT-4o's (Llama 4, MiniMax): case-aware words
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                + _CONTRACTION
                + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                + _CONTRACTION
                + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3",
                            "falcon-h1", "dbrx", "pixtral"), _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
           "tekken": _TEKKEN_SPLIT,
           **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT)}
_GPT2_STYLE = ("default", "gpt2", "smollm", "starcoder", "refact")

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# GGUF token types (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_LEVEL_CHARS = frozenset(_UNICODE_TO_BYTE)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":  # SmolLM's tokenizer.json: single digits, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre not in _GPT2_STYLE:
        log.warning("GGUF pre-tokenizer %r is unknown to ember; splitting text as GPT-2 does, "
                    "which may tokenize some text differently from llama.cpp", pre)
    return byte_level


def _byte_level(metadata: dict[str, Any]) -> HFTokenizer:
    """A gpt2-style vocabulary: byte-level BPE with the file's merges and pre-tokenizer."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # a token outside the byte alphabet (a raw added token) is re-spelled in it
    vocab = {tok if set(tok) <= spelled else "".join(alphabet[b] for b in tok.encode()): i
             for i, tok in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _bos_eos(bos: str | None, bos_id: int | None, eos: str | None, eos_id: int | None
             ) -> processors.PostProcessor | None:
    """The post-processor adding a BOS before and/or an EOS after each text (None: neither)."""
    if bos is None and eos is None:
        return None
    head, tail = (f"{bos} " if bos else ""), (f" {eos}" if eos else "")
    specials = [(t, i) for t, i in ((bos, bos_id), (eos, eos_id)) if t is not None]
    return processors.TemplateProcessing(single=f"{head}$A{tail}",
                                         pair=f"{head}$A{tail} {head}$B{tail}",
                                         special_tokens=list(dict.fromkeys(specials)))


def _special_token(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _user_token(backend: HFTokenizer, token_id: int, text: str) -> AddedToken:
    """A user-defined token, kept whole wherever it appears, under its own id. A vocabulary
    piece the backend spells differently (Gemma's runs of spaces, "▁▁" in the vocabulary) is
    matched after the normalizer has turned the text's spaces into "▁" too."""
    piece = backend.id_to_token(token_id)
    if piece is None or piece == text:
        return AddedToken(text, normalized=False, special=False)
    return AddedToken(piece, normalized=True, special=False)


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template."""

    def __init__(self, backend: HFTokenizer, *, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: Sequence[int], chat_template: str | None) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_ids = frozenset(eos_token_ids)
        self.chat_template = chat_template

    @classmethod
    def from_gguf_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Build from a GGUF file's `tokenizer.*` metadata: byte-level BPE ("gpt2") or
        SentencePiece ("llama") vocabularies."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported; ember reads "
                                   "gpt2 (byte-level BPE) and llama (SentencePiece) "
                                   "vocabularies from GGUF files. Use the model's Hugging Face "
                                   "folder, whose tokenizer.json ember reads whatever its kind")
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = sentencepiece_backend(metadata) if kind == "llama" else _byte_level(metadata)
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, k in zip(tokens, types) if k == CONTROL])
        backend.add_tokens([_user_token(backend, i, t)
                            for i, (t, k) in enumerate(zip(tokens, types)) if k == USER_DEFINED])
        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        eos_id = metadata.get("tokenizer.ggml.eos_token_id")
        bos = tokens[bos_id] if bos_id is not None else None
        # llama.cpp adds a BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
        add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
        backend.post_processor = _bos_eos(bos if add_bos else None, bos_id,
                                          tokens[eos_id] if add_eos and eos_id is not None
                                          else None, eos_id)
        eos_ids = [i for i in (eos_id, metadata.get("tokenizer.ggml.eot_token_id"),
                               metadata.get("tokenizer.ggml.eom_token_id")) if i is not None]
        return cls(backend, bos_token=bos, eos_token=tokens[eos_id] if eos_id is not None else None,
                   eos_token_ids=eos_ids, chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_folder(cls, path: Path) -> "Tokenizer":
        """Build from tokenizer.json, tokenizer_config.json and generation_config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise ModelLoadError(f"{path} has no tokenizer.json; ember needs the fast-tokenizer "
                                 "file (save it with transformers' save_pretrained)")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        # some files (sentence-transformers') pad and cut every text to a fixed length; a
        # prompt is its own tokens, and one past the context is refused, never cut
        backend.no_truncation()
        backend.no_padding()
        config = _read_optional_json(path / "tokenizer_config.json")
        generation = _read_optional_json(path / "generation_config.json")
        bos = _special_token(config.get("bos_token"))
        eos = _special_token(config.get("eos_token"))
        eos_ids = generation.get("eos_token_id", [])
        eos_ids = [eos_ids] if isinstance(eos_ids, int) else list(eos_ids)
        if eos is not None and backend.token_to_id(eos) is not None:
            eos_ids.append(backend.token_to_id(eos))
        return cls(backend, bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
                   chat_template=_hf_chat_template(path, config))

    def to_dict(self) -> dict[str, Any]:
        """The tokenizer as JSON-ready data (from_dict reads it back): a start or a plan
        that has it needs no model file, whose metadata takes seconds to parse."""
        return {"backend": self.backend.to_str(), "bos": self.bos_token, "eos": self.eos_token,
                "eos_ids": sorted(self.eos_token_ids), "chat_template": self.chat_template}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Tokenizer":
        return cls(HFTokenizer.from_str(data["backend"]), bos_token=data["bos"],
                   eos_token=data["eos"], eos_token_ids=data["eos_ids"],
                   chat_template=data["chat_template"])

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def num_special_tokens_added(self) -> int:
        """Tokens encode(text) adds around one text (a BOS, for some models): 0 means its ids
        are those of encode(text, add_special_tokens=False)."""
        return self.backend.num_special_tokens_to_add(is_pair=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`add_special_tokens` adds what the model's files ask for (a BOS, for some models)."""
        # encode_batch lets go of the GIL while it works and encode does not: a server that
        # tokenizes a long prompt in a worker thread keeps its event loop running meanwhile
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_many(self, texts: Sequence[str], add_special_tokens: bool = True
                    ) -> list[list[int]]:
        """encode() of each text, in one call (the library spreads them over the cores)."""
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text (for logprobs): its bytes decoded, special tokens included."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes (a byte-level token may hold part of a UTF-8 character)."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.backend.decoder, decoders.ByteLevel) and \
                set(piece) <= _BYTE_LEVEL_CHARS:
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if _BYTE_PIECE.fullmatch(piece):  # a SentencePiece byte-fallback piece, <0xAB>
            return bytes([int(piece[3:5], 16)])
        return self.token_text(token_id).encode("utf-8")

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, skip_special_tokens)


class IncrementalDetokenizer:
    """Token ids in, text out, never splitting a UTF-8 character across two pieces."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still incomplete)."""
        return self._stream.step(self._backend, token_id) or ""


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download it") from e


def _hf_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """chat_template.jinja (newer transformers) or tokenizer_config.json's chat_template."""
    if (path / "chat_template.jinja").exists():
        return (path / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
