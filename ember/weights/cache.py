"""The model as the engine runs it, cached on disk: a restart maps it instead of rebuilding it.

Loading a quantized model is mostly work whose result never changes between starts: the
file's weights dequantized, fused, requantized into the kernels' panels and quads, and the
int8 prompt weights calibrated (SmoothQuant, ember/engine/calibrate.py). After a full load
the engine saves the model's final tensors (parameters and buffers, each shared tensor
once) with safetensors, beside a small JSON of what is not a tensor (the packed modules'
settings, which names share a tensor); the next start with the same key builds the model
on the meta device and assigns it the file's tensors, memory-mapped. The key covers the
model file (path, size, modification time), ember's version, the resolved dtype,
quantization and prefill matmuls, the options that shape calibration, and the compiled
kernels' build, so any change loads afresh. A cache that fails to load is removed and
rebuilt; the JSON is written last and names the tensor file's size, so a write cut short
is never read.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ember.config import EngineConfig, ModelConfig
from ember.kernels import CpuKernels
from ember.models.decoder import VariantForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.quant.packed import Int8Embedding, KernelInt8Linear, PackedLinear, prepack_for_onednn

log = logging.getLogger(__name__)

FORMAT = 4  # raised whenever packing's results change, so older caches rebuild
TENSORS, META = "model.safetensors", "model.json"
SUMMARIES = "files"   # the model files' summaries (ember/engine/files_summary.py), kept apart
CHOICES = "prefill-matmul"   # measured prefill matmul choices (ember/engine/prefill_choice.py)
KEEP = 4                  # cached models kept (most recently written); older ones are removed
PARTIAL_STALE_S = 3600.0  # a partial write this old was cut short (its writer died)
# the modules quantization puts in place, rebuilt from their settings and tensors
PACKED = {cls.__name__: cls for cls in (PackedLinear, KernelInt8Linear, Int8Embedding)}


def cache_key(model_path: Path, config: EngineConfig, choices: dict[str, str],
              kernels: CpuKernels | None) -> str:
    """A hash of everything the cached tensors depend on (`choices`: the resolved dtype,
    quantization and prefill matmuls)."""
    from ember import __version__
    so = getattr(kernels.ops, "__file__", "") if kernels is not None else ""
    so_stat = os.stat(so) if so else None
    fields = {"format": FORMAT, "ember": __version__, "torch": torch.__version__,
              "model": [str(model_path.resolve()), *_file_stamps(model_path)],
              "choices": choices, "kernels": [so, so_stat.st_size, so_stat.st_mtime_ns]
              if so_stat else None,
              # calibration's prompt length and steps depend on these
              "max_model_len": config.max_model_len, "cache": repr(config.cache),
              "batched": config.scheduler.max_num_batched_tokens}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def _file_stamps(path: Path) -> list[list[object]]:
    """(name, size, modification time) of the model file, or of each file in its folder."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


class WeightCache:
    """One cached model: the folder `root/key`."""

    def __init__(self, root: Path, key: str) -> None:
        self.root, self.folder = root, root / key

    def load(self, config: ModelConfig, kernels: CpuKernels | None) -> LlamaForCausalLM | None:
        """The cached model, or None where there is none or it does not load (it is then
        removed, to be written again)."""
        if not (self.folder / META).is_file():
            return None
        try:
            meta = json.loads((self.folder / META).read_text())
            if meta["format"] != FORMAT or \
                    (self.folder / TENSORS).stat().st_size != meta["bytes"]:
                raise ValueError("the tensor file is not the one the metadata describes")
            model = _restore(config, meta, load_file(self.folder / TENSORS), kernels)
        except Exception as e:  # noqa: BLE001 (any broken cache is rebuilt, never fatal)
            log.warning("the weight cache %s did not load (%s: %s); loading the model afresh",
                        self.folder, type(e).__name__, e)
            shutil.rmtree(self.folder, ignore_errors=True)
            return None
        return model

    def save(self, model: nn.Module, model_path: Path) -> bool:
        """Write the model's tensors and settings (atomically: a folder renamed into place).
        Returns whether it was written; a model holding what the cache cannot keep, or a
        failing disk, only logs."""
        try:
            meta, tensors = _describe(model)
            meta["model_path"] = str(model_path)
        except ValueError as e:
            log.info("the weight cache is not written: %s", e)
            return False
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".partial-"))
            save_file(tensors, tmp / TENSORS)
            del tensors
            meta["bytes"] = (tmp / TENSORS).stat().st_size
            (tmp / META).write_text(json.dumps(meta))   # last: it marks the cache complete
            shutil.rmtree(self.folder, ignore_errors=True)
            os.replace(tmp, self.folder)
        except OSError as e:
            log.warning("the weight cache could not be written to %s (%s)", self.root, e)
            shutil.rmtree(tmp, ignore_errors=True)
            return False
        prune(self.root, keep=KEEP)
        return True


