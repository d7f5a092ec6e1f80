"""GGUF files: metadata -> ModelConfig, tensors -> Hugging Face names.

Tensors come out dequantized (see ember.quant.formats). llama.cpp's converter permutes the rows
of attn_q and attn_k so that its RoPE can rotate adjacent pairs; ember rotates half-split pairs
as Hugging Face does, so those rows are permuted back here.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType
from gguf import ReaderTensor

from ember.config import ModelConfig, RopeScaling
from ember.errors import ModelLoadError, UnsupportedModel
from ember.quant.formats import dequantize, packing, quant_bits
from ember.weights.gguf_archs import (ARCHITECTURES, MIXTRAL, ROPE_FACTORS, layer_names,
                                      moe_fields, variant_fields)
from ember.weights.gguf_metadata import metadata_of, open_reader

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
ROPE_FREQS = "rope_freqs.weight"  # per-dimension RoPE divisors (Llama 3.1 scaling)
# file types llama-quantize makes at 2-3 bits (general.file_type); the IQ1-IQ3 ones need no
# entry: their tensors are in types int4 cannot hold, so the majority rule already says int8
BELOW_4_BIT_FILES = frozenset(int(t) for t in (
    LlamaFileType.MOSTLY_Q2_K, LlamaFileType.MOSTLY_Q2_K_S, LlamaFileType.MOSTLY_Q3_K_S,
    LlamaFileType.MOSTLY_Q3_K_M, LlamaFileType.MOSTLY_Q3_K_L))


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    names = layer_names(arch)
    if match and match.group(2) in names:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{names[part]}.{kind}"
    return None


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (pair, 2) -> (2, pair).

    Works on weights [out, in] and biases [out].
    """
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
            .reshape(weight.shape))


