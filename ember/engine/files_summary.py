"""What a start reads of a GGUF file besides the weights (the architecture, the bits of
the packed weights, the tokenizer), kept on disk beside the weight cache. Opening a GGUF
parses all its metadata, the vocabulary arrays included (4 s of a start under load on the
default model); a start whose weights come from the weight cache needs none of it. Keyed by
the model files (path, size, modification time of each) and ember's version; the files
themselves are opened only if their tensors are asked for (a weight-cache miss).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ember.config import ModelConfig, RopeScaling
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf import GGUFFile
from ember.weights.loader import ModelFiles, open_model_files
from ember.weights.paths import default_model_path

log = logging.getLogger(__name__)

FORMAT = 3
KEEP = 16   # summaries kept (most recently written)


class FilesSummary:
    """The parts of ModelFiles a start uses, from the summary; the files open on demand."""

    def __init__(self, path: Path, config: ModelConfig, bits: int | None,
                 packing: str | None, tokenizer: Tokenizer) -> None:
        self.path, self.config, self.bits, self.tokenizer = path, config, bits, tokenizer
        self.packing = packing
        self._files: ModelFiles | None = None

    def model_config(self) -> ModelConfig:
        return self.config

    def linear_bits(self) -> int | None:
        return self.bits

    def linear_packing(self) -> str | None:
        return self.packing

    def tensors(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                keep: Callable[[str], bool] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        if self._files is None:
            self._files = open_model_files(self.path)
        return self._files.tensors(config, dtype, keep)


def open_summarized(model: str | Path | None, root: Path) -> ModelFiles | FilesSummary:
    """The model's summary from `root` if one is there for these very files, else the files
    opened (and their summary written for the next start)."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.is_file():   # a folder: opening it reads no large metadata
        return open_model_files(path)
    target = root / f"{summary_key(path)}.json"
    try:
        return _read(path, json.loads(target.read_text()))
    except FileNotFoundError:
        pass
    except Exception as e:  # noqa: BLE001 (a broken summary is written again)
        log.warning("the model summary %s did not load (%s); reading the files", target, e)
    files = open_model_files(path)
    if isinstance(files, GGUFFile):
        _write(target, files, load_tokenizer(files))
    return files


def load_tokenizer(files: ModelFiles | FilesSummary) -> Tokenizer:
    if isinstance(files, FilesSummary):
        return files.tokenizer
    if isinstance(files, GGUFFile):
        return Tokenizer.from_gguf_metadata(files.metadata)
    return Tokenizer.from_hf_folder(files.path)


def summary_key(path: Path) -> str:
    from ember import __version__
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    stamps = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    fields = [FORMAT, __version__, str(path.resolve()), stamps]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:32]


def _read(path: Path, data: dict[str, Any]) -> FilesSummary:
    # JSON has lists where the config has tuples (per-layer settings)
    config = {k: tuple(v) if isinstance(v, list) else v for k, v in data["config"].items()}
    if config["rope_scaling"] is not None:
        config["rope_scaling"] = RopeScaling(**{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in config["rope_scaling"].items()})
    return FilesSummary(path, ModelConfig(**config), data["bits"], data["packing"],
                        Tokenizer.from_dict(data["tokenizer"]))


def _write(target: Path, files: ModelFiles, tokenizer: Tokenizer) -> None:
    data = {"config": dataclasses.asdict(files.model_config()), "bits": files.linear_bits(),
            "packing": files.linear_packing(),
            "tokenizer": tokenizer.to_dict()}
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".partial-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, target)
        kept = sorted(target.parent.glob("*.json"), key=lambda p: p.stat().st_mtime,
                      reverse=True)
        for old in kept[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("the model summary could not be written to %s (%s)", target.parent, e)
