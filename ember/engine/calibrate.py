"""Calibration of int8 prefill matmuls: max |x| per input channel of the linears concerned.

SmoothQuant (ember/quant/packed.py, PackedLinear.use_int8_dense) needs to know which input
channels run large. The engine learns it once, at start, from one prompt of random token ids
run through its own prefill path: no text ships for it and none is downloaded, and the large
channels of a Llama-family model are much the same whatever the text (docs/benchmarks.md has
the perplexities). The linears' dense bfloat16 weights are shrunk to plain int8 before the
KV cache is allocated (prepare_int8_prefill), the calibration prompt runs on their packed
weights, and the smoothed int8 ones are made from the plain int8: the bfloat16 copies never
sit beside the KV cache, which kept `ember serve` under 1.6 GiB while it starts.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from ember.engine.memory import large_blocks_mapped_alone
from ember.errors import ConfigError
from ember.kernels import CpuKernels
from ember.quant.packed import PackedLinear
from ember.request import RequestOptions, SamplingParams



class Engine(Protocol):
    """What calibration needs of an idle EngineCore (a protocol, so this module does not
    import the core that calls it)."""

    max_model_len: int
    model_config: Any
    runner: Any
    scheduler: Any

    def has_unfinished(self) -> bool: ...
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, options: RequestOptions = ...) -> Any: ...
    def step(self) -> list[Any]: ...

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0
SHARP_GROUP = 512   # inputs per activation scale, at most, where input outliers run sharp


def calibration_prompt(vocab_size: int, length: int = CALIBRATION_TOKENS,
                       seed: int = CALIBRATION_SEED) -> list[int]:
    """`length` token ids drawn uniformly from the vocabulary, the same every time."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (length,), generator=generator).tolist()


def activation_group(in_features: int, largest: int = SHARP_GROUP) -> int:
    """Inputs per activation scale for a linear with sharp input outliers: the largest
    multiple of 16 up to `largest` that divides in_features (0, a whole row, if none)."""
    return max((g for g in range(16, largest + 1, 16) if in_features % g == 0), default=0)


def int8_prefill_targets(model: torch.nn.Module) -> dict[PackedLinear, int]:
    """The model's int8_prefill_linears that are packed, each with its activation group
    (inputs per scale, 0: a whole row). Linears with sharp input outliers (the down
    projection) take int8 activations only over int4 weights, one scale per group of up to
    512 inputs: on the default model that costs +1.4% prompt perplexity where one scale per
    row cost +2.7%; int4's budget is 5% of bfloat16's perplexity,
    int8 weights' only 1%, so over int8 weights they keep bfloat16."""
    targets: dict[PackedLinear, int] = {}
    for module, sharp in model.int8_prefill_linears():
        if not isinstance(module, PackedLinear):
            continue
        group = int8_act_group(module.method, module.in_features, sharp)
        if group is not None:
            targets[module] = group
    return targets


def int8_act_group(method: str, in_features: int, sharp: bool) -> int | None:
    """A linear's activation group in int8 prompt matmuls over `method` weights (0: one scale
    a row), or None where it keeps bfloat16: sharp inputs over int8 weights
    (int8_prefill_targets says why)."""
    if not sharp:
        return 0
    return activation_group(in_features) if method == "int4" else None


def prepare_int8_prefill(model: torch.nn.Module) -> None:
    """Before the KV cache is allocated: shrink the targets' dense bfloat16 weights to int8
    (~160 -> ~80 MB on the default model). The kernels were checked by
    resolve_prefill_matmul, and use_int8_dense checks each linear again."""
    for module in int8_prefill_targets(model):
        module.shrink_dense()


def input_amax(core: Engine, token_ids: list[int], modules: list[PackedLinear]
               ) -> dict[PackedLinear, Tensor]:
    """Run `token_ids` as one prompt through an idle engine (one prefill step when it fits
    the step budget) and return max |x| per input channel for each of `modules`."""
    if core.has_unfinished():
        raise RuntimeError("calibration needs an idle engine")
    amax: dict[PackedLinear, Tensor] = {}

    def record(module: PackedLinear, args: tuple[Tensor, ...]) -> None:
        x = args[0]
        if module.dense_rows(x):  # the rows the dense weight takes
            seen = x.detach().abs().amax(dim=0).float()
            amax[module] = torch.maximum(amax[module], seen) if module in amax else seen

    hooks = [m.register_forward_pre_hook(record) for m in modules]
    try:
        core.add_request("calibration", token_ids, SamplingParams(temperature=0, max_tokens=1),
                         RequestOptions(prefix_cache=False))
        while core.has_unfinished():
            core.step()
    finally:
        for hook in hooks:
            hook.remove()
    missing = [m for m in modules if m not in amax]
    if missing:
        raise ConfigError(f"int8 prefill matmuls: calibration saw no prompt rows in "
                          f"{len(missing)} linears (a KV cache too small for a prompt?); "
                          "raise --kv-cache-gib, or use --prefill-matmul bfloat16")
    return amax


def use_int8_prefill(core: Engine, kernels: CpuKernels) -> int:
    """Calibrate, then give each int8_prefill_targets linear its SmoothQuant int8 weight,
    made from the int8 copy prepare_int8_prefill left. Returns how many linears."""
    room = min(core.max_model_len, core.scheduler.kv.capacity_tokens) - 1  # 1 output token
    prompt = calibration_prompt(core.model_config.vocab_size, min(CALIBRATION_TOKENS, room))
    model = core.runner.model
    groups = int8_prefill_targets(model)
    amax = input_amax(core, prompt, list(groups))
    with large_blocks_mapped_alone():
        for module, seen in amax.items():
            module.use_int8_dense(kernels, seen, act_group=groups[module])
    model.use_int8_decode()   # batched decode steps on the same int8 weights
    return len(amax)
