"""Calibration of int8 prefill matmuls: max |x| per input channel of every packed linear.

SmoothQuant (ember/quant/packed.py, PackedLinear.use_int8_dense) needs to know which input
channels run large. The engine learns it once, at start, from one prompt of random token ids
run through its own prefill path on the bfloat16 dense weights: no text ships for it and
none is downloaded, and the large channels of a Llama-family model are largely the same
whatever the text (on the default model, calibrating on random ids or on English prose gave
perplexities within 0.4% of each other; docs/benchmarks.md).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ember.engine.memory import large_blocks_mapped_alone
from ember.errors import ConfigError
from ember.kernels import CpuKernels
from ember.quant.packed import PackedLinear
from ember.request import RequestOptions, SamplingParams

if TYPE_CHECKING:
    from ember.engine.core import EngineCore

CALIBRATION_TOKENS = 256
CALIBRATION_SEED = 0


def calibration_prompt(vocab_size: int, length: int = CALIBRATION_TOKENS,
                       seed: int = CALIBRATION_SEED) -> list[int]:
    """`length` token ids drawn uniformly from the vocabulary, the same every time."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (length,), generator=generator).tolist()


def input_amax(core: EngineCore, token_ids: list[int]) -> dict[PackedLinear, Tensor]:
    """Run `token_ids` as one prompt through an idle engine (one prefill step when it fits
    the step budget) and return max |x| per input channel for each of the model's
    int8_prefill_linears that serves prompt chunks on a dense weight."""
    if core.has_unfinished():
        raise RuntimeError("calibration needs an idle engine")
    amax: dict[PackedLinear, Tensor] = {}

    def record(module: PackedLinear, args: tuple[Tensor, ...]) -> None:
        x = args[0]
        if x.shape[0] > module.max_packed_rows:  # the rows the dense weight takes
            seen = x.detach().abs().amax(dim=0).float()
            amax[module] = torch.maximum(amax[module], seen) if module in amax else seen

    modules = [m for m in core.runner.model.int8_prefill_linears()
               if isinstance(m, PackedLinear) and m.weight is not None]
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
                          f"{len(missing)} linears (a step budget of 8 tokens or fewer?); "
                          "raise --max-num-batched-tokens or use --prefill-matmul bfloat16")
    return amax


def use_int8_prefill(core: EngineCore, kernels: CpuKernels) -> int:
    """Calibrate, then turn the dense weights of the model's int8_prefill_linears into
    SmoothQuant int8 (in place, each bfloat16 weight freed as its int8 one is made). Returns
    how many linears."""
    prompt = calibration_prompt(core.model_config.vocab_size,
                                min(CALIBRATION_TOKENS, core.max_model_len - 1))
    amax = input_amax(core, prompt)
    with large_blocks_mapped_alone():
        for module, seen in amax.items():
            module.use_int8_dense(kernels, seen)
    return len(amax)
