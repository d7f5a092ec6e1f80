"""LoRA adapters from PEFT folders and llama.cpp GGUF files -> low-rank factors per projection.

A LoRA on a linear layer y = W x adds scale * B (A x), with A [r, in] and B [out, r] as PEFT
stores them; scale = alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's `use_rslora`).

ember fuses q/k/v into one projection and gate/up into another, so an adapter is kept per layer
and per fused projection ("qkv", "o", "gate_up", "down") as A [in, R] and B [R, out]: each target
module's A side by side (transposed), its B (times its scale) in its own rows and its own output
columns. R is the same in every layer (a module missing from a layer gets zero factors), so one
step's row-to-adapter mask serves every layer. The factors are never merged into the base weights.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ember.config import ModelConfig
from ember.errors import ConfigError

# target module -> (fused projection, index of its part in that projection)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
           "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
           "down_proj": ("down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
MAX_LORA_RANK = 64
_GGUF_PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
               "attn_output": "o_proj", "ffn_gate": "gate_proj", "ffn_up": "up_proj",
               "ffn_down": "down_proj"}
_PEFT_KEY = re.compile(r".*layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")
_GGUF_KEY = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's fused factors: factors[layer][projection] = (A [in, R], B [R, out]) or
    absent where the adapter does not touch that projection at all."""

    name: str
    path: Path
    uid: int                       # changes when a new file is loaded under the same name
    digest: str                    # "sha256:<hex>" of its files: its prefix-cache salt
    rank: int                      # the largest rank of any target module
    factors: list[dict[str, tuple[Tensor, Tensor]]]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.factors
                   for pair in layer.values() for t in pair)

    def width(self, projection: str) -> int:
        """R: the columns of this adapter's A for `projection` (0 if it does not touch it)."""
        pair = self.factors[0].get(projection)
        return 0 if pair is None else pair[0].shape[1]


@dataclass(frozen=True)
class _Module:
    """One target module's factors in one layer, as the file has them."""

    a: Tensor    # [r, in]
    b: Tensor    # [out, r]
    scale: float


def load_adapter(name: str, path: str | Path, config: ModelConfig, uid: int,
                 max_rank: int = MAX_LORA_RANK) -> LoraAdapter:
    """Read a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) or a
    llama.cpp LoRA GGUF, check it fits `config`, and fuse its factors (float32)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"LoRA adapter {name!r}: {path} does not exist; give a PEFT folder "
                          "(adapter_config.json + adapter_model.safetensors) or a LoRA .gguf file")
    modules = _read_gguf(path, config) if path.is_file() else _read_peft(path)
    if not modules:
        raise ConfigError(f"LoRA adapter {name!r} at {path} has no LoRA weights on "
                          f"{', '.join(TARGETS)}")
    mlp = sorted({mod for _, mod in modules if TARGETS[mod][0] in ("gate_up", "down")})
    if mlp and getattr(config, "num_experts", 0):
        raise ConfigError(f"LoRA adapter {name!r} targets {', '.join(mlp)}; on a mixture of "
                          "experts ember serves adapters on attention (q/k/v/o) only")
    rank = max(m.a.shape[0] for m in modules.values())
    if rank > max_rank:
        raise ConfigError(f"LoRA adapter {name!r} has rank {rank}; ember serves ranks up to "
                          f"{max_rank} (raise --max-lora-rank)")
    return LoraAdapter(name, path, uid, adapter_digest(path), rank,
                       _fuse(name, modules, config))


def adapter_digest(path: Path) -> str:
    """SHA-256 of the files an adapter is read from (a GGUF; a PEFT folder's config and
    weights), by name and content: every server that loads the same files gets the same
    digest, whatever the adapter is called there."""
    files = [path] if path.is_file() else [path / "adapter_config.json", _peft_weights(path)]
    h = hashlib.sha256()
    for file in files:
        h.update(file.name.encode() + b"\x00")
        with open(file, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return "sha256:" + h.hexdigest()


def _read_peft(folder: Path) -> dict[tuple[int, str], _Module]:
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ConfigError(f"{folder} has no adapter_config.json; is it a PEFT LoRA adapter?")
    cfg = json.loads(config_file.read_text())
    unsupported = [k for k in ("use_dora", "modules_to_save") if cfg.get(k)]
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("bias", "none") != "none" or unsupported:
        raise ConfigError(f"{folder}: ember serves plain LoRA adapters (peft_type LORA, bias "
                          f"'none', no DoRA, no modules_to_save); this one has "
                          f"peft_type={cfg.get('peft_type')!r} bias={cfg.get('bias')!r} "
                          f"{' '.join(unsupported)}")
    tensors = _read_peft_tensors(folder)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.fullmatch(key)
        if match is None or match.group(2) not in TARGETS:
            raise ConfigError(f"{folder}: adapter tensor {key!r} is not a LoRA factor of "
                              f"{', '.join(TARGETS)} (embedding and lm_head adapters are not "
                              "served)")
        layer, module, side = int(match.group(1)), match.group(2), match.group(3)
        pairs.setdefault((layer, module), {})[side] = tensor.float()
    modules = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"{folder}: layer {layer} {module} has lora_{''.join(ab)} alone")
        rank = ab["A"].shape[0]
        alpha = _pattern_value(cfg.get("alpha_pattern") or {}, layer, module,
                               cfg.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        modules[(layer, module)] = _Module(ab["A"], ab["B"], float(scale))
    return modules


def _read_peft_tensors(folder: Path) -> dict[str, Tensor]:
    weights = _peft_weights(folder)
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file
        return load_file(weights)
    return torch.load(weights, map_location="cpu", weights_only=True)


def _peft_weights(folder: Path) -> Path:
    for name in ("adapter_model.safetensors", "adapter_model.bin"):
        if (folder / name).is_file():
            return folder / name
    raise ConfigError(f"{folder} has no adapter_model.safetensors (or adapter_model.bin)")


def _pattern_value(patterns: dict[str, float], layer: int, module: str, default: float) -> float:
    """PEFT's alpha_pattern: a key matches a module whose name ends with it."""
    name = f"model.layers.{layer}.{module}"
    for key, value in patterns.items():
        if name.endswith(key) or re.fullmatch(rf".*\.{key}", f"x.{name}"):
            return value
    return default


