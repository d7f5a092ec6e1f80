"""Self-draft by layer skip: the target's first layers, its final norm and its LM head make a
shallower model of the same vocabulary that drafts for it, with no weights of its own.

The draft's layers are the target's first L, so at any position the K and V they write are the
ones the target writes there for the same tokens: the draft reads the target's cache for the
context (every position the target has computed) and writes only past the newest token, where
the target's next forward writes again before anything reads it.
"""
from __future__ import annotations

import copy
import dataclasses

from torch import nn

from ember.errors import ConfigError
from ember.kernels import CpuKernels
from ember.models.llama import LlamaForCausalLM, _build_decode_stack

# the default draft depth, as a share of the target's layers. Layers not trained to exit early
# predict poorly from shallow depths: on the default model (30 layers) 8 layers' drafts were
# accepted 1% of the time (4 a step), and with 2 a step 20 layers' 10%, 24 layers' 44%, 27
# layers' 62%, 29 layers' 72% (docs/speculative.md)
DEFAULT_SHARE = 0.9


def default_draft_layers(num_layers: int) -> int:
    """At least one layer, and at least one left out."""
    return max(1, min(num_layers - 1, round(num_layers * DEFAULT_SHARE)))


def check_draft_layers(num_layers: int, total: int) -> None:
    """A self-draft of `num_layers` of a `total`-layer model must leave some out."""
    if not 1 <= num_layers < total:
        raise ConfigError(f"self_draft_layers={num_layers} must be in [1, {total - 1}] for "
                          f"this {total}-layer model; try {default_draft_layers(total)}")


def first_layers(model: LlamaForCausalLM, num_layers: int,
                 kernels: CpuKernels | None) -> LlamaForCausalLM:
    """A view of `model` that runs only its first `num_layers` layers (then the final norm
    and the LM head), sharing every parameter; give its forward the target's first
    `num_layers` KV caches. On a pipeline stage, its share of the draft's layers (from none
    to all of the stage's): the stage still receives, sends on, or ends with the final norm
    and the LM head as the target's does."""
    config = model.config
    sliding = config.sliding_layers[:num_layers] if config.sliding_layers else None
    view = copy.copy(model)
    # nn.Module keeps submodules, parameters and buffers in dicts: copied, so that swapping
    # the layer list in the view leaves the target as it is
    view._modules = dict(model._modules)
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    inner._modules["layers"] = nn.ModuleList(list(model.model.layers[:num_layers]))
    view._modules["model"] = inner
    if num_layers:   # (a config has layers: a stage's view of none keeps the stage's,
        # whose count nothing in a forward reads)
        view.config = dataclasses.replace(config, num_layers=num_layers,
                                          sliding_layers=sliding)
    view.int8_decode = False
    view.decode_stack = None if model.decode_stack is None else \
        _build_decode_stack(view, kernels)
    return view
