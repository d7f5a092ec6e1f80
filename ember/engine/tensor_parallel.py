"""The engine's side of tensor and pipeline parallel: what every rank must agree on (RankSetup,
decided once by the driver), and how a rank builds its part of the model and its runner.

Ranks go stage by stage: rank r is tensor-parallel rank r % T of pipeline stage r // T, and
holds that stage's layers (plan_stages) cut to that rank's heads and columns (plan_shards).

Every rank builds the same way: the rank's tensors cut as they load (each rank then holds
about 1/T of the weights, plus one whole tensor while it loads; under expert parallel the
other ranks' experts are not read at all), packed as in one process
(int4 groups and int8 tiles stay whole: ember/distributed/parallel.py), made
tensor-parallel, then a KV cache of its own KV heads with the same number of blocks on
every rank (the scheduler's block ids mean the same slots everywhere).
"""
from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch

from ember.config import EngineConfig, ModelConfig, ParallelConfig
from ember.distributed.collectives import RankCollectives
from ember.distributed.executor import LocalProcesses, WorkerRanks
from ember.distributed.parallel import (PipelineStage, TensorShard, describe_shards,
                                        describe_stages, plan_shards, plan_stages, rank_cpus,
                                        ray_rank_cpus)
from ember.distributed.sharding import link_stage, lora_part, parallelize, stack_all_reduce
from ember.engine.draft import self_drafter
from ember.engine.memory import (large_blocks_mapped_alone, lazy_zeros, move_to_huge_pages,
                                 temporaries_from_the_heaps)
