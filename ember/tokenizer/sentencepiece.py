"""SentencePiece vocabularies in GGUF files (`tokenizer.ggml.model` = "llama": Llama 2, Mistral,
TinyLlama, Gemma, Phi-3) as a `tokenizers` BPE with byte fallback.

A GGUF file gives the pieces and their scores but no merges. The merges are the pairs of
pieces that join into another piece, best score first, the order SentencePiece's BPE applies
them in; transformers derives them the same way when it reads such a file, so both tokenize
alike. Spaces are "▁" (U+2581), with one before the text where the vocabulary asks for it
(`tokenizer.ggml.add_space_prefix`, on unless it says otherwise).

Per architecture, as transformers and llama.cpp read these files:
  gemma*  pieces of plain spaces are spelled with "▁", the file's order ranks the merges
          (Gemma's scores do not follow it), and no "▁" goes before the text
  phi3    the prefix "▁" comes from a normalizer, so a text starting with a space keeps it
"""
from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"


def sentencepiece_merges(pieces: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair whose join is a piece, best joined score first; ties by the
    shorter left part, then the shorter right, then by the parts' ids."""
    ids = {piece: i for i, piece in enumerate(pieces)}
    found = []
    for piece, score in zip(pieces, scores):
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in ids and piece[k:] in ids]
        pairs.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        found += [(left, right, score) for left, right in pairs]
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable
    return [(left, right) for left, right, _ in found]


def sentencepiece_backend(metadata: dict[str, Any]) -> HFTokenizer:
    """The `tokenizers` pipeline of a GGUF SentencePiece vocabulary (special tokens apart)."""
    pieces: list[str] = list(metadata["tokenizer.ggml.tokens"])
    scores = list(metadata.get("tokenizer.ggml.scores") or [0.0] * len(pieces))
    arch = str(metadata.get("general.architecture", ""))
    if arch.startswith("gemma"):
        pieces = [SPACE * len(p) if " " in p and not p.strip() else p for p in pieces]
        scores = [-float(i) for i in range(len(pieces))]
    vocab = {piece: i for i, piece in enumerate(pieces)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(pieces, scores),
                                     fuse_unk=True, byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True) and \
        not arch.startswith("gemma")
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch.startswith("gemma"):
        backend.normalizer = normalizers.Replace(" ", SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                                   normalizers.Replace(" ", SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend
