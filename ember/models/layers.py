"""Building blocks of a Llama decoder: RMSNorm, rotary position embedding, SwiGLU MLP."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import RopeScaling
from ember.kernels import CpuKernels
from ember.lora.batch import LoraLayer
from ember.models.parallel import AllReduce, reduce_
from ember.quant.packed import PackedLinear

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the compiled CPU kernels take


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: CpuKernels | None = None  # compiled CPU kernels, if the engine has them

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """x [T, hidden] -> rms_norm(x) * weight (float32 accumulation).

        With `residual`, the residual add comes first: returns (rms_norm(x + residual) * weight,
        x + residual); a compiled kernel does both in one pass, writing the sum into
        `residual`'s storage.
        """
        if self.kernels is not None and x.dtype == self.weight.dtype \
                and x.dtype in KERNEL_DTYPES and x.is_contiguous():
            out = self.kernels.rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        if residual is None:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        residual = residual + x
        return F.rms_norm(residual, self.weight.shape, self.weight, self.eps), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Inverse frequencies [head_dim / 2] float32, with linear or Llama 3.1 scaling (longrope:
    its short factors, for positions within the original context)."""
    # on the CPU even under a meta-device context (meta ops import torch._dynamo)
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / theta ** (steps / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "longrope":
        return longrope_inv_freq(head_dim, theta, scaling.short_factor)
    return _llama3_inv_freq(inv_freq, scaling)


def longrope_inv_freq(head_dim: int, theta: float, factors: tuple[float, ...]) -> Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor [head_dim / 2]."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    factors_t = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (factors_t * theta ** (steps / head_dim))


def _llama3_inv_freq(inv_freq: Tensor, s: RopeScaling) -> Tensor:
    """Llama 3.1: slow down long wavelengths by `factor`, keep short ones, blend between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """positions [T] -> cos, sin [T, 1, head_dim] in `dtype`, computed once per step.

    Each half repeats (pairs are (i, i + head_dim / 2)), and the first half of sin is negated,
    so that rotate_half(x) * sin becomes roll(x, half) * sin (see apply_rope).
    """
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin()
    sin[:, :inv_freq.shape[0]].neg_()
    return emb.cos()[:, None, :].to(dtype), sin[:, None, :].to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim] -> x * cos + rotate_half(x) * sin, with rotate_half(x) =
    [-x2, x1] written as roll(x) = [x2, x1] against the sign-folded sin of rope_cos_sin."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.kernels: CpuKernels | None = None  # compiled CPU kernels, if the engine has them
        # tensor parallel: down_proj's output is this rank's partial sum over its columns,
        # summed across the ranks (ember/distributed/); None in one process, or in an expert
        # (its mixture of experts sums once for all of them)
        self.all_reduce: AllReduce | None = None

    def forward(self, x: Tensor, lora: LoraLayer | None = None) -> Tensor:
        """`lora`: the rows' adapters on gate/up and down, if any."""
        return reduce_(self.all_reduce, self._forward(x, lora))

    def _forward(self, x: Tensor, lora: LoraLayer | None) -> Tensor:
        proj = self.gate_up_proj
        if lora is None and isinstance(proj, PackedLinear) and proj.takes_swiglu(x):
            return self.down_proj(proj.swiglu(x))  # from the int32 sums, one pass
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add_("gate_up", gate_up, x)
        if self.kernels is not None and gate_up.dtype in KERNEL_DTYPES \
                and gate_up.is_contiguous():
            act = self.kernels.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act)
        return out if lora is None else lora.add_("down", out, act)