from ember.engine.calibrate import RankCalibration, prepare_int8_prefill
from ember.errors import ConfigError
from ember.kernels import CpuKernels, load_kernels
from ember.kv_transfer.group import RankPart
from ember.kv_transfer.shm import shared_kv_caches
from ember.lora.ranks import AdapterPart
from ember.models.llama import LlamaForCausalLM
from ember.quant.packed import GROUP, step_weights, use_brgemm_prefill
from ember.runner.kv_tensors import allocate_kv_caches, kv_bytes_per_token
from ember.runner.runner import ModelRunner
from ember.weights.loader import ModelFiles, apply_quantization, load_model, open_model_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSetup:
    """What every rank builds from, decided once by the driver (choices a rank would make on
    its own, such as a measured prefill matmul, could differ between ranks)."""

    config: EngineConfig
    dtype: str               # torch dtype name
    quantization: str
    prefill_matmul: str
    kv_cache_dtype: str      # resolved: "model" or "int8"
    num_blocks: int
    max_model_len: int
    shards: tuple[TensorShard, ...]       # one per rank of a stage
    stages: tuple[PipelineStage, ...]     # (one, of every layer, without pipeline parallel)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def rank_config(self, model: ModelConfig, rank: int) -> ModelConfig:
        """The model as rank `rank` holds it: its stage's layers, its heads and columns."""
        shard = self.shards[rank % len(self.shards)]
        return self.stages[rank // len(self.shards)].local_config(shard.local_config(model))

    def stage(self, rank: int) -> PipelineStage | None:
        """Rank `rank`'s pipeline stage, or None without pipeline parallel."""
        return self.stages[rank // len(self.shards)] if len(self.stages) > 1 else None

    def lora_part(self, rank: int) -> AdapterPart | None:
        """Rank `rank`'s part of a whole LoRA adapter: its stage's layers, its heads and
        columns."""
        num_shards = len(self.shards)
        return lora_part(self.shards[rank % num_shards] if num_shards > 1 else None,
                         self.stages[rank // num_shards] if len(self.stages) > 1 else None)


@dataclass(frozen=True)
class RankPlan:
    """Each rank's part of the model (shard within its stage) and CPUs, stage by stage."""

    shards: list[TensorShard]
    stages: list[PipelineStage]
    cpus: list[tuple[int, ...]] | list[int]   # each rank's CPUs (mp), or CPU count (ray)

    def driver_config(self, model: ModelConfig) -> ModelConfig:
        """The model as rank 0 holds it, whose KV cache needs the most bytes per token of
        any rank's (ranges split unevenly are larger first: the most KV heads, in the stage
        with the most layers): blocks are planned for it."""
        return self.stages[0].local_config(self.shards[0].local_config(model))


def single_process_cpus(parallel: ParallelConfig) -> tuple[int, ...] | None:
    """The CPUs a one-process model is bound to (a one-rank cpu_bind, checked against the
    CPUs this process may use), or None: unbound, or several ranks (plan_ranks binds them)."""
    if parallel.world_size > 1 or parallel.cpu_bind is None:
        return None
    return rank_cpus(parallel, sorted(os.sched_getaffinity(0)))[0]


def plan_ranks(config: EngineConfig, model: ModelConfig, quantization: str) -> RankPlan | None:
    """Each rank's part of the model and its CPUs, or None in one process; a ConfigError
    naming the numbers where the model or this machine cannot take tensor_parallel_size and
    pipeline_parallel_size."""
    size = config.parallel.tensor_parallel_size
    num_stages = config.parallel.pipeline_parallel_size
    if size * num_stages == 1:
        return None
    shards = plan_shards(model, size, config.parallel.expert_parallel,
                         config.parallel.kv_head_split == "shared")
    stages = plan_stages(model.num_layers, num_stages)
    available = sorted(os.sched_getaffinity(0))
    cpus = ray_rank_cpus(config.parallel, available) \
        if config.parallel.distributed_executor == "ray" else rank_cpus(config.parallel, available)
    if quantization == "int4":
        odd = sorted({n for s in shards for n in _input_sizes(s.local_config(model)) if n % GROUP})
        if odd:
            raise ConfigError(f"int4 at tensor_parallel_size={size} gives a rank projections "
                              f"of {odd} inputs, not multiples of {GROUP}; use --quantization "
                              "int8 or another tensor_parallel_size")
    if size > 1:
        log.info("tensor parallel over %d ranks: %s", size, describe_shards(shards, model))
    if num_stages > 1:
        micro = config.parallel.num_micro_batches
        log.info("pipeline parallel over %d stages of %d rank(s): %s; steps cut into up to "
                 "%d micro-batches, so a stage idles %.0f%% of a step of %d or more requests "
                 "((P-1)/(M+P-1)), %.0f%% of one request's ((P-1)/P); "
                 "ember_pipeline_bubble_ratio reports it as served", num_stages, size,
                 describe_stages(stages), micro, 100 * (num_stages - 1) / (micro + num_stages - 1),
                 micro, 100 * (num_stages - 1) / num_stages)
    return RankPlan(shards, stages, cpus)


def _input_sizes(local: ModelConfig) -> tuple[int, ...]:
    """The input sizes of a rank's packed projections: q/k/v and gate/up take the hidden
    state, o its query heads, down its MLP columns."""
    return (local.hidden_size, local.q_size, local.intermediate_size,
            *((local.moe_intermediate_size,) if local.moe_intermediate_size else ()))


def start_ranks(setup: RankSetup, cpus: list[tuple[int, ...]] | list[int]) -> WorkerRanks:
    """Start ranks 1..T*P-1 loading their parts (this process is rank 0): local processes on
    `cpus` (each rank's CPUs), or Ray actors of `cpus` (each rank's CPU count)."""
    widths = [s.vocab[1] - s.vocab[0] for s in setup.shards]
    parallel = setup.config.parallel
    if parallel.distributed_executor == "ray":
        from ember.distributed.ray_executor import RayActors   # ray loads only for it
        return RayActors(cpus, widths, parallel.collective_timeout_s, build_worker_runner,
                         setup, parallel.all_reduce, len(setup.shards), parallel.ray_address,
                         parallel.ray_placement_timeout_s)
    return LocalProcesses(cpus, widths, parallel.collective_timeout_s, build_worker_runner,
                          setup, parallel.all_reduce, stage_size=len(setup.shards))


def load_rank_model(files: ModelFiles, model_config: ModelConfig, setup: RankSetup,
                    rank: int, kernels: CpuKernels | None,
                    collectives: RankCollectives) -> LlamaForCausalLM:
    """Rank `rank`'s part of the model, packed, tensor-parallel, linked to the stages beside
    its own, and ready to step."""
    num_shards = len(setup.shards)
    shard = setup.shards[rank % num_shards] if num_shards > 1 else None
    stage = setup.stages[rank // num_shards] if len(setup.stages) > 1 else None
    config = setup.config
    with large_blocks_mapped_alone():
        model = load_model(files, model_config, setup.torch_dtype, config.device, shard, stage)
        with temporaries_from_the_heaps():
            model = apply_quantization(model, setup.quantization, kernels)
        if shard is not None:
            parallelize(model, shard, collectives)
        if stage is not None:
            link_stage(model, stage, collectives, rank == 0, model_config.vocab_size)
        move_to_huge_pages(step_weights(model))
    # the whole-model decode stack waits for the ranks' all-reduce (stack_all_reduce)
    model.use_kernels(kernels)
    if shard is not None and stage is None:
        collectives.when_bound(lambda all_reduce: stack_all_reduce(model, kernels, all_reduce))
    model.rows_by_kind = True
    model.batch_invariant = config.deterministic
    model.cache_rope(setup.max_model_len, setup.torch_dtype)
    if setup.prefill_matmul == "int8":   # bfloat16 copies out before the KV cache comes
        prepare_int8_prefill(model)   # (calibrated with the driver: RankCalibration)
    elif setup.prefill_matmul == "bfloat16-brgemm":
        use_brgemm_prefill(model, kernels)
    return model


def build_worker_runner(setup: RankSetup, rank: int,
                        collectives: RankCollectives) -> ModelRunner:
    """A worker rank's runner (in its own process): its part of the model and its KV cache."""
    config = setup.config
    files = open_model_files(config.model)
    model_config = files.model_config()
    kernels = load_kernels(config.kernels, config.device)
    model = load_rank_model(files, model_config, setup, rank, kernels, collectives)
    del files
    gc.collect()
    rank_config = setup.rank_config(model_config, rank)
    shared = None
    if config.kv_transfer.role != "both":   # the driver moves this rank's blocks: shared
        kv_caches, shared = shared_kv_caches(rank_config, setup.num_blocks,
                                             config.cache.block_size, setup.torch_dtype,
                                             setup.kv_cache_dtype)
    else:
        kv_caches = allocate_kv_caches(rank_config, setup.num_blocks, config.cache.block_size,
                                       setup.torch_dtype, config.device, setup.kv_cache_dtype,
                                       zeros=lazy_zeros)
    # a self-draft's layers are split as the target's: this rank runs its part of each draft
    drafter = self_drafter(config, model, kv_caches, kernels, setup.max_model_len,
                           model_config.num_layers, collectives, setup.stage(rank)) \
        if config.spec.proposer == "self" else None
    runner = ModelRunner(model, kv_caches, config.cache.block_size, config.device, config.seed,
                         kernels, drafter=drafter, batch_invariant=config.deterministic,
                         vocab_size=0, micro_batches=config.parallel.num_micro_batches,
                         lora_part=setup.lora_part(rank),
                         calibration=RankCalibration(model, kernels,
                                                     collectives.all_reduce_max
                                                     if len(setup.shards) > 1 else None))
    runner.kv_shared = shared   # (held: its memory file stays open as long as the rank)
    return runner


def rank_parts(setup: RankSetup) -> list[RankPart]:
    """Which layers and KV heads each rank's cache holds, rank by rank (stage by stage)."""
    return [RankPart(stage.first_layer, stage.end_layer, *shard.kv_heads)
            for stage in setup.stages for shard in setup.shards]


def describe_kv_gain(model: ModelConfig, plan: RankPlan, dtype: torch.dtype,
                     kv_cache_dtype: str) -> str:
    """How many more tokens the ranks' KV caches hold than one process's in the same memory
    per rank: the widest rank's KV heads and layers set the blocks every rank allocates."""
    whole = kv_bytes_per_token(model, dtype, kv_cache_dtype)
    widest = kv_bytes_per_token(plan.driver_config(model), dtype, kv_cache_dtype)
    heads = [s.kv_heads[1] - s.kv_heads[0] for s in plan.shards]
    layers = [s.num_layers for s in plan.stages]
    return (f"each rank caches its own KV heads ({'+'.join(map(str, heads))} of "
            f"{model.num_kv_heads}) of its stage's layers ({'+'.join(map(str, layers))} of "
            f"{model.num_layers}): {whole / widest:.2f}x the tokens of one process in the "
            "same memory per rank")
