"""Calibration of int8 prefill matmuls: max |x| per input channel of the linears concerned.

SmoothQuant (ember/quant/packed.py, PackedLinear.use_int8_dense) needs to know which input
channels run large. The engine learns it once, at start, from one prompt of random token ids
run through its own prefill path: no text ships for it and none is downloaded, and the large
channels of a Llama-family model are much the same whatever the text (docs/benchmarks.md has
the perplexities). The linears' dense bfloat16 weights are shrunk to plain int8 before the
KV cache is allocated (prepare_int8_prefill), the calibration prompt runs on their packed
weights, and the smoothed int8 ones are made from the plain int8: the bfloat16 copies never
sit beside the KV cache, which kept `ember serve` under 1.6 GiB while it starts.

A model split over ranks calibrates on all of them at once: the prompt's steps reach every
rank as any step does, and each rank's RankCalibration records and converts its own part.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from ember.engine.memory import large_blocks_mapped_alone
from ember.errors import ConfigError
from ember.kernels import CpuKernels
from ember.models.llama import LlamaAttention
from ember.quant.packed import PackedLinear
from ember.request import RequestOptions, SamplingParams

log = logging.getLogger(__name__)


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


class RankCalibration:
    """One rank's side of the calibration (the runner calls it on every rank, the driver's
    and its peers', around the calibration prompt's steps): start() records max |x| per
    input channel of the rank's int8_prefill_targets as the prompt's rows pass them, finish()
    makes their SmoothQuant int8 weights from what they saw.

    Where the model is split over ranks every rank runs the same steps, so each sees the
    inputs of its own projections: column-parallel q/k/v and gate/up the whole hidden state
    (the same on every rank, after the all-reduces), row-parallel o and down their slice of
    heads or MLP columns, the same values one process's linears see in those columns. Each
    rank's activation groups are its own linear's (int8_act_group of its inputs), so a group
    never spans two ranks."""

    def __init__(self, model: torch.nn.Module, kernels: CpuKernels | None,
                 max_over_ranks: Callable[[Tensor], None] | None = None) -> None:
        """`max_over_ranks`: an elementwise max over the rank's tensor-parallel group (None:
        the rank holds whole layers)."""
        self.model, self.kernels, self.max_over_ranks = model, kernels, max_over_ranks
        self.groups: dict[PackedLinear, int] = {}
        self.amax: dict[PackedLinear, Tensor] = {}
        self._hooks: list[Any] = []

    def start(self) -> None:
        self.groups, self.amax = int8_prefill_targets(self.model), {}
        self._hooks = [m.register_forward_pre_hook(self._record) for m in self.groups]

    def _record(self, module: PackedLinear, args: tuple[Tensor, ...]) -> None:
        x = args[0]
        if module.dense_rows(x):  # the rows the dense weight takes
            seen = x.detach().abs().amax(dim=0).float()
            self.amax[module] = torch.maximum(self.amax[module], seen) \
                if module in self.amax else seen

    def stop(self) -> None:
        """Stop recording (finish() does, or a calibration that failed)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def finish(self) -> int:
        """Give each target its SmoothQuant int8 weight, made from the int8 copy
        prepare_int8_prefill left, and batched decode steps the same weights. Returns how
        many linears."""
        self.stop()
        missing = [m for m in self.groups if m not in self.amax]
        if missing:
            raise ConfigError(f"int8 prefill matmuls: calibration saw no prompt rows in "
                              f"{len(missing)} linears (a KV cache too small for a prompt?); "
                              "raise --kv-cache-gib, or use --prefill-matmul bfloat16")
        split = split_input_linears(self.model)
        if self.max_over_ranks is not None and \
                getattr(self.model, "head_share", None) is not None:
            self._whole_shared_heads()
        with large_blocks_mapped_alone():
            for module in self.groups:   # the same order on every rank (max_over_ranks)
                whole_input = self.max_over_ranks is not None and module not in split
                module.use_int8_dense(self.kernels, self.amax[module],
                                      act_group=self.groups[module],
                                      max_over_ranks=self.max_over_ranks if whole_input
                                      else None)
        self.model.use_int8_decode()   # batched decode steps on the same int8 weights
        log.info("int8 prompt matmuls: %d linears calibrated%s", len(self.amax),
                 ", batched decode steps on them too" if self.model.int8_decode else "")
        return len(self.amax)

    def _whole_shared_heads(self) -> None:
        """o's maxima in the columns of a KV head this rank shares with another (HeadShare)
        saw only the requests this rank attends there (zeros in the rows of the others; a
        calibration prompt of one request leaves one rank none): each o's maxima, placed in
        the whole model's columns, are maxed over the ranks, so every rank has one process's
        in every column it holds. The same order on every rank (a collective per layer)."""
        share = self.model.head_share
        for attention in self.model.modules():
            if not isinstance(attention, LlamaAttention) or attention.o_proj not in self.amax:
                continue
            mine = self.amax[attention.o_proj]
            per_kv = mine.numel() // share.kv_count   # a KV head's query heads' columns
            start = share.kv_first * per_kv
            whole = mine.new_zeros(share.num_kv_heads * per_kv)
            whole[start:start + mine.numel()] = mine
            self.max_over_ranks(whole)
            self.amax[attention.o_proj] = whole[start:start + mine.numel()].clone()


def split_input_linears(model: torch.nn.Module) -> set[torch.nn.Module]:
    """The row-parallel linears (o and down), whose input each tensor-parallel rank holds a
    slice of, and all of whose output rows it holds; the others (column-parallel) see the
    whole input and hold some of the output rows."""
    return {m for layer in model.model.layers
            for m in (layer.self_attn.o_proj, getattr(layer.mlp, "down_proj", None))
            if m is not None}


def use_int8_prefill(core: Engine) -> int:
    """Calibrate on every rank of the model (RankCalibration, through the runner), running
    one prompt of random token ids through the idle engine (one prefill step when it fits
    the step budget). Returns how many linears the driver's rank gave int8 weights."""
    if core.has_unfinished():
        raise RuntimeError("calibration needs an idle engine")
    room = min(core.max_model_len, core.scheduler.kv.capacity_tokens) - 1  # 1 output token
    prompt = calibration_prompt(core.model_config.vocab_size, min(CALIBRATION_TOKENS, room))
    core.runner.calibrate("start")
    try:
        core.add_request("calibration", prompt, SamplingParams(temperature=0, max_tokens=1),
                         RequestOptions(prefix_cache=False))
        while core.has_unfinished():
            core.step()
    except BaseException:
        core.runner.calibration.stop()
        raise
    return core.runner.calibrate("finish")
