"""Model files -> a ready LlamaForCausalLM (or a relative of it, ember/models/decoder.py): find
the files, rename, fuse, cast, load."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from ember.config import ModelConfig
from ember.errors import ConfigError, ModelLoadError
from ember.kernels import CpuKernels, cpu_flags
from ember.models.layers import rope_inv_freq
from ember.models.decoder import VariantForCausalLM
from ember.models.llama import LlamaForCausalLM
from ember.models.moe import parameter_counts
from ember.quant.packed import Int8Embedding, KernelInt8Linear, check_method, quantize_linears
from ember.weights.gguf import ROPE_FREQS, GGUFFile
from ember.weights.paths import (DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE,  # noqa: F401
                                 default_model_path, served_model_name)
from ember.weights.safetensors import SafetensorsFolder

log = logging.getLogger(__name__)
ModelFiles = GGUFFile | SafetensorsFolder

# parts that the model keeps fused: fused name -> the transformers names, in order
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
_PART_RE = re.compile(r"(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)"
                      r"\.(weight|bias)")
# an expert's (or Qwen2-MoE's shared expert's) gate and up, fused as a dense MLP's
_EXPERT_PART_RE = re.compile(r"(model\.layers\.\d+\.mlp\.(?:experts\.\d+|shared_expert))"
                             r"\.(gate|up)_proj\.weight")
# Mixtral's names -> the Qwen-style names the experts use
_MIXTRAL_NAMES = [(re.compile(r"\.block_sparse_moe\."), ".mlp."),
                  (re.compile(r"(experts\.\d+)\.w1\."), r"\1.gate_proj."),
                  (re.compile(r"(experts\.\d+)\.w3\."), r"\1.up_proj."),
                  (re.compile(r"(experts\.\d+)\.w2\."), r"\1.down_proj.")]


def open_model_files(model: str | Path | None) -> ModelFiles:
    """A .gguf file, a folder holding one, or a Hugging Face folder; None: the default model."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a .gguf file or a Hugging "
                             "Face folder with config.json and *.safetensors")
    if path.is_dir():
        if (path / "config.json").exists():
            return SafetensorsFolder(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFFile(ggufs[0])
        raise ModelLoadError(f"{path} has no config.json and {len(ggufs)} .gguf files; pass a "
                             "Hugging Face folder or the path of one .gguf file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                             "pass a .gguf file or a Hugging Face folder")
    return GGUFFile(path)


def cpu_has_bf16() -> bool:
    """Whether this CPU has bfloat16 dot products (AVX512-BF16 or AMX), where oneDNN's
    bfloat16 matmuls beat float32 ones (3-4x at prefill sizes on the machine we measured)."""
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """'auto' is bfloat16 on GPUs and on CPUs with bf16 dot products, else float32."""
    if name == "auto":
        on_cpu = torch.device(device).type == "cpu"
        return torch.bfloat16 if not on_cpu or cpu_has_bf16() else torch.float32
    return getattr(torch, name)


def resolve_quantization(name: str, files: ModelFiles, config: ModelConfig,
                         dtype: torch.dtype, device: str) -> str:
    """'auto' keeps the values the weights were shipped in: a GGUF whose linears are mostly
    Q4_0, Q4_1 or Q4_K runs int4, one of any other quantized type int8 (linear_packing),
    anything else none; packed kernels need a CPU and bfloat16.
    A packed choice is checked here, before anything loads."""
    if name == "auto":
        packed = files.linear_packing()
        if packed is None or torch.device(device).type != "cpu" or dtype != torch.bfloat16:
            return "none"
        name = packed
    if name != "none":
        check_method(name, dtype, device,
                     (config.hidden_size, config.q_size, config.intermediate_size))
    return name


def resolve_prefill_matmul(name: str, method: str, kernels: CpuKernels | None) -> str:
    """'auto' is int8 (dynamic int8 activations on int8 weights) where the weights are packed
    and the compiled kernels have AVX-512 BF16, else bfloat16; an int8 choice that cannot run
    here is a ConfigError."""
    runs = method != "none" and kernels is not None and kernels.has_bf16_dot
    if name == "auto":
        return "int8" if runs else "bfloat16"
    if name == "int8" and not runs:
        why = ("the weights are not packed; add --quantization int8 or int4" if method == "none"
               else "the compiled kernels with AVX-512 BF16 are not available here")
        raise ConfigError(f"--prefill-matmul int8 cannot run: {why}; or use --prefill-matmul "
                          "bfloat16")
    if name == "bfloat16-brgemm" and (method == "none" or kernels is None
                                      or not kernels.brgemm_vnni):
        why = ("the weights are not packed; add --quantization int8 or int4" if method == "none"
               else "the compiled kernels are not available here" if kernels is None
               else "torch's brgemm runs its tile kernel only on a CPU with AMX")
        raise ConfigError(f"--prefill-matmul bfloat16-brgemm cannot run: {why}; use "
                          "--prefill-matmul auto or bfloat16")
    return name


def apply_quantization(model: LlamaForCausalLM, method: str,
                       kernels: CpuKernels | None = None) -> LlamaForCausalLM:
    """Pack the linears: `method` in the decoder layers, int8 in the output projection (int4
    there costs ~5% perplexity on the default model, whose embedding ships as Q8_0). With the
    compiled kernels a tied embedding is then read from the projection's int8 weight."""
    if method != "none":
        quantize_linears(model, method, lm_head_method="int8", kernels=kernels)
        if model.config.tie_word_embeddings and isinstance(model.lm_head, KernelInt8Linear):
            model.model.embed_tokens = Int8Embedding(model.lm_head)
    return model


class WeightShard(Protocol):
    """One tensor-parallel rank's part of the model (ember/distributed/parallel.py)."""

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as the rank builds it (its heads, columns and vocabulary rows)."""

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of one loaded tensor (transformers' name, before fusing)."""

    def local_name(self, name: str) -> str | None:
        """A tensor's name in the rank's model (its experts renumbered), or None where the
        rank does not hold it (another rank's expert, under expert parallel)."""


class LayerStage(Protocol):
    """One pipeline stage's layers (ember/distributed/parallel.py's PipelineStage)."""

    first_layer: int
    end_layer: int
    is_first: bool
    is_last: bool

    def local_name(self, name: str, tied: bool) -> str | None:
        """A tensor's name in the stage's model, or None where the stage does not hold it."""


def load_model(files: ModelFiles, config: ModelConfig, dtype: torch.dtype,
               device: str, shard: WeightShard | None = None,
               stage: LayerStage | None = None) -> LlamaForCausalLM:
    """Build the model on the meta device, then assign the file's tensors to it. With
    `shard`, only a tensor-parallel rank's part: each tensor is cut as it loads, so a rank
    holds its own part and at most one whole tensor besides (its experts only, under
    expert parallel: the others' are not read). With `stage`, only a pipeline stage's layers
    (renumbered from 0) and ends."""
    full_config = config
    if shard is not None:
        config = shard.local_config(config)
    with torch.device("meta"):
        model = (LlamaForCausalLM if config.is_llama else VariantForCausalLM)(config)
    if stage is not None:
        keep_stage(model, stage)
    state, parts = {}, {}
    rope_freqs = None
    experts: dict[str, torch.Tensor] = {}
    # quantized GGUF tensors come out in the dtype the model runs in (not float32 first)
    keep = _kept(stage, shard, config.tie_word_embeddings)
    for name, tensor in files.tensors(full_config, dtype, keep):  # (GGUF's q/k: every head)
        for pattern, replacement in _MIXTRAL_NAMES if config.num_experts else ():
            name = pattern.sub(replacement, name)
        if stage is not None:   # (kept: the stage's; renumbered from its first layer)
            name = stage.local_name(name, config.tie_word_embeddings)
        if shard is not None:   # (kept: the rank's; its experts renumbered from its first)
            name = shard.local_name(name)
            tensor = shard.take(name, tensor)
        tensor = tensor.to(device=device, dtype=dtype) if tensor.is_floating_point() else tensor
        match = _PART_RE.fullmatch(name)
        if _EXPERT_PART_RE.fullmatch(name):
            experts[name] = tensor
        elif name == ROPE_FREQS:
            rope_freqs = tensor.float()
        elif name.endswith("rotary_emb.inv_freq"):  # old checkpoints store it; it is derived
            continue
        elif match:
            parts[name] = tensor
        elif not (name == "lm_head.weight" and config.tie_word_embeddings):
            state[name] = tensor
    state.update(_fuse(parts, config))
    state.update(_fuse_experts(experts))
    _check_names(model, state, config)
    model.load_state_dict(state, assign=True, strict=False)
    inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    if rope_freqs is not None:
        inv_freq = inv_freq / rope_freqs.cpu()
    model.inv_freq = inv_freq.to(device)
    model.tie_weights()
    if config.num_experts:
        active, total = parameter_counts(config)
        log.info("%s: %d experts, %d per token: %.2fB parameters active of %.2fB",
                 config.architecture, config.num_experts, config.num_experts_per_tok,
                 active / 1e9, total / 1e9)
    return model.eval()


def _kept(stage: LayerStage | None, shard: WeightShard | None,
          tied: bool) -> Callable[[str], bool] | None:
    """Which of the files' tensors a rank reads (by their names in the files): its stage's,
    and of those its own experts; None: all."""
    if stage is None and shard is None:
        return None

    def keep(name: str) -> bool:
        return (stage is None or stage.local_name(name, tied) is not None) and \
            (shard is None or shard.local_name(name) is not None)
    return keep


def keep_stage(model: LlamaForCausalLM, stage: LayerStage) -> None:
    """Drop, on the meta device, what a pipeline stage does not hold: the other stages'
    layers (each layer built with its index in the whole model, which sets its window and
    MLP kind), the embedding but on the first stage (and the last where the head reads it),
    the output projection but on the last."""
    layers = list(model.model.layers)[stage.first_layer:stage.end_layer]
    model.model.layers = torch.nn.ModuleList(layers)
    if not (stage.is_first or (stage.is_last and model.config.tie_word_embeddings)):
        model.model.embed_tokens = torch.nn.Identity()
    if not stage.is_last:
        model.lm_head = torch.nn.Identity()


def _fuse(parts: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Concatenate q/k/v and gate/up (weights and biases) along the output dimension."""
    fused = {}
    for layer in range(config.num_layers):
        for fused_name, names in _FUSED.items():
            for kind in ("weight", "bias"):
                keys = [f"model.layers.{layer}.{n}.{kind}" for n in names]
                present = [k for k in keys if k in parts]
                if not present:
                    continue
                if len(present) != len(keys):
                    missing = sorted(set(keys) - set(present))
                    raise ModelLoadError(f"model files lack {', '.join(missing)}")
                fused[f"model.layers.{layer}.{fused_name}.{kind}"] = \
                    torch.cat([parts.pop(k) for k in keys])
    return fused


def _fuse_experts(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each expert's gate and up weights -> its gate_up_proj (gate rows first)."""
    prefixes = {_EXPERT_PART_RE.fullmatch(name).group(1) for name in parts}
    fused = {}
    for prefix in prefixes:
        gate, up = (parts.get(f"{prefix}.{kind}_proj.weight") for kind in ("gate", "up"))
        if gate is None or up is None:
            raise ModelLoadError(f"model files have only one of {prefix}'s gate and up "
                                 "projections")
        fused[f"{prefix}.gate_up_proj.weight"] = torch.cat([gate, up])
    return fused


def _check_names(model: LlamaForCausalLM, state: dict[str, torch.Tensor],
                 config: ModelConfig) -> None:
    expected = {n for n, _ in model.named_parameters()}
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"model files do not match the {config.architecture} layout: missing "
            f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}; the files may be "
            "incomplete or of another architecture")
    for name, param in model.named_parameters():
        if name in state and tuple(state[name].shape) != tuple(param.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(state[name].shape)} but the "
                                 f"config implies {tuple(param.shape)}; the files disagree")
