"""Prompt-step matmuls timed on this machine: the candidates `--prefill-matmul auto` picks
from (ember/engine/prefill_choice.py), each on one decoder layer's projections at the model's
own shapes, checked against float32.

    candidate  a projection's prompt rows run on              (PackedLinear.forward)
    int8       w8a8_linear: each row rounded to int8, int8    ember's int8 tiles where the
               dot products (int8_act_group says which        weight fits quads, else
               projections; the rest bfloat16)                oneDNN's int8 GEMM
    bfloat16   oneDNN's bfloat16 matmul on the weight in      (AMX's tile unit where the
               its blocked layout                             CPU has one)
    bfloat16-  torch's brgemm on the weight in its blocks     oneDNN's ukernel on AMX
    brgemm     (use_brgemm_dense)

The weights are random int8 values times a power of two, so the bfloat16 weight holds them
exactly and every candidate multiplies the same numbers; the activations are random (the
down projection's: silu(a) * b, as SwiGLU makes them), PROMPT_ROWS rows of them.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ember.config import ModelConfig
from ember.engine.calibrate import int8_act_group
from ember.kernels import CpuKernels, pack_int8_quads
from ember.quant.packed import int8_quads_fit, prepack_for_onednn

PROMPT_ROWS = 256   # a typical prompt step's rows
REPEATS = 7         # timed rounds, after a warm-up
MAX_LAYER_WEIGHTS = 1 << 24   # a timed layer's weights at most (layer_projections)
ERROR_ROWS = 32     # rows whose outputs are checked against float32
WEIGHT_SCALE = 2.0 ** -9      # the random int8 weights' step (a power of two: see above)


@dataclass(frozen=True)
class Timing:
    """One candidate measured on one decoder layer's projections."""

    name: str
    seconds: float   # median of the rounds, at PROMPT_ROWS rows
    error: float     # the largest of the projections' mean |output - float32 output| /
    #                  mean |float32 output|
    rounds: tuple[float, ...] = ()   # each round's seconds (the candidates alternate)


@dataclass(frozen=True)
class Projection:
    name: str
    in_features: int
    out_features: int
    swiglu: bool = False   # [gate | up], its output silu(gate) * up (SwiGLU's first matmul)
    sharp: bool = False    # input with sharp outliers (int8_prefill_linears)


