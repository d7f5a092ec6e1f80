"""Hugging Face model folders: config.json -> ModelConfig, *.safetensors -> named tensors."""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ember.config import ModelConfig
from ember.errors import ModelLoadError, UnsupportedModel
from ember.weights.hf_variants import GEMMAS, variant_fields


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path} is missing; a Hugging Face model folder needs config.json, "
                             "*.safetensors, tokenizer.json and tokenizer_config.json") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e}); re-download it") from e


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """A transformers config.json (as a dict) -> ModelConfig."""
    architectures = config.get("architectures") or ["<missing>"]
    if config.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias=true is not supported; ember runs bias-free MLPs")
    num_heads = int(config["num_attention_heads"])
    is_qwen2 = architectures[0] in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    try:
        return ModelConfig(
            architecture=architectures[0],
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings",
                                                architectures[0] in GEMMAS)),
            qkv_bias=is_qwen2 or bool(config.get("attention_bias", False)),
            **variant_fields(config, architectures[0]),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json has no {e.args[0]!r}; it is not a complete "
                             "transformers config") from e


class SafetensorsFolder:
    """A Hugging Face model folder."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.config = read_json(self.path / "config.json")
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{self.path} has no *.safetensors files; ember reads "
                                 "safetensors weights (convert .bin checkpoints first)")

    def model_config(self) -> ModelConfig:
        return model_config_from_hf(self.config)

    def linear_bits(self) -> int | None:
        """Floating-point weights: nothing to match with packed integer formats."""
        return None

    def linear_packing(self) -> str | None:
        return None

    def tensors(self, config: ModelConfig | None, dtype: torch.dtype = torch.float32,
                keep: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, tensor) pairs, memory-mapped from the files, as stored (`dtype`: the
        loader casts them; `config` None: an encoder's, as stored). Gemma's norms compute
        x * (1 + weight): their weights come out with the 1 added (as llama.cpp stores them).
        `keep`: which names to read (a pipeline stage's, a rank's experts), None: all."""
        for file in self.files:
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        if keep is not None and not keep(name):
                            continue
                        tensor = f.get_tensor(name)
                        if config is not None and config.norm_plus_one \
                                and name.endswith("norm.weight"):
                            tensor = tensor.float() + 1.0
                        yield name, tensor
            except SafetensorError as e:
                raise ModelLoadError(f"{file} is not a readable safetensors file ({e}); "
                                     "re-download it") from e
