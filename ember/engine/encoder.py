"""Encoder models (BERT-style) in the engine: embeddings only, on the same scheduler.

The scheduler admits each prompt whole (an encoder attends both ways, so a prompt cannot be
split across steps) under the usual token budget, raised to at least max_model_len so any
prompt fits one step. Its KV blocks are bookkeeping only: EncoderRunner runs each step's
prompts in one padded forward and pools them, and nothing is cached.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ember.config import EngineConfig
from ember.engine.embed import resolve_pooling
from ember.errors import ConfigError, ModelLoadError
from ember.kv.kv_manager import KVCacheManager, cdiv
from ember.models.bert import ENCODER_ARCHITECTURES, BertConfig, BertEncoder, hf_name_to_ember
from ember.runner.pooling import finish_vector, pool_padded
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler
from ember.weights.loader import ModelFiles, resolve_dtype
from ember.weights.safetensors import SafetensorsFolder, read_json

log = logging.getLogger(__name__)


def is_encoder(files: ModelFiles) -> bool:
    return isinstance(files, SafetensorsFolder) and \
        (files.config.get("architectures") or [""])[0] in ENCODER_ARCHITECTURES


@dataclass(frozen=True)
class Encoder:
    """What EngineCore holds for an encoder model."""

    model_config: BertConfig
    dtype: torch.dtype
    max_model_len: int
    pooling: str
    scheduler: Scheduler
    runner: "EncoderRunner"


def build_encoder(config: EngineConfig, files: SafetensorsFolder) -> Encoder:
    model_config = BertConfig.from_hf(files.config)
    if config.task != "embed":
        raise ConfigError(f"{files.path.name} is an encoder ({model_config.architecture}): it "
                          "computes embeddings and generates no text; start it with --task "
                          "embed")
    max_model_len = _max_model_len(config, files, model_config)
    sched = config.scheduler
    if sched.max_num_batched_tokens < max_model_len:  # every prompt must fit one step whole
        log.info("token budget raised from %d to max_model_len=%d: an encoder runs each "
                 "prompt in one step", sched.max_num_batched_tokens, max_model_len)
        sched = replace(sched, max_num_batched_tokens=max_model_len)
    block_size = config.cache.block_size
    num_blocks = cdiv(sched.max_num_batched_tokens, block_size) + sched.max_num_seqs
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    dtype = resolve_dtype(config.dtype, config.device)
    model = load_encoder(files, model_config, dtype, config.device)
    return Encoder(model_config, dtype, max_model_len,
                   resolve_pooling(config.pooling, files.path, encoder=True),
                   Scheduler(sched, kv, max_model_len, whole_prompts=True),
                   EncoderRunner(model, config.device))


def _max_model_len(config: EngineConfig, files: SafetensorsFolder, model: BertConfig) -> int:
    """The asked length, else sentence-transformers' max_seq_length if the folder has one,
    else the model's positions."""
    limit = model.context_limit()
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's "
                              f"{limit} positions; lower it or leave it unset")
        return config.max_model_len
    st_config = files.path / "sentence_bert_config.json"
    declared = read_json(st_config).get("max_seq_length") if st_config.is_file() else None
    return min(int(declared), limit) if declared else limit


def load_encoder(files: SafetensorsFolder, config: BertConfig, dtype: torch.dtype,
                 device: str) -> BertEncoder:
    with torch.device("meta"):
        model = BertEncoder(config)
    state = {}
    for name, tensor in files.tensors(None):
        ours = hf_name_to_ember(name)
        if ours is not None:
            state[ours] = tensor.to(device=device, dtype=dtype)
    expected = dict(model.named_parameters())
    missing, unexpected = expected.keys() - state.keys(), state.keys() - expected.keys()
    if missing or unexpected:
        raise ModelLoadError(f"model files do not match the BERT layout: missing "
                             f"{sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(state[name].shape)} but the "
                                 f"config implies {tuple(param.shape)}; the files disagree")
    model.load_state_dict(state, assign=True)
    return model.eval()


class EncoderRunner:
    """RunnerOutput of a step of whole prompts: each pooled into its vector."""

    def __init__(self, model: BertEncoder, device: str) -> None:
        self.model = model
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        items = plan.scheduled
        if not items:
            return RunnerOutput()
        for item in items:
            if item.start != 0 or item.end != item.request.num_prompt_tokens or \
                    item.request.pooling is None:
                raise RuntimeError(f"the encoder was given part of {item.request.request_id}; "
                                   "its prompts must be scheduled whole")
        lengths = [item.num_new_tokens for item in items]
        ids = torch.zeros(len(items), max(lengths), dtype=torch.long)
        for row, item in enumerate(items):
            ids[row, :lengths[row]] = torch.tensor(item.request.prompt_token_ids)
        length_t = torch.tensor(lengths, device=self.device)
        hidden = self.model(ids.to(self.device), length_t)
        pooled = _pool_by_method(hidden, length_t, [i.request.pooling.method for i in items])
        return RunnerOutput(pooled={
            item.request.request_id: finish_vector(vector, item.request.pooling.dimensions)
            for item, vector in zip(items, pooled)})


def _pool_by_method(hidden: Tensor, lengths: Tensor, methods: list[str]) -> Tensor:
    """[B, L, hidden] -> [B, hidden] float32, each row pooled by its own method."""
    out = hidden.new_empty(hidden.shape[0], hidden.shape[2], dtype=torch.float32)
    for method in set(methods):
        rows = torch.tensor([i for i, m in enumerate(methods) if m == method],
                            device=hidden.device)
        out[rows] = pool_padded(hidden[rows], lengths[rows], method)
    return out
