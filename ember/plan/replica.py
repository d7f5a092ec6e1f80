"""`ember serve --simulate PROFILE`: a replica with no model weights.

Everything of `ember serve` but the forward is the real thing: the HTTP server and its
validation, the AsyncEngine thread, the admission checks and backpressure (429), the
scheduler and KV pool with the prefix cache and its /kv/events, /metrics. The model's place
is taken by a runner that waits, on the wall clock, as long as the profile says the step
takes (its step model plus its serving overhead), and draws each new token from a seeded
generator. Prompts are tokenized with the profile's tokenizer (the model's own), so usage
counts and block keys are the ones a real replica reports; the output is tokens of visible
text, not an answer.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ember.config import EngineConfig
from ember.distributed.executor import SingleProcess
from ember.engine.cold_start import PhaseClock
from ember.engine.core import CacheInfo, EngineCore, resolve_max_model_len
from ember.errors import ConfigError, InvalidRequest
from ember.kv.kv_manager import KVCacheManager
from ember.lora.registry import LoraRegistry
from ember.plan.profile import Profile
from ember.plan.simulate import SimRunner, TokenSource
from ember.request import PoolingParams
from ember.scheduler.output import RunnerOutput, SchedulerOutput
from ember.scheduler.scheduler import Scheduler
from ember.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class PacedRunner:
    """A SimRunner on the wall clock: each step returns once its predicted time has passed
    since it began (the bookkeeping around it is the engine's own)."""

    def __init__(self, runner: SimRunner, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.runner, self.clock, self.sleep = runner, clock, sleep

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        began = self.clock()
        out = self.runner.execute(plan)
        left = self.runner.last_duration_s - (self.clock() - began)
        if left > 0:
            self.sleep(left)
        return out


@dataclass(frozen=True)
class SimulatedModel:
    """The model facts the engine's checks read."""

    vocab_size: int
    hidden_size: int
    max_position_embeddings: int

    def context_limit(self) -> int:
        return self.max_position_embeddings


class NoGrammars:
    """A simulated replica draws its tokens: it cannot follow a grammar."""

    def compile(self, constraint: object) -> object:
        raise InvalidRequest("this is a simulated replica (ember serve --simulate): it draws "
                             "its tokens and cannot follow a schema, regex or grammar; send "
                             "the request without response_format or tools",
                             param="response_format")

    async def compile_async(self, constraint: object) -> object:
        return self.compile(constraint)


def visible_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids that decode alone to printable text (no special token, no part of a character):
    drawn as output, each streamed step carries some text, as a model's steps usually do."""
    out = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if text.strip() and text.isprintable() and "\ufffd" not in text and \
                token_id not in tokenizer.eos_token_ids:
            out.append(token_id)
    return out


class SimulatedCore(EngineCore):
    """An EngineCore with the profile in the model's place (nothing is loaded). Its steps are
    EngineCore.step: the real Scheduler and KVCacheManager around a PacedRunner."""

    def __init__(self, config: EngineConfig, profile: Profile) -> None:
        refuse_unsimulated(config)
        self.config = config
        self.executor = SingleProcess()
        self.load_phases = PhaseClock()
        self.model_path = Path(profile.model_path)
        self.tokenizer = profile.load_tokenizer()
        self.model_config = SimulatedModel(profile.vocab_size, profile.hidden_size,
                                           profile.max_model_len)
        self.dtype, self.quantization, self.prefill_matmul = None, "simulated", "simulated"
        self.kernels, self.pooling, self.weights_cached = None, "last", True
        self.load_phases.mark("files")
        cache = config.cache
        num_blocks = cache.num_blocks or profile.num_blocks(cache.kv_cache_gib, cache.block_size)
        self.max_model_len = resolve_max_model_len(config, self.model_config,
                                                   num_blocks * cache.block_size)
        self.cache_info = CacheInfo(num_blocks, cache.block_size, profile.kv_bytes_per_token,
                                    profile.kv_cache_dtype)
        kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching,
                            cache.eviction_policy, share_generated=False)
        self.scheduler = Scheduler(config.scheduler, kv, self.max_model_len, config.spec)
        self.loras = LoraRegistry(self.model_config)
        tokens = TokenSource(visible_token_ids(self.tokenizer), config.seed)
        self.runner = PacedRunner(SimRunner(profile.step_model, tokens, profile.serving))
        if not profile.serving.measured:
            log.warning("the profile has no served overhead (it was made without serving "
                        "the model): steps last the engine's in-process time; profile again "
                        "with `ember plan profile` to measure it")
        self.grammars = NoGrammars()
        self.load_phases.mark("kv_cache")
        self.task = config.task

    def check_embedding(self, prompt_token_ids: list[int], pooling: PoolingParams
                        ) -> PoolingParams:
        raise InvalidRequest("this is a simulated replica (ember serve --simulate): it "
                             "computes no embeddings", param="input")


def refuse_unsimulated(config: EngineConfig) -> None:
    """Options a simulated replica cannot honour fail at start, not on the first request."""
    unsupported = [name for name, given in (
        ("--lora", bool(config.loras)), ("--speculative", config.spec.speculative is not None),
        ("--task embed", config.task == "embed"),
        (f"--role {config.kv_transfer.role}", config.kv_transfer.role != "both")) if given]
    if unsupported:
        raise ConfigError(f"--simulate does not simulate {', '.join(unsupported)}; leave "
                          f"{'it' if len(unsupported) == 1 else 'them'} out")
