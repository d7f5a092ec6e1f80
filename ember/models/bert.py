"""A BERT-style encoder (BertModel) for embeddings: bidirectional attention over a padded
batch, no KV cache. Post-LayerNorm layers, absolute position embeddings, GELU.

Parameter names are transformers' with the nesting flattened (see `hf_name_to_ember`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.errors import ModelLoadError, UnsupportedModel

ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class BertConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    layer_norm_eps: float
    max_position_embeddings: int
    type_vocab_size: int
    hidden_act: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "BertConfig":
        """A transformers BertConfig (config.json as a dict) -> BertConfig."""
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise UnsupportedModel("only absolute position embeddings are supported in BERT "
                                   "models")
        if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act={config['hidden_act']!r} is not supported; "
                                   f"ember runs {', '.join(_ACTIVATIONS)}")
        try:
            return cls(architecture=(config.get("architectures") or ["BertModel"])[0],
                       vocab_size=int(config["vocab_size"]),
                       hidden_size=int(config["hidden_size"]),
                       intermediate_size=int(config["intermediate_size"]),
                       num_layers=int(config["num_hidden_layers"]),
                       num_heads=int(config["num_attention_heads"]),
                       layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
                       max_position_embeddings=int(config.get("max_position_embeddings", 512)),
                       type_vocab_size=int(config.get("type_vocab_size", 2)),
                       hidden_act=config.get("hidden_act", "gelu"))
        except KeyError as e:
            raise ModelLoadError(f"config.json has no {e.args[0]!r}; it is not a complete "
                                 "transformers BERT config") from e

    def context_limit(self) -> int:
        return self.max_position_embeddings


# transformers' names (after a leading "bert.") -> this module's
_RENAMES = ((re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\."), r"layers.\1."),
            (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.dense\."),
             r"layers.\1.attention_out."),
            (re.compile(r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\."),
             r"layers.\1.attention_norm."),
            (re.compile(r"^encoder\.layer\.(\d+)\.intermediate\.dense\."), r"layers.\1.up."),
            (re.compile(r"^encoder\.layer\.(\d+)\.output\.dense\."), r"layers.\1.down."),
            (re.compile(r"^encoder\.layer\.(\d+)\.output\.LayerNorm\."), r"layers.\1.mlp_norm."),
            (re.compile(r"^embeddings\."), ""))


def hf_name_to_ember(name: str) -> str | None:
    """A checkpoint tensor's name in BertEncoder, or None for what it does not use (the
    pooler, an MLM head, position_ids)."""
    name = name.removeprefix("bert.")
    if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
        return None
    for pattern, replacement in _RENAMES:
        name, count = pattern.subn(replacement, name)
        if count:
            return name
    return name


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attention_out = nn.Linear(h, h)
        self.attention_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.up = nn.Linear(h, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, h)
        self.mlp_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """x [B, L, hidden]; mask [B, 1, 1, L] bool (True: a real token) -> [B, L, hidden]."""
        b, length, h = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(b, length, self.num_heads, h // self.num_heads).transpose(1, 2)
        attn = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)),
                                              heads(self.value(x)), attn_mask=mask)
        x = self.attention_norm(x + self.attention_out(attn.transpose(1, 2).reshape(b, length,
                                                                                    h)))
        return self.mlp_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        """input_ids [B, L] long, right-padded; lengths [B] -> last hidden states [B, L, h]
        (rows past a prompt's length are padding)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None] + \
            self.token_type_embeddings.weight[0]
        x = self.LayerNorm(x)
        mask = (positions[None, :] < lengths[:, None])[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return x
