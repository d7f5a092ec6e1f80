"""EngineCore: requests in, one step at a time. No threads and no I/O of its own (a replica
that moves KV to or from others hands that to its connector, ember/kv_transfer/).

    step() = schedule -> execute -> update
"""
from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ember.config import EngineConfig, ModelConfig
from ember.engine.calibrate import RankCalibration, prepare_int8_prefill, use_int8_prefill
from ember.engine.cold_start import PhaseClock
from ember.engine.draft import build_drafter
from ember.engine.embed import EMBED_PARAMS, check_embedding_input, resolve_pooling
from ember.engine.encoder import build_encoder, is_encoder
from ember.engine.memory import (advise_huge_pages, fault_in, huge_page_copies,
                                 large_blocks_mapped_alone, lazy_zeros, move_to_huge_pages,
                                 return_free_memory, temporaries_from_the_heaps)
from ember.distributed.executor import Executor, SingleProcess, WorkerRanks
from ember.engine.tensor_parallel import (RankPlan, RankSetup, describe_kv_gain,
                                          load_rank_model, plan_ranks, rank_parts,
                                          single_process_cpus, start_ranks)
from ember.errors import ConfigError, ContextTooLong, EngineDead, InvalidRequest
from ember.kernels import CpuKernels, load_kernels
from ember.kv.kv_manager import KVCacheManager
from ember.kv.prefix_cache import adapter_salt, prompt_block_keys
from ember.kv_transfer.blocks import cache_tensors
from ember.kv_transfer.connector import KVConnector
from ember.kv_transfer.params import Export, KVFormat, RemotePrefill
from ember.kv_transfer.group import RankKV, RankPart
from ember.kv_transfer.shm import GroupSegments, SharedKV, shared_kv_caches
from ember.lora.registry import LoraRegistry
from ember.quant.packed import step_weights, use_brgemm_prefill
from ember.request import (FinishReason, PoolingParams, Request, RequestOptions,
                           SampledLogprob, SamplingParams)
from ember.runner.kv_tensors import (GIB, allocate_kv_caches, kv_bytes_per_token, plan_num_blocks,
                                    resolve_kv_cache_dtype)
from ember.runner.runner import ModelRunner
from ember.sampling.grammar import Grammars
from ember.scheduler.output import KVLoad
from ember.scheduler.scheduler import Scheduler
from ember.weights.cache import SUMMARIES, WeightCache, cache_key
from ember.weights.gguf import GGUFFile
from ember.weights.safetensors import SafetensorsFolder
from ember.engine.files_summary import FilesSummary, load_tokenizer, open_summarized
from ember.engine.prefill_choice import PrefillChoice, resolve_prefill_choice
from ember.models.llama import LlamaForCausalLM
from ember.weights.loader import (ModelFiles, apply_quantization, load_model, open_model_files,
                                  resolve_dtype, resolve_quantization)

log = logging.getLogger(__name__)


class StepFailed(Exception):
    """A step raised. `request_ids` are the requests that may have caused it (those it
    scheduled, or every unfinished one when planning itself failed); the engine's state is as
    before the step, so the step can be tried again without some of them."""

    def __init__(self, request_ids: list[str], error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.request_ids = request_ids
        self.error = error


def resolve_max_model_len(config: EngineConfig, model: ModelConfig,
                          kv_capacity_tokens: int | None = None) -> int:
    """The longest sequence served: the model's context or the asked length, clipped to what
    the KV cache holds when its capacity is known (a longer request could never run)."""
    limit = model.context_limit()
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's context of "
                          f"{limit} tokens; lower it or leave it unset")
    max_model_len = limit if config.max_model_len is None else config.max_model_len
    if kv_capacity_tokens is not None and max_model_len > kv_capacity_tokens:
        log.warning("max_model_len lowered from %d to %d tokens, all the KV cache holds; raise "
                    "--kv-cache-gib to serve longer sequences", max_model_len, kv_capacity_tokens)
        return kv_capacity_tokens
    return max_model_len


@dataclass(frozen=True)
class CacheInfo:
    """What the KV cache came to, reported at start-up."""

    num_blocks: int
    block_size: int
    bytes_per_token: int
    dtype: str = "float32"

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        gib = self.num_tokens * self.bytes_per_token / GIB
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
                f"{self.num_tokens} tokens ({gib:.2f} GiB of {self.dtype}, "
                f"{self.bytes_per_token} bytes/token)")