def prune(root: Path, keep: int, now: float | None = None) -> list[Path]:
    """Remove cached models whose model file is gone, all but the `keep` most recently
    written of the rest, and partial writes left by a writer that died. Returns what went."""
    now = time.time() if now is None else now
    removed, kept = [], []
    for folder in root.iterdir():
        if folder.name in (SUMMARIES, CHOICES):
            continue
        if folder.name.startswith(".partial-"):
            if now - folder.stat().st_mtime > PARTIAL_STALE_S:
                removed.append(folder)
            continue
        try:
            source = json.loads((folder / META).read_text())["model_path"]
        except (OSError, ValueError, KeyError):
            source = None
        if source is None or not Path(source).exists():
            removed.append(folder)
        else:
            kept.append(folder)
    kept.sort(key=lambda f: f.stat().st_mtime, reverse=True)
    removed += kept[keep:]
    for folder in removed:
        shutil.rmtree(folder, ignore_errors=True)
    return removed


def _describe(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(metadata, tensors by name): each distinct tensor once, under the first name that
    holds it; the other names are aliases. Raises ValueError for what cannot be kept."""
    tensors: dict[str, torch.Tensor] = {}
    kinds, aliases, nones, modules, prepacked = {}, {}, [], {}, []
    seen: dict[tuple[object, ...], str] = {}
    for path, module in model.named_modules():
        if type(module).__name__ in PACKED:
            modules[path] = _settings(module)
            if getattr(module, "prepacked", False):
                prepacked.append(path)
        attrs = {n: v for n, v in vars(module).items() if isinstance(v, torch.Tensor)}
        for kind, table in (("param", module._parameters), ("buffer", module._buffers),
                            ("attr", attrs)):
            for name, tensor in table.items():
                full = f"{path}.{name}" if path else name
                if tensor is None:
                    nones.append([path, name, kind])
                    continue
                kinds[full] = kind
                if tensor.is_mkldnn:   # oneDNN's blocked layout: kept as rows, reordered
                    # (never shared; its dense copy's address may be a freed one's)
                    tensor, key = tensor.to_dense(), ("mkldnn", full)
                else:
                    key = (tensor.data_ptr(), tensor.nbytes, tensor.dtype, *tensor.shape)
                if key in seen:
                    aliases[full] = seen[key]
                else:
                    seen[key] = full
                    tensors[full] = tensor.detach().to("cpu", copy=True).contiguous()
    meta = {"format": FORMAT, "kinds": kinds, "aliases": aliases, "nones": nones,
            "modules": modules, "prepacked": prepacked}
    return meta, tensors


def _settings(module: nn.Module) -> dict[str, Any]:
    """A packed module's attributes that are not tensors (those are kept with the others):
    plain values, and the names of those that hold the compiled kernels (set on load)."""
    plain, kernel_attrs = {}, []
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training" or isinstance(value, torch.Tensor):
            continue
        if isinstance(value, CpuKernels):
            kernel_attrs.append(name)
        elif value is None or isinstance(value, (bool, int, float, str)):
            plain[name] = value
        else:
            raise ValueError(f"{type(module).__name__}.{name} holds a {type(value).__name__}")
    return {"class": type(module).__name__, "plain": plain, "kernels": kernel_attrs}


def _restore(config: ModelConfig, meta: dict[str, Any], tensors: dict[str, torch.Tensor],
             kernels: CpuKernels | None) -> LlamaForCausalLM:
    """The model built on the meta device, its packed modules put back from their settings,
    and every tensor assigned (the mapped ones themselves, not copies)."""
    with torch.device("meta"):   # the class load_model builds
        model = (LlamaForCausalLM if config.is_llama else VariantForCausalLM)(config)
    for path, spec in meta["modules"].items():
        if spec["kernels"] and kernels is None:
            raise ValueError("the cache was made with the compiled kernels")
        module = PACKED[spec["class"]].__new__(PACKED[spec["class"]])
        nn.Module.__init__(module)
        vars(module).update(spec["plain"])
        vars(module).update({name: kernels for name in spec["kernels"]})
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, module)
    for path, name, kind in meta["nones"]:
        _assign(model.get_submodule(path), name, kind, None)
    for full, kind in meta["kinds"].items():
        path, _, name = full.rpartition(".")
        tensor = tensors[meta["aliases"].get(full, full)]
        _assign(model.get_submodule(path), name, kind, tensor)
    for path in meta["prepacked"]:
        module = model.get_submodule(path)
        module.weight, module.prepacked = prepack_for_onednn(module.weight)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the cache lacks {left[:3]}")
    return model.eval()


def _assign(module: nn.Module, name: str, kind: str, tensor: torch.Tensor | None) -> None:
    if kind == "attr":
        vars(module)[name] = tensor
    elif kind == "param":
        module._parameters[name] = None if tensor is None else \
            nn.Parameter(tensor, requires_grad=False)
        module._buffers.pop(name, None)
    else:
        module._buffers[name] = tensor
        module._parameters.pop(name, None)
