"""Embedding requests in the engine: the model's pooling, the checks, and their output.

An embedding request travels the generation path: the scheduler prefills its prompt in
chunks under the step's token budget, the runner pools its hidden states (runner/pooling.py)
after the last chunk, and the request finishes there, its KV blocks freed, with no token
sampled. Mean and CLS pooling need every row of the prompt computed, so such requests neither
reuse nor store cached prefixes; last-token pooling reuses them (a full hit still computes
the last token).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ember.errors import ConfigError, InvalidRequest
from ember.request import FinishReason, PoolingParams, Request, SamplingParams

# sentence-transformers' 1_Pooling/config.json flags -> ember's pooling
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
             "pooling_mode_lasttoken": "last"}
EMBED_PARAMS = SamplingParams(max_tokens=1)  # never read: an embedding samples nothing


def sentence_transformers_pooling(folder: Path) -> str | None:
    """The pooling a sentence-transformers folder declares (modules.json -> its Pooling
    module's config.json), or None when the folder has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        pooling = next((m for m in modules if m.get("type", "").endswith(".Pooling")), None)
        if pooling is None:
            return None
        flags = json.loads((folder / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{folder}'s sentence-transformers pooling config is unreadable "
                          f"({e}); fix it, or pass --pooling last|mean|cls") from None
    modes = [mode for flag, mode in _ST_MODES.items() if flags.get(flag)]
    if len(modes) != 1 or any(v for k, v in flags.items()
                              if k.startswith("pooling_mode_") and k not in _ST_MODES):
        raise ConfigError(f"{folder} asks for pooling {flags}; ember pools by one of mean, "
                          "cls or last token: pass --pooling to choose one")
    return modes[0]


def resolve_pooling(name: str, folder: Path | None, encoder: bool) -> str:
    """'auto': the folder's sentence-transformers pooling, else CLS for an encoder (BERT's
    pooler reads [CLS]) and the last token for a decoder (the only one that saw it all)."""
    if name != "auto":
        return name
    declared = sentence_transformers_pooling(folder) if folder is not None else None
    return declared or ("cls" if encoder else "last")


def check_embedding_input(prompt_token_ids: list[int], pooling: PoolingParams,
                          max_model_len: int, hidden_size: int, index: int | None = None
                          ) -> None:
    """An input the engine can embed: not empty, within the context, and dimensions within
    the model's hidden size. (Token ids are checked with the vocabulary elsewhere.)"""
    what = "input" if index is None else f"input[{index}]"
    if not prompt_token_ids:
        raise InvalidRequest(f"{what} is empty; send at least one token", param="input")
    if len(prompt_token_ids) > max_model_len:
        raise InvalidRequest(f"{what} has {len(prompt_token_ids)} tokens, but the model embeds "
                             f"at most {max_model_len} (max_model_len); shorten or split it",
                             param="input")
    dims = pooling.dimensions
    if dims is not None and not 1 <= dims <= hidden_size:
        raise InvalidRequest(f"dimensions={dims} must be in [1, {hidden_size}] (the model's "
                             "embedding size)", param="dimensions")


@dataclass(frozen=True)
class EmbeddingOutput:
    """One input's vector: L2-normalised, `dimensions` long if asked for."""

    index: int
    embedding: list[float]
    num_prompt_tokens: int
    finish_reason: FinishReason = FinishReason.STOP


class PooledSequence:
    """An embedding request's side of the engine's outputs (the counterpart of SequenceText):
    nothing until its vector is pooled, then that vector once."""

    def __init__(self, request: Request, index: int) -> None:
        self.request = request
        self.index = index

    def update(self) -> bool:
        return False  # no stop strings: the prompt is all there is

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.request.finish_reason

    def take_delta(self) -> EmbeddingOutput | None:
        if self.request.embedding is None:
            return None
        return EmbeddingOutput(self.index, self.request.embedding,
                               self.request.num_prompt_tokens)
