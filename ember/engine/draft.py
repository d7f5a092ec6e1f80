"""The model that drafts for speculative decoding, when one does: the target's first layers
(`--speculative self`) or a separate model of the same vocabulary (`--speculative draft:PATH`),
loaded as the target is, with KV caches of its own laid out like the target's."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ember.config import EngineConfig, ModelConfig
from ember.distributed.collectives import RankCollectives
from ember.distributed.parallel import PipelineStage
from ember.distributed.sharding import stack_all_reduce
from ember.engine.files_summary import load_tokenizer
from ember.errors import ConfigError
from ember.kernels import CpuKernels
from ember.models.attention import PagedKV
from ember.models.llama import LlamaForCausalLM
from ember.runner.drafter import Drafter
from ember.runner.kv_tensors import allocate_kv_caches
from ember.spec.layer_skip import check_draft_layers, default_draft_layers, first_layers
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.loader import (apply_quantization, load_model, open_model_files,
                                  resolve_quantization)

log = logging.getLogger(__name__)


def build_drafter(config: EngineConfig, model: LlamaForCausalLM, kv_caches: list[PagedKV],
                  tokenizer: Tokenizer, dtype: torch.dtype, kernels: CpuKernels | None,
                  num_blocks: int, kv_dtype: str, max_model_len: int,
                  model_path: Path | None = None, whole_config: ModelConfig | None = None,
                  collectives: RankCollectives | None = None,
                  stage: PipelineStage | None = None) -> Drafter | None:
    """The drafter the spec config asks for, or None (no speculation, or n-gram). A draft
    model that is the target's own file (`model_path`) drafts with the target's loaded
    weights, on caches of its own: the same numerics, so its guesses are the target's.

    `whole_config`: the target's, where `model` is only this process's part of it (a model
    split over ranks, whose `collectives` these are, of pipeline `stage`); a draft model
    then runs whole in this process beside it, loaded from its file even where that is the
    target's, and a self-draft on every rank (self_drafter)."""
    spec = config.spec
    block_size, device = config.cache.block_size, torch.device(config.device)
    if spec.proposer == "self":
        num_layers = (whole_config or model.config).num_layers
        log.info("self-draft: the first %d of %d layers draft %d tokens a step%s",
                 spec.self_draft_layers or default_draft_layers(num_layers), num_layers,
                 spec.num_speculative_tokens,
                 "" if collectives is None else ", each rank running its part of them")
        return self_drafter(config, model, kv_caches, kernels, max_model_len, num_layers,
                            collectives, stage)
    if spec.proposer != "draft":
        return None
    path = spec.draft_model_path
    if whole_config is None and model_path is not None and \
            Path(path).resolve() == Path(model_path).resolve():
        caches = allocate_kv_caches(model.config, num_blocks, block_size, dtype, config.device,
                                    kv_dtype)
        log.info("draft model %s is the target's file: it drafts with the target's weights",
                 path)
        return Drafter(model, caches, block_size, device, shares_kv=False,
                       max_positions=max_model_len, by_kind=True)
    files = open_model_files(path)
    draft_config = files.model_config()
    check_vocabulary(whole_config or model.config, draft_config, tokenizer,
                     load_tokenizer(files), path)
    quantization = resolve_quantization(config.quantization, files, draft_config, dtype,
                                        config.device)
    draft = apply_quantization(load_model(files, draft_config, dtype, config.device),
                               quantization, kernels)
    draft.use_kernels(kernels)
    draft.cache_rope(max_model_len, dtype)
    caches = allocate_kv_caches(draft_config, num_blocks, block_size, dtype, config.device,
                                kv_dtype if _reads_int8(kernels, draft_config) else "model")
    log.info("draft model %s (%d layers, weights %s) drafts %d tokens a step", path,
             draft_config.num_layers, quantization, spec.num_speculative_tokens)
    return Drafter(draft, caches, block_size, device, shares_kv=False,
                   max_positions=max_model_len, by_kind=True)


def self_drafter(config: EngineConfig, model: LlamaForCausalLM, kv_caches: list[PagedKV],
                 kernels: CpuKernels | None, max_model_len: int, num_model_layers: int,
                 collectives: RankCollectives | None = None,
                 stage: PipelineStage | None = None) -> Drafter:
    """The target's first layers drafting on their own caches (of a `num_model_layers`-layer
    model). Every rank of a split model builds one of its part (`collectives`: the rank's),
    which runs each draft forward the driver's does, with the same all-reduces and sends as
    the target's layers: a pipeline stage runs those of its layers the draft reaches (maybe
    none: it passes the activations on, or ends the draft with the final norm and the LM
    head). Where the all-reduces go through shared memory, the draft's decode stack calls
    them itself, as the target's does (stack_all_reduce)."""
    num_layers = config.spec.self_draft_layers or default_draft_layers(num_model_layers)
    check_draft_layers(num_layers, num_model_layers)
    if stage is not None:   # this stage's share of them
        num_layers = max(0, min(num_layers - stage.first_layer, stage.num_layers))
    view = first_layers(model, num_layers, kernels)
    if collectives is not None and stage is None:
        collectives.when_bound(lambda all_reduce: stack_all_reduce(view, kernels, all_reduce))
    return Drafter(view, kv_caches[:num_layers], config.cache.block_size,
                   torch.device(config.device), shares_kv=True, max_positions=max_model_len)


def _reads_int8(kernels: CpuKernels | None, config: ModelConfig) -> bool:
    """Whether an int8 cache chosen for the target suits the draft's head size too."""
    return kernels is not None and kernels.attends_head_dim(config.head_dim)


def check_vocabulary(target: ModelConfig, draft: ModelConfig, target_tokenizer: Tokenizer,
                     draft_tokenizer: Tokenizer, path: str) -> None:
    """A draft must name tokens with the target's ids: refuse one that does not."""
    same = target.vocab_size == draft.vocab_size and \
        target_tokenizer.backend.get_vocab(with_added_tokens=True) == \
        draft_tokenizer.backend.get_vocab(with_added_tokens=True)
    if not same:
        raise ConfigError(
            f"draft model {path} has a vocabulary of {draft.vocab_size} ids that differs from "
            f"the target's ({target.vocab_size} ids): a draft must share the target's "
            "tokenizer; choose a smaller model of the same family, or use --speculative self "
            "(the target's first layers) or ngram")