def _read_gguf(path: Path, config: ModelConfig) -> dict[tuple[int, str], _Module]:
    from ember.quant.formats import dequantize
    from ember.weights.gguf import ARCHITECTURES, unpermute_rows
    from ember.weights.gguf_metadata import metadata_of, open_reader
    reader = open_reader(path)
    meta = metadata_of(reader)
    if meta.get("general.type") != "adapter" or meta.get("adapter.type") != "lora":
        kinds = meta.get("general.type"), meta.get("adapter.type")
        raise ConfigError(f"{path} is not a LoRA adapter GGUF (general.type, adapter.type = "
                          f"{kinds}; want 'adapter', 'lora')")
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES or ARCHITECTURES[arch][0] != config.architecture:
        raise ConfigError(f"{path} is a LoRA for architecture {arch!r}; the served model is "
                          f"{config.architecture}")
    permuted = ARCHITECTURES[arch][1]
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for t in reader.tensors:
        match = _GGUF_KEY.fullmatch(t.name)
        if match is None or match.group(2) not in _GGUF_PARTS:
            raise ConfigError(f"{path}: tensor {t.name!r} is not a LoRA factor of a decoder "
                              f"projection ({', '.join(_GGUF_PARTS)})")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        tensor = dequantize(t.data, t.tensor_type, shape).float()
        pairs.setdefault((int(match.group(1)), _GGUF_PARTS[match.group(2)]), {})[
            match.group(3)] = tensor
    alpha = meta.get("adapter.lora.alpha")
    modules = {}
    for (layer, module), ab in pairs.items():
        a, b = ab["a"], ab["b"]
        if permuted and module in ("q_proj", "k_proj"):  # B's rows follow the base's q/k rows
            b = unpermute_rows(b, config.num_heads if module == "q_proj" else
                               config.num_kv_heads)
        rank = a.shape[0]
        scale = float(alpha) / rank if alpha else 1.0   # llama.cpp: alpha / rank, or 1
        modules[(layer, module)] = _Module(a, b, scale)
    return modules


def write_random_adapter(folder: Path, config: ModelConfig, rank: int, seed: int,
                         std: float, alpha: float) -> None:
    """A PEFT-format adapter folder with random factors (normal, `std`) of rank `rank` on every
    target module of every layer of `config`: an adapter to serve and measure without
    training one (the tests' and the mixed-adapter benchmark's)."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    outs = _out_sizes(config)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (projection, index) in TARGETS.items():
            part = "self_attn" if projection in ("qkv", "o") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            n_in, n_out = _in_size(config, projection), outs[projection][index]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * std
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(TARGETS),
         "bias": "none"}))


def _out_sizes(config: ModelConfig) -> dict[str, list[int]]:
    return {"qkv": [config.q_size, config.kv_size, config.kv_size], "o": [config.hidden_size],
            "gate_up": [config.intermediate_size] * 2, "down": [config.hidden_size]}


def _in_size(config: ModelConfig, projection: str) -> int:
    return config.intermediate_size if projection == "down" else \
        config.q_size if projection == "o" else config.hidden_size


def _fuse(name: str, modules: dict[tuple[int, str], _Module], config: ModelConfig
          ) -> list[dict[str, tuple[Tensor, Tensor]]]:
    """Per layer and fused projection, (A [in, R], B [R, out]) with each module's scale in B."""
    ranks: dict[str, int] = {}
    for (layer, module), m in modules.items():
        if not 0 <= layer < config.num_layers:
            raise ConfigError(f"LoRA adapter {name!r} has layer {layer}; the model has "
                              f"{config.num_layers}")
        ranks[module] = max(ranks.get(module, 0), m.a.shape[0])
    outs = _out_sizes(config)
    factors: list[dict[str, tuple[Tensor, Tensor]]] = []
    for layer in range(config.num_layers):
        fused = {}
        for projection in PROJECTIONS:
            parts = [mod for mod, (proj, _) in TARGETS.items() if proj == projection]
            width = sum(ranks.get(mod, 0) for mod in parts)
            if width == 0:
                continue
            a = torch.zeros(_in_size(config, projection), width)
            b = torch.zeros(width, sum(outs[projection]))
            row = 0
            for mod in parts:
                index = TARGETS[mod][1]
                col = sum(outs[projection][:index])
                m = modules.get((layer, mod))
                if m is not None:
                    _check_shapes(name, layer, mod, m, a.shape[0], outs[projection][index])
                    r = m.a.shape[0]
                    a[:, row:row + r] = m.a.t()
                    b[row:row + r, col:col + outs[projection][index]] = m.b.t() * m.scale
                row += ranks.get(mod, 0)
            fused[projection] = (a, b)
        factors.append(fused)
    return factors


def _check_shapes(name: str, layer: int, module: str, m: _Module, in_size: int,
                  out_size: int) -> None:
    if m.a.shape[1] != in_size or m.b.shape != (out_size, m.a.shape[0]):
        raise ConfigError(f"LoRA adapter {name!r} layer {layer} {module}: A {tuple(m.a.shape)} "
                          f"and B {tuple(m.b.shape)} do not fit the model (A [r, {in_size}], "
                          f"B [{out_size}, r]); was it trained for another base model?")