class EngineCore:
    task = "generate"  # config.task once loaded (the calibration run generates, whatever it is)
    # the ranks the model runs on (engine/tensor_parallel.py); one process unless started
    # with tensor_parallel_size > 1 (a core built without __init__ sets its own)
    executor: Executor
    weight_cache: WeightCache | None = None
    kv_connector: KVConnector | None = None   # a prefill or decode replica's (--role)
    idle_step = False  # the last step had nothing to compute (requests wait on copies)

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.load_phases = PhaseClock()
        # a one-process --cpu-bind pins before anything starts threads (kernels, loading)
        self.executor = SingleProcess(single_process_cpus(config.parallel))
        files = open_model_files(config.model) if config.weight_cache_dir is None else \
            open_summarized(config.model, Path(config.weight_cache_dir) / SUMMARIES)
        self.model_path = files.path
        if is_encoder(files):  # BERT-style: embeddings only, no KV cache (engine/encoder.py)
            self._init_encoder(config, files)
            return
        self.model_config = files.model_config()
        self.tokenizer = load_tokenizer(files)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        gguf = isinstance(files, (GGUFFile, FilesSummary))   # (summaries are of GGUFs)
        self.pooling = resolve_pooling(config.pooling, None if gguf else files.path,
                                       encoder=False)
        self.quantization = resolve_quantization(config.quantization, files, self.model_config,
                                                 self.dtype, config.device)
        ranks = plan_ranks(config, self.model_config, self.quantization)  # None: one process
        self.load_phases.mark("files")
        kernels = load_kernels(config.kernels, config.device)
        self.load_phases.mark("kernels")
        self.kernels = kernels   # compiled CPU kernels, or None (the torch path)
        cache_dir = None if config.weight_cache_dir is None or \
            torch.device(config.device).type != "cpu" else Path(config.weight_cache_dir)
        # decided here, before any rank binds its CPUs, for the ranks as for one process: the
        # whole model's shapes on this process's threads, kept under the same key
        self.prefill_choice = resolve_prefill_choice(config.prefill_matmul, self.quantization,
                                                     kernels, self.model_config,
                                                     self.model_path, cache_dir)
        self.prefill_matmul = self.prefill_choice.prefill_matmul
        self.load_phases.mark("prefill_choice")
        block_size = config.cache.block_size
        kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.quantization,
                                          self.dtype, self.model_config.head_dim, kernels)
        # a rank's cache holds its KV heads of its stage's layers, rank 0 the most of any:
        # blocks are planned for it
        rank_config = self.model_config if ranks is None else \
            ranks.driver_config(self.model_config)
        num_blocks = plan_num_blocks(rank_config, config.cache, self.dtype, kv_dtype)
        if ranks is None:
            model = self._load_model(files, kernels)
        else:
            model = self._start_ranks(files, kernels, ranks, kv_dtype, num_blocks)
        del files  # the file's metadata (~170 MB of Python objects for a GGUF) goes now,
        if not self.weights_cached:  # before the KV cache is allocated: loading peaks lower
            gc.collect()  # (a cached model left little garbage; a collection costs ~0.15 s)
            return_free_memory()
        self.max_model_len = resolve_max_model_len(config, self.model_config,
                                                   num_blocks * block_size)
        self.cache_info = CacheInfo(num_blocks, block_size,
                                    kv_bytes_per_token(rank_config, self.dtype, kv_dtype),
                                    kv_dtype if kv_dtype != "model" else
                                    str(self.dtype).removeprefix("torch."))
        log.info("loaded %s (%s, %s, weights %s, prefill matmuls %s, %s kernels, on %s); %s",
                 self.model_path.name, self.model_config.architecture,
                 str(self.dtype).removeprefix("torch."), self.quantization,
                 self.prefill_choice.describe(),
                 "compiled CPU" if kernels is not None else "torch",
                 config.device, self.cache_info.describe())
        if ranks is not None:
            log.info("parallel: the KV cache above is each rank's; %s",
                     describe_kv_gain(self.model_config, ranks, self.dtype, kv_dtype))
        shared = None
        if config.kv_transfer.exports and torch.device(config.device).type == "cpu":
            # decode replicas on this host map it (kv_transfer/shm.py)
            kv_caches, shared = shared_kv_caches(rank_config, num_blocks, block_size,
                                                 self.dtype, kv_dtype)
        else:
            kv_caches = allocate_kv_caches(rank_config, num_blocks, block_size, self.dtype,
                                           config.device, kv_dtype, zeros=lazy_zeros)
        kv = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching,
                            config.cache.eviction_policy,
                            self.model_config.window_of_every_layer(),
                            share_generated=False, max_events=config.cache.max_kv_events)
        self.scheduler = Scheduler(config.scheduler, kv, self.max_model_len, config.spec)
        self.loras = LoraRegistry(self.model_config, config.max_loras, config.max_lora_rank)
        self.loras.in_use = self._loras_in_use
        drafter = build_drafter(config, model, kv_caches, self.tokenizer, self.dtype, kernels,
                                num_blocks, kv_dtype, self.max_model_len, self.model_path,
                                None if ranks is None else self.model_config,
                                None if ranks is None else self.executor.collectives,
                                None if ranks is None else self.rank_setup.stage(0))
        peers = None
        if isinstance(self.executor, WorkerRanks):
            self.executor.connect()   # the other ranks have loaded their parts
            peers = self.executor
            if self.quantization == "int4" and kernels is not None:
                log.info("model parallel: %s", "decode steps run in the whole-model decode "
                         "stack, which all-reduces through shared memory itself"
                         if model.decode_stack is not None else "steps run layer by layer "
                         "(the whole-model decode stack needs the shared-memory all-reduce "
                         "and one pipeline stage)")
        self._init_kv_transfer(kv_caches, shared)   # (after connect: the ranks' caches)
        # column-parallel linears take the whole weight's maxima when calibrating
        max_over_ranks = peers.collectives.all_reduce_max \
            if peers is not None and config.parallel.tensor_parallel_size > 1 else None
        # a step's LoRA factors in huge pages: read every step, a TLB miss per 4 KiB page else
        self.runner = ModelRunner(model, kv_caches, block_size, config.device, config.seed,
                                  kernels, self.loras, config.spec, drafter, huge_page_copies,
                                  batch_invariant=config.deterministic, peers=peers,
                                  vocab_size=self.model_config.vocab_size,
                                  micro_batches=config.parallel.num_micro_batches,
                                  num_stages=config.parallel.pipeline_parallel_size,
                                  lora_part=None if ranks is None else
                                  self.rank_setup.lora_part(0),
                                  calibration=RankCalibration(model, kernels,
                                                              max_over_ranks))
        for name, path in config.loras:
            self.loras.add(name, path)
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.load_phases.mark("kv_cache")
        if self.prefill_matmul == "int8" and self.weights_cached:
            model.use_int8_decode()   # the cached int8 weights are calibrated already
        elif self.prefill_matmul == "int8":  # SmoothQuant int8 from a calibration prompt
            use_int8_prefill(self)   # on every rank
            gc.collect()
            return_free_memory()
        self.load_phases.mark("calibrate")
        if self.weight_cache is not None and not self.weights_cached:
            self.weight_cache.save(model, self.model_path)
            return_free_memory()
            self.load_phases.mark("cache_write")
        self.task = config.task

    def _load_model(self, files: ModelFiles, kernels: CpuKernels | None) -> LlamaForCausalLM:
        """The whole model in this process: from the weight cache where it holds it, else
        loaded and packed; ready to step (decode stack, RoPE tables, prompt matmuls)."""
        config = self.config
        weight_cache = self._weight_cache(kernels)
        model = None if weight_cache is None else weight_cache.load(self.model_config, kernels)
        self.weight_cache = weight_cache
        self.weights_cached = model is not None   # final weights mapped: no calibration
        with large_blocks_mapped_alone():  # weights and load temporaries in separate mappings
            if model is None:
                model = load_model(files, self.model_config, self.dtype, config.device)
                with temporaries_from_the_heaps():
                    model = apply_quantization(model, self.quantization, kernels)
            move_to_huge_pages(step_weights(model))
        model.use_kernels(kernels)  # (the decode stack takes the weights where they are now)
        model.rows_by_kind = True   # the runner keeps prompt and decode rows apart
        model.batch_invariant = config.deterministic
        self.load_phases.mark("weights")
        model.cache_rope(self.max_model_len, self.dtype)
        if self.prefill_matmul == "int8" and not self.weights_cached:  # bfloat16 copies out
            # before the KV cache comes
            prepare_int8_prefill(model)
        elif self.prefill_matmul == "bfloat16-brgemm" and not self.weights_cached:
            use_brgemm_prefill(model, kernels)
        return model

    def _start_ranks(self, files: ModelFiles, kernels: CpuKernels | None,
                     ranks: RankPlan, kv_dtype: str, num_blocks: int) -> LlamaForCausalLM:
        """Start the other ranks loading their parts (engine/tensor_parallel.py), then load
        rank 0's here; connected to them once the KV cache is allocated. No weight cache:
        each rank's part is loaded afresh."""
        setup = RankSetup(self.config, str(self.dtype).removeprefix("torch."),
                          self.quantization, self.prefill_matmul, kv_dtype, num_blocks,
                          self.max_model_len, tuple(ranks.shards), tuple(ranks.stages))
        self.weight_cache, self.weights_cached = None, False
        self.rank_setup = setup   # what every rank built from
        self.executor = start_ranks(setup, ranks.cpus)
        try:
            model = load_rank_model(files, self.model_config, setup, 0, kernels,
                                    self.executor.collectives)
        except BaseException:
            self.executor.shutdown()
            raise
        self.load_phases.mark("weights")
        return model

    def check_alive(self) -> None:
        """Raise EngineDead if a rank of the model has gone (between steps)."""
        self.executor.check_alive()

    def close(self) -> None:
        """Stop the model's other ranks, if any, and the KV connector's workers (the engine
        steps no more)."""
        self.executor.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.close()

    def _init_kv_transfer(self, kv_caches: list, shared) -> None:
        """A prefill or decode replica's connector (--role); none for `both`."""
        self.exports: dict[str, Export] = {}          # saved by the last steps, by request
        self._remotes: dict[str, RemotePrefill] = {}  # decode requests' prefill replicas
        transfer = self.config.kv_transfer
        if transfer.role == "both":
            return
        if self.model_config.window_of_every_layer() is not None:
            raise ConfigError(f"--role {transfer.role}: {self.model_path.name} has a sliding "
                              "window, whose blocks are freed as the window passes; serve it "
                              "with --role both")
        fmt = KVFormat(self.model_path.name, self.cache_info.dtype, self.cache_info.block_size,
                       self.model_config.num_layers, self.model_config.num_kv_heads,
                       self.model_config.head_dim)
        group, segments = self._kv_group(cache_tensors(kv_caches), shared)
        self.kv_connector = KVConnector(transfer, group, fmt, segments, self.kernels)

    def _kv_group(self, tensors: list[torch.Tensor], shared: SharedKV | None
                  ) -> tuple[list[RankKV], list[dict] | None]:
        """This replica's ranks' caches (this process's, then the workers', mapped here) and
        where other processes map each (None where this one's is not shared)."""
        if not isinstance(self.executor, WorkerRanks):
            whole = RankPart(0, self.model_config.num_layers, 0, self.model_config.num_kv_heads)
            return [RankKV(whole, tensors)], None if shared is None else [shared.describe()]
        workers = self.executor.kv_segments()
        self._worker_kv = GroupSegments(workers)   # mapped as long as the engine lives
        parts = rank_parts(self.rank_setup)
        group = [RankKV(parts[0], tensors)] + [
            RankKV(part, rank_tensors)
            for part, rank_tensors in zip(parts[1:], self._worker_kv.tensors)]
        return group, None if shared is None else [shared.describe(), *workers]

    def advise_kv_huge_pages(self) -> None:
        """Ask for huge pages under the KV cache (engine/memory.py); called after the
        warm-up, whose first block touches every layer, head, K and V: on 2 MiB pages that
        faulted in ~600 MB of zeros, 0.6-0.9 s of a start's CPU. The pages it touched stay
        small until the kernel merges them."""
        advise_huge_pages(self._kv_tensors())

    def kv_pages_to_fault(self) -> Iterator[None]:
        """The KV cache's pages not yet in memory, faulted in one huge page per next()
        (engine/memory.py's fault_in), for an idle engine to step through; none off the
        CPU."""
        tensors = self._kv_tensors()
        if not tensors or tensors[0].device.type != "cpu":
            return iter(())
        planes = tensors[0].shape[0] * tensors[0].shape[1]   # K/V x kv_heads
        return fault_in(tensors, planes)

    def _kv_tensors(self) -> list[torch.Tensor]:
        """Every layer's KV cache tensors (values, and scales where int8); none where the
        runner keeps no cache."""
        caches = getattr(self.runner, "kv_caches", None) or []
        return [t for kv in caches for t in (kv.data, kv.scale) if t is not None]

    def _init_encoder(self, config: EngineConfig, files: SafetensorsFolder) -> None:
        if config.parallel.world_size > 1:
            raise ConfigError(f"{self.model_path.name} is an encoder, which runs in one "
                              "process; use tensor_parallel_size=1 and "
                              "pipeline_parallel_size=1")
        encoder = build_encoder(config, files)
        self.tokenizer = load_tokenizer(files)
        self.model_config, self.dtype = encoder.model_config, encoder.dtype
        self.max_model_len, self.pooling = encoder.max_model_len, encoder.pooling
        self.quantization, self.kernels, self.prefill_matmul = "none", None, "none"
        self.prefill_choice = PrefillChoice("none", "an encoder")
        kv = encoder.scheduler.kv
        self.cache_info = CacheInfo(kv.num_blocks, kv.block_size, 0, "none")
        self.scheduler, self.runner = encoder.scheduler, encoder.runner
        if config.loras:
            raise ConfigError(f"{self.model_path.name} is an encoder; LoRA adapters are served "
                              "on decoder models")
        if config.kv_transfer.role != "both":
            raise ConfigError(f"{self.model_path.name} is an encoder: it keeps no KV to hand "
                              "over; serve it with --role both")
        self.loras = LoraRegistry(self.model_config)  # none: an encoder runs no adapter
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)
        self.task = config.task
        log.info("loaded %s (%s encoder, %s, on %s); embeddings pooled by %s, at most %d "
                 "tokens", self.model_path.name, self.model_config.architecture,
                 str(self.dtype).removeprefix("torch."), config.device, self.pooling,
                 self.max_model_len)

    def _weight_cache(self, kernels: CpuKernels | None) -> WeightCache | None:
        """This model's cache on disk (ember/weights/cache.py), where one is configured and
        the weights live on the CPU."""
        if self.config.weight_cache_dir is None or \
                torch.device(self.config.device).type != "cpu":
            return None
        choices = {"dtype": str(self.dtype), "quantization": self.quantization,
                   "prefill_matmul": self.prefill_matmul}
        return WeightCache(Path(self.config.weight_cache_dir),
                           cache_key(self.model_path, self.config, choices, kernels))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    options: RequestOptions = RequestOptions(),
                    grammar: object | None = None, export_kv: bool = False,
                    remote: RemotePrefill | None = None) -> Request:
        """Validate and queue one sequence. Raises InvalidRequest subclasses at once.

        A constrained request's grammar is compiled here unless the caller compiled it
        already (the server does, off the engine thread). With `export_kv` (a prefill
        replica), only the prompt and its first token are computed, and the blocks are kept
        for a decode replica (self.exports); with `remote` (a decode replica), the prompt's
        KV comes from the prefill replica that sampled its first token.
        """
        max_tokens = self.check_request(prompt_token_ids, params)
        if params.constraint is not None and grammar is None:
            grammar = self.grammars.compile(params.constraint)
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_ids=self.tokenizer.eos_token_ids, max_tokens=max_tokens,
                          priority=options.priority, user=options.user,
                          cache_salt=self._salt(options), prefix_cache=options.prefix_cache,
                          grammar=grammar, lora=options.lora)
        if export_kv:
            self._prepare_export(request)
        if remote is not None:
            self._prepare_import(request, remote)
        self._queue(request)
        return request

    # -- disaggregated serving (ember/kv_transfer/) -----------------------------------------

    def _prepare_export(self, request: Request) -> None:
        """A prefill replica's request: the prompt and one token; its blocks are kept if
        more tokens are to come."""
        if self.kv_connector is None or not self.config.kv_transfer.exports:
            raise InvalidRequest(f"this replica runs --role {self.config.kv_transfer.role}; "
                                 "send do_remote_decode to a --role prefill replica",
                                 param="kv_transfer_params")
        request.keep_blocks = request.max_tokens > 1
        request.max_tokens = 1

    def _prepare_import(self, request: Request, remote: RemotePrefill) -> None:
        """A decode replica's request: it goes on from the prefill replica's first token;
        the prompt's KV is pulled when it is admitted, or computed here if it cannot be."""
        if self.kv_connector is None or not self.config.kv_transfer.imports:
            raise InvalidRequest(f"this replica runs --role {self.config.kv_transfer.role}; "
                                 "send do_remote_prefill to a --role decode replica",
                                 param="kv_transfer_params")
        first = remote.export.first_token_id
        if not 0 <= first < self.model_config.vocab_size:
            raise InvalidRequest(f"first_token_id={first} is outside the vocabulary",
                                 param="kv_transfer_params.first_token_id")
        request.append_output(first)
        if request.params.logprobs is not None:   # (the prefill replica reported its own)
            request.output_logprobs.append(SampledLogprob(0.0))
        if self.scheduler.stop_reason(request) is not None:
            raise InvalidRequest("the first token ends this request; the prefill replica's "
                                 "answer is the whole answer", param="kv_transfer_params")
        reason = self._import_problem(request, remote)
        if reason is not None:
            self.kv_connector.fallback(remote, reason, request.request_id)
            return
        request.num_external_tokens = request.num_prompt_tokens
        self._remotes[request.request_id] = remote

    def _import_problem(self, request: Request, remote: RemotePrefill) -> str | None:
        """Why the prompt's KV cannot come from `remote`: None if it can."""
        export = remote.export
        if export.kv_format != self.kv_connector.kv_format:
            return "incompatible"
        if export.num_tokens != request.num_prompt_tokens or len(export.block_ids) != \
                len(export.block_keys) or list(export.block_keys) != prompt_block_keys(
                    request.prompt_token_ids, self.cache_info.block_size, request.cache_salt):
            return "prompt_mismatch"
        return None   # (expiry is the prefill replica's to judge, on its own clock)

    def move_kv(self) -> bool:
        """Apply what the connector did meanwhile: free the blocks of pins that ended, and
        send requests whose copies ended on to decode (or to compute what failed). Whether
        anything changed."""
        if self.kv_connector is None:
            return False
        unpinned = self.kv_connector.take_releasable()
        for block_ids in unpinned:
            self.scheduler.kv.release_blocks(list(block_ids))
        finished = self.kv_connector.take_finished()
        for request_id, loaded in finished:
            remote = self._remotes.pop(request_id, None)
            request = self.scheduler.loading.get(request_id)
            if loaded and request is not None and remote is not None:
                request.num_cached_tokens = remote.export.num_cached_tokens
            self.scheduler.end_load(request_id, loaded)
        return bool(unpinned or finished)

    def _start_loads(self, loads: list[KVLoad]) -> None:
        for load in loads:
            remote = self._remotes[load.request_id]
            if load.first_block >= len(load.block_ids):   # all cached here: nothing to pull
                del self._remotes[load.request_id]
                self.scheduler.requests[load.request_id].num_cached_tokens = \
                    remote.export.num_cached_tokens
            self.kv_connector.start_load(load, remote)

    def _save(self, kept: list[tuple[Request, list[int]]]) -> None:
        for request, block_ids in kept:
            self.exports[request.request_id] = self.kv_connector.save(request, block_ids)

    def _salt(self, options: RequestOptions) -> str | None:
        """The request's prefix-cache salt: an adapter's KV is its own, never shared with
        other weights or the base; salted by the digest of its files, which every replica
        and the router compute alike (its adapter is made resident here)."""
        if options.lora is None:
            return options.cache_salt
        return adapter_salt(self.loras.acquire(options.lora).digest, options.cache_salt)

    def _queue(self, request: Request) -> None:
        self.scheduler.add(request)

    def add_embedding(self, request_id: str, prompt_token_ids: list[int],
                      pooling: PoolingParams = PoolingParams(),
                      options: RequestOptions = RequestOptions()) -> Request:
        """Queue one prompt to embed (engine/embed.py). Raises InvalidRequest at once."""
        pooling = self.check_embedding(prompt_token_ids, pooling)
        if pooling.method != "last":  # every row is pooled: none may come from the cache
            options = replace(options, prefix_cache=False)
        request = Request(request_id, list(prompt_token_ids), EMBED_PARAMS,
                          eos_token_ids=frozenset(), max_tokens=0, priority=options.priority,
                          user=options.user, cache_salt=self._salt(options),
                          prefix_cache=options.prefix_cache, pooling=pooling, lora=options.lora)
        self._queue(request)
        return request

    def check_embedding(self, prompt_token_ids: list[int], pooling: PoolingParams
                        ) -> PoolingParams:
        """Raise if the prompt cannot be embedded; else the pooling, its method resolved.
        Reads only what never changes after start-up, so any thread may call it."""
        limit = min(self.max_model_len, self.cache_info.num_tokens)
        check_embedding_input(prompt_token_ids, pooling, limit, self.model_config.hidden_size)
        self._check_token_ids(prompt_token_ids, EMBED_PARAMS)
        return pooling if pooling.method is not None else replace(pooling, method=self.pooling)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Raise if the request can never run; else return its resolved max_tokens: what it
        asked for, cut to the room the context (and the whole KV cache) leaves after the
        prompt, as a request without max_tokens gets. A prompt with no room left is refused.

        Reads only what never changes after start-up, so any thread may call it.
        """
        self.check_generates()
        self._check_token_ids(prompt_token_ids, params)
        num_prompt = len(prompt_token_ids)
        asked = params.max_tokens if params.max_tokens is not None else 1
        if num_prompt >= self.max_model_len:
            raise ContextTooLong(num_prompt, asked, self.max_model_len)
        if num_prompt >= self.cache_info.num_tokens:
            raise ContextTooLong(num_prompt, asked, self.cache_info.num_tokens,
                                 what="the whole KV cache")
        room = min(self.max_model_len, self.cache_info.num_tokens) - num_prompt
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def check_generates(self) -> None:
        """Raise unless this engine generates text (its task is not embed)."""
        if self.task == "embed":
            raise InvalidRequest("this engine runs the embed task: it computes embeddings "
                                 "(/v1/embeddings) and generates no text; start it with "
                                 "--task generate to generate")

    def _check_token_ids(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty; send at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids
               if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            shown = ", ".join(str(t)[:24] for t in bad[:5])  # (an id may have 4000 digits)
            raise InvalidRequest(f"prompt token ids [{shown}] are outside the vocabulary "
                                 f"[0, {vocab})", param="prompt")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < vocab]
        bad += [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"token ids {bad[:5]} in logit_bias or stop_token_ids are "
                                 f"outside the vocabulary [0, {vocab})", param="logit_bias")

    def finish(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now (abort, stop string) and free its KV blocks. A decode request
        whose copy has not started lets the prefill replica's pin go."""
        self.scheduler.finish(request_id, reason)
        if self.kv_connector is not None and request_id in self._remotes and \
                request_id not in self.scheduler.loading:   # (a copy's end pops its own)
            self.kv_connector.abandon(self._remotes.pop(request_id))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self, only: frozenset[str] | None = None) -> list[Request]:
        """One step; with `only`, the other requests sit it out. Raises StepFailed."""
        self.scheduler.held = frozenset() if only is None else \
            frozenset(self.scheduler.requests) - only
        self.move_kv()
        try:
            plan = self.scheduler.schedule()         # which tokens each request computes now
            self._start_loads(self.scheduler.take_loads())   # other replicas' KV copied in
        except Exception as e:
            raise StepFailed(list(self.scheduler.requests), e) from e
        self.idle_step = not plan.scheduled
        try:
            result = self.runner.execute(plan)           # forward + sample on the device
            advanced = self.scheduler.update(plan, result)   # append tokens, finish, free
        except EngineDead:   # the model's ranks are out of step: no request's fault
            raise
        except Exception as e:
            self.scheduler.unschedule(plan)
            raise StepFailed([s.request.request_id for s in plan.scheduled], e) from e
        if self.kv_connector is not None:
            self._save(self.scheduler.take_kept())   # prompts kept for decode replicas
        return advanced

    def _loras_in_use(self) -> frozenset[str]:
        """The adapters of queued and running requests (any thread: the list is copied in
        one C call, under the GIL)."""
        return frozenset(r.lora for r in list(self.scheduler.requests.values())
                         if r.lora is not None)