class GGUFFile:
    """An open GGUF file: its metadata (a plain dict) and its tensors."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._reader = open_reader(self.path)
        self.metadata: dict[str, Any] = metadata_of(self._reader)

    @property
    def raw_tensors(self) -> list[ReaderTensor]:
        """The file's tensors as gguf's reader lists them: name, ggml type, shape, bytes."""
        return list(self._reader.tensors)

    @property
    def arch(self) -> str:
        arch = self.metadata.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(f"GGUF architecture {arch!r} is not supported; ember runs "
                                   f"GGUF architectures {', '.join(ARCHITECTURES)}")
        return arch

    def _get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path} has no metadata key {self.arch}.{key}; the file "
                                 "is incomplete or was written by an unsupported converter")
        return value

    def model_config(self) -> ModelConfig:
        num_heads = int(self._get("attention.head_count"))
        hidden = int(self._get("embedding_length"))
        vocab = self.metadata.get(f"{self.arch}.vocab_size") or \
            len(self.metadata.get("tokenizer.ggml.tokens") or [])
        tensor_names = {t.name for t in self._reader.tensors}
        num_layers = int(self._get("block_count"))
        head_dim = int(self._get("attention.key_length", hidden // num_heads))
        experts = moe_fields(self.arch, self.metadata, tensor_names, num_layers)
        return ModelConfig(
            architecture=MIXTRAL if experts and self.arch == "llama" else
            ARCHITECTURES[self.arch][0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._get("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(self._get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._get("context_length")),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            rope_scaling=self._rope_scaling(),
            **variant_fields(self.arch, self.metadata, hidden, num_heads, head_dim, num_layers),
            **experts,
        )

    def _rope_scaling(self) -> RopeScaling | None:
        factors = {t.name: t for t in self._reader.tensors if t.name in ROPE_FACTORS}
        if factors:
            return self._longrope(factors)
        kind = self.metadata.get(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None  # Llama 3.1 style scaling ships as the rope_freqs tensor instead
        return RopeScaling(kind=kind,
                           factor=float(self._get("rope.scaling.factor")),
                           original_max_position_embeddings=int(self.metadata.get(
                               f"{self.arch}.rope.scaling.original_context_length", 0) or 0))

    def _longrope(self, factors: dict[str, ReaderTensor]) -> RopeScaling:
        """Phi-3's LongRoPE, from its factor tensors and rope.scaling metadata."""
        original = int(self._get("rope.scaling.original_context_length"))
        long, short = (tuple(float(x) for x in factors[name].data) for name in ROPE_FACTORS)
        return RopeScaling(kind="longrope", factor=int(self._get("context_length")) / original,
                           original_max_position_embeddings=original, short_factor=short,
                           long_factor=long, attention_factor=float(self.metadata.get(
                               f"{self.arch}.rope.scaling.attn_factor", 1.0)))

    def linear_bits(self) -> int | None:
        """Bits per weight of the decoder's linear layers as stored (2-8, QUANT_BITS), None if
        unquantized: those of the type holding most of their weights, so a Q4_K_M file (Q4_K
        with some Q6_K) counts 4, as its maker meant it to run."""
        return self._most_linear_weights(quant_bits)

    def linear_packing(self) -> str | None:
        """What `--quantization auto` packs the decoder's linears in (formats.packing): that
        of most of their weights, so a Q4_K_M file (Q4_K with some Q6_K) runs int4 and one of
        3-bit K-quants or IQ4 int8. A file made as 2-3 bit K-quants (general.file_type) runs
        int8 whatever its majority: where rows are not whole 256-value blocks llama-quantize
        falls back to Q4_0 for most tensors, leaving Q3_K/Q5_0 ones that int4 would round
        again (+2-3% perplexity on such files; int8 keeps them within 0.5%)."""
        if self.metadata.get("general.file_type") in BELOW_4_BIT_FILES:
            return "int8"
        return self._most_linear_weights(packing)

    def _most_linear_weights(self, of: Callable[[QType], Any]) -> Any:
        """The value of `of(tensor type)` (None: float) shared by most of the decoder's linear
        weights, None if all are float."""
        weights: Counter[Any] = Counter()
        for t in self._reader.tensors:
            if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2:
                value = of(t.tensor_type)
                if value is not None:
                    weights[value] += int(t.n_elements)
        return weights.most_common(1)[0][0] if weights else None

    def tensors(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                keep: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) pairs, quantized types dequantized to `dtype`; rope_freqs keeps
        its GGUF name. `keep`: which names to read (a pipeline stage's; of a stacked tensor, a
        rank's experts, the others not dequantized), None: all."""
        permuted = ARCHITECTURES[self.arch][1]
        for t in self._reader.tensors:
            if t.name in ROPE_FACTORS:  # in the config (_longrope)
                continue
            name = ROPE_FREQS if t.name == ROPE_FREQS else hf_name(t.name, self.arch)
            if name is None:
                raise UnsupportedModel(f"{self.path} has tensor {t.name!r}, which ember does not "
                                       f"know for the {self.arch} architecture")
            if keep is not None and not keep(name):
                continue
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            data, first = t.data, 0
            if "*" in name:   # stacked experts: only the run `keep` reads is dequantized
                first, end = _kept_experts(name, shape[0], keep)
                if first == end:
                    continue
                data, shape = data[first:end], (end - first, *shape[1:])
            try:
                tensor = dequantize(data, t.tensor_type, shape, dtype)
            except NotImplementedError as e:
                raise UnsupportedModel(f"tensor {t.name} uses ggml type {t.tensor_type.name}, "
                                       f"which cannot be dequantized ({e})") from e
            if t.name == ROPE_FREQS:
                yield ROPE_FREQS, tensor
                continue
            if permuted and ".q_proj." in name:
                tensor = unpermute_rows(tensor, config.num_heads)
            elif permuted and ".k_proj." in name:
                tensor = unpermute_rows(tensor, config.num_kv_heads)
            if "*" in name:  # stacked experts
                for expert, weight in enumerate(tensor, start=first):
                    expert_name = name.replace("*", str(expert))
                    if keep is None or keep(expert_name):
                        yield expert_name, weight
                continue
            if name.endswith("shared_expert_gate.weight"):
                tensor = tensor.reshape(1, -1)  # stored as a vector
            yield name, tensor


def _kept_experts(name: str, num_experts: int, keep: Callable[[str], bool] | None
                  ) -> tuple[int, int]:
    """[first, end) around the experts of stacked tensor `name` ('...experts.*...') that
    `keep` reads (under expert parallel, one rank's run); (0, 0) where none."""
    kept = [e for e in range(num_experts) if keep is None or keep(name.replace("*", str(e)))]
    return (kept[0], kept[-1] + 1) if kept else (0, 0)