def layer_projections(config: ModelConfig, max_weights: int = MAX_LAYER_WEIGHTS
                      ) -> tuple[Projection, ...]:
    """One decoder layer's projections (a mixture's: one expert's MLP), their outputs cut in
    proportion (to multiples of 64) where the layer holds more than `max_weights` weights:
    the inputs, which set a matmul's shape of work per output, stay the model's, and the
    measurement stays short on big models."""
    intermediate = config.moe_intermediate_size if config.num_experts else \
        config.intermediate_size
    hidden, q_size = config.hidden_size, config.q_size
    full = (Projection("qkv", hidden, q_size + 2 * config.kv_size),
            Projection("o", q_size, hidden),
            Projection("gate_up", hidden, 2 * intermediate, swiglu=True),
            Projection("down", intermediate, hidden, sharp=True))
    share = max_weights / sum(p.in_features * p.out_features for p in full)
    if share >= 1:
        return full
    return tuple(replace(p, out_features=max(64, int(p.out_features * share) // 64 * 64))
                 for p in full)


def measure_candidates(names: Sequence[str], projections: Sequence[Projection], method: str,
                       kernels: CpuKernels, rows: int = PROMPT_ROWS,
                       repeats: int = REPEATS) -> tuple[Timing, ...]:
    """Time each candidate on `projections` (layer_projections) run one after another as
    PackedLinear runs prompt rows over `method` weights, at `rows` rows of random values, and
    check its outputs against float32 (the largest error of the projections, on the first
    ERROR_ROWS rows). After a warm-up, `repeats` rounds run every candidate in turn: a
    shared machine's speed drifts, and alternating lets candidates be compared round by
    round, each at the same moment (prefill_choice.pick)."""
    g = torch.Generator().manual_seed(0)
    weights = [_random_weight(p, g) for p in projections]
    inputs = [_inputs(p, rows, g) for p in projections]
    calls = {name: [_call(name, p, q, method, kernels) for p, q in zip(projections, weights)]
             for name in names}
    times: dict[str, list[float]] = {name: [] for name in names}
    with torch.inference_mode():
        outputs = {name: [call(x) for call, x in zip(calls[name], inputs)] for name in names}
        for _ in range(repeats):
            for name in names:
                start = time.perf_counter()
                for call, x in zip(calls[name], inputs):
                    call(x)
                times[name].append(time.perf_counter() - start)
    wants = [_float32_result(p, x, q) for p, x, q in zip(projections, inputs, weights)]
    return tuple(Timing(name, statistics.median(times[name]),
                        max(_error(out, want) for out, want in zip(outputs[name], wants)),
                        tuple(times[name]))
                 for name in names)


def _random_weight(p: Projection, g: torch.Generator) -> Tensor:
    """int8 [out, in]: 64 random rows repeated (quick to make at any size)."""
    tile = torch.randint(-127, 128, (64, p.in_features), generator=g, dtype=torch.int8)
    return tile.repeat(-(-p.out_features // 64), 1)[:p.out_features].contiguous()


def _inputs(p: Projection, rows: int, g: torch.Generator) -> Tensor:
    """Random activations; for a sharp input, silu(a) * b as SwiGLU makes it."""
    x = torch.randn(rows, p.in_features, generator=g)
    if p.sharp:
        x = F.silu(x) * torch.randn(rows, p.in_features, generator=g)
    return x.bfloat16()


def _call(name: str, p: Projection, q: Tensor, method: str, kernels: CpuKernels
          ) -> Callable[[Tensor], Tensor]:
    """x -> the projection's output, on the matmul PackedLinear.forward (and, for gate/up,
    SwiGLU.forward) runs for prompt rows with candidate `name`: w8a8_linear on the int8
    weight in quads (or rows), oneDNN's bfloat16 matmul on the weight in its blocked layout,
    or brgemm_linear. The int8 candidate keeps bfloat16 where int8_act_group says so."""
    group = int8_act_group(method, p.in_features, p.sharp) if name == "int8" else None
    if group is not None:
        weight = pack_int8_quads(q) if int8_quads_fit(kernels, *q.shape, group) else q
        scales = torch.full((q.shape[0],), WEIGHT_SCALE)
        smooth = torch.ones(q.shape[1])   # (SmoothQuant's factors: the same work as any)
        return lambda x: kernels.w8a8_linear(x, weight, scales, smooth, swiglu=p.swiglu,
                                             group=group)
    matmul = _bfloat16_matmul(name, q.to(torch.bfloat16).mul_(WEIGHT_SCALE), kernels)
    return (lambda x: kernels.silu_and_mul(matmul(x))) if p.swiglu else matmul


def _bfloat16_matmul(name: str, weight: Tensor, kernels: CpuKernels
                     ) -> Callable[[Tensor], Tensor]:
    """x -> x weight^T on brgemm_linear (bfloat16-brgemm) or oneDNN's bfloat16 matmul."""
    if name == "bfloat16-brgemm":
        blocks = kernels.brgemm_pack(weight)
        return lambda x: kernels.brgemm_linear(x, blocks)
    dense, prepacked = prepack_for_onednn(weight)
    if prepacked:
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, dense, None, "none", [], "")
    return lambda x: F.linear(x, dense)


def _float32_result(p: Projection, x: Tensor, q: Tensor) -> Tensor:
    """The projection's output for the first ERROR_ROWS rows of x, in float32."""
    want = x[:ERROR_ROWS].float() @ (q.float() * WEIGHT_SCALE).T
    if p.swiglu:
        gate, up = want.chunk(2, dim=-1)
        want = F.silu(gate) * up
    return want


def _error(out: Tensor, want: Tensor) -> float:
    """mean |out - want| / mean |want| over want's rows."""
    diff = (out[:want.shape[0]].float() - want).abs().mean()
    return float(diff / want.abs().mean().clamp(min=1e-12))
