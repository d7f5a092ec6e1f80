"""A machine-and-model profile: what `ember plan profile` measured, as one JSON file.

It holds what a simulated replica needs to behave as the real one: the fitted step-time
model (stepmodel.py) with its residuals and the measured steps, what serving adds to a
step (the server's own work per step and per streamed token), the KV cache's bytes per
token and block size, the engine's limits (context, scheduler budget), the cold start, the
model's path and name, and the model's own tokenizer, so that a simulation tokenizes prompts
(and hashes their blocks) exactly as a replica does, without the model's files.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ember.config import CacheConfig, SchedulerConfig
from ember.errors import ConfigError
from ember.plan.stepmodel import ServingOverhead, StepModel, StepShape
from ember.tokenizer.tokenizer import Tokenizer

FORMAT = "ember-plan-profile/1"
GIB = 1 << 30  # as the engine sizes its KV cache (runner/kv_tensors.py)


@dataclass(frozen=True)
class Profile:
    model_path: str                 # the model file or folder
    model_name: str                 # the name a replica serves it under
    tokenizer: dict[str, Any]       # the model's own (Tokenizer.to_dict)
    vocab_size: int
    hidden_size: int
    max_model_len: int              # the model's context (before the KV cache's limit)
    block_size: int
    kv_bytes_per_token: int         # the KV cache's memory per token, all layers
    kv_cache_dtype: str
    step_model: StepModel
    cold_start_s: float             # engine start to ready (load phases), measured
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_cache_gib: float = CacheConfig.kv_cache_gib
    engine: dict[str, Any] = field(default_factory=dict)   # dtype, quantization, kernels...
    machine: dict[str, Any] = field(default_factory=dict)  # cpu, cores, load while measured
    residuals: dict[str, dict[str, float]] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)  # each measured step
    # zero in a profile made without serving the model (or before ember measured it)
    serving: ServingOverhead = field(default_factory=ServingOverhead)
    # what `ember route` adds on top when it runs on the replica's cores (if measured)
    gateway: ServingOverhead = field(default_factory=ServingOverhead)

    def num_blocks(self, kv_cache_gib: float | None = None, block_size: int | None = None
                   ) -> int:
        """KV blocks a replica with `kv_cache_gib` (default: the profiled one) holds, in
        blocks of `block_size` tokens (default: the profiled size)."""
        gib = self.kv_cache_gib if kv_cache_gib is None else kv_cache_gib
        size = self.block_size if block_size is None else block_size
        return max(1, int(gib * GIB) // (self.kv_bytes_per_token * size))

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_dict(self.tokenizer)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["step_model"] = self.step_model.to_json()
        return {"format": FORMAT} | data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Profile":
        if data.get("format") != FORMAT:
            raise ConfigError(f"not an ember plan profile (format {data.get('format')!r}, "
                              f"expected {FORMAT!r}); make one with `ember plan profile`")
        fields = {k: v for k, v in data.items() if k != "format"}
        fields["step_model"] = StepModel.from_json(fields["step_model"])
        fields["scheduler"] = SchedulerConfig(**fields["scheduler"])
        for name in ("serving", "gateway"):
            if name in fields:
                fields[name] = ServingOverhead.from_json(fields[name])
        return cls(**fields)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1))


def load_profile(path: str | Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read the profile {path}: {e.strerror}; make one with "
                          "`ember plan profile --out PATH`") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"the profile {path} is not JSON ({e}); make it again with "
                          "`ember plan profile`") from None
    try:
        return Profile.from_json(data)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"the profile {path} is incomplete or from another ember ({e}); "
                          "make it again with `ember plan profile`") from None


def step_record(shape: StepShape, seconds: float, predicted: float) -> dict[str, float]:
    """One measured step as the profile keeps it (its residual is predicted / seconds - 1)."""
    return asdict(shape) | {"seconds": seconds, "predicted": predicted}
