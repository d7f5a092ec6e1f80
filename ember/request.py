"""Plain data that travels along the data path: what a user asks for and what they get back."""
from __future__ import annotations

import dataclasses
import enum
import math
import time
import zlib
from array import array
from dataclasses import dataclass, field

from ember.constraint import Constraint
from ember.errors import BadSamplingParams, InvalidRequest

MAX_LOGPROBS = 20
MAX_INT32 = 2**31 - 1          # counts and token ids travel in int32/int64 tensors
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. `temperature=0` is greedy decoding.

    Penalties follow OpenAI (presence/frequency, on generated tokens) and Hugging Face
    (repetition, on prompt and generated tokens). `logprobs=N` returns the chosen token's
    log-probability with the N most likely alternatives (0 gives the chosen token alone).
    """

    n: int = 1
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None  # structured output: what the text must match

    def __post_init__(self) -> None:
        # Accept a bare string or a list where a tuple is stored: the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        self._validate_ints()
        _check(self.n >= 1, "n", self.n, "must be at least 1")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be at least 1 (or None to fill the context)")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0, "temperature",
               self.temperature, "must be >= 0 (0 means greedy)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 or -1 turn it off)")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty,
               "must be in [-2, 2]")
        _check(0 < self.repetition_penalty <= 10 and math.isfinite(self.repetition_penalty),
               "repetition_penalty", self.repetition_penalty, "must be in (0, 10]; 1 is off")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must hold non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must hold token ids >= 0")
        for token_id, bias in (self.logit_bias or {}).items():
            _check(isinstance(token_id, int) and token_id >= 0, "logit_bias", token_id,
                   "keys must be token ids >= 0")
            _check(-100 <= bias <= 100, "logit_bias", bias, "values must be in [-100, 100]")

    def _validate_ints(self) -> None:
        """Integers a tensor or torch.Generator will hold: out of range, they would raise
        OverflowError inside the engine step, far from the request that caused it."""
        for name in ("n", "max_tokens", "min_tokens", "top_k", "logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value) and -MAX_INT32 <= value <= MAX_INT32, name,
                   value, f"must be an integer in [0, {MAX_INT32}]")
        low, high = SEED_RANGE
        _check(self.seed is None or _is_int(self.seed) and low <= self.seed <= high, "seed",
               self.seed, f"must be an integer in [{low}, {high}]")
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", tuple(self.logit_bias or {}))):
            _check(all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids), name, ids,
                   f"must hold token ids in [0, {MAX_INT32}] (and in the vocabulary)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def fan_out(self) -> list["SamplingParams"]:
        """n completions are n sequences; with a seed, completion i uses seed + i (mod 2**64,
        which is how torch.Generator reads a negative seed too)."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None
                                    else (self.seed + i) % 2**64) for i in range(self.n)]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise BadSamplingParams(f"{name}={value!r} {rule}", param=name)


@dataclass(frozen=True)
class RequestOptions:
    """How a request is served, beside how its tokens are sampled."""

    priority: int = 0                 # lower runs first (as in vLLM); ties go by arrival
    user: str | None = None           # for fair share between users
    cache_salt: str | None = None     # requests share cached KV only with the same salt
    prefix_cache: bool = True         # False: neither reuse nor store cached KV
    lora: str | None = None           # the LoRA adapter to run with (None: the base model)

    def __post_init__(self) -> None:
        if not _is_int(self.priority) or not -MAX_INT32 - 1 <= self.priority <= MAX_INT32:
            raise InvalidRequest(f"priority={self.priority!r} must be an integer in "
                                 f"[{-MAX_INT32 - 1}, {MAX_INT32}] (lower runs first)",
                                 param="priority")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and self.cache_salt):
            raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")


POOLING_METHODS = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request: its prompt's hidden states pooled into one L2-normalised vector
    instead of sampled. `method` None is the model's own pooling; `dimensions` keeps the
    vector's first N values (Matryoshka truncation) before normalising."""

    method: str | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in POOLING_METHODS:
            raise InvalidRequest(f"pooling={self.method!r} must be one of "
                                 f"{', '.join(POOLING_METHODS)}", param="pooling")
        if self.dimensions is not None and not (_is_int(self.dimensions)
                                                and 1 <= self.dimensions <= MAX_INT32):
            raise InvalidRequest(f"dimensions={self.dimensions!r} must be a positive integer",
                                 param="dimensions")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    LOADING = "loading"      # holds its blocks while another replica's KV is copied in
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # EOS, a stop token or a stop string
    LENGTH = "length"    # max_tokens or the context length
    ABORT = "abort"      # cancelled by the caller


SHARE_KEYS = 1 << 16


def share_key(prompt_token_ids: list[int]) -> int:
    """A number in [0, SHARE_KEYS) that a prompt's tokens alone decide: which tensor-parallel
    rank attends a KV head that two ranks hold (ember/models/parallel.py HeadShare), the same
    for the same prompt whatever else runs beside it."""
    return zlib.crc32(array("q", prompt_token_ids).tobytes()) % SHARE_KEYS


@dataclass
class Request:
    """One sequence being generated. The scheduler and the runner read and advance it.

    positions of its tokens:
      [0, num_computed_tokens)            KV already in the cache
      [num_computed_tokens, num_tokens)   still to compute (a prefill, or the newest token)
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: params.max_tokens, or what the context leaves
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # when it first left the waiting queue
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    output_logprobs: list["SampledLogprob"] = field(default_factory=list)
    priority: int = 0                 # lower runs first (as in vLLM); ties go by arrival
    user: str | None = None           # for fair share between users
    cache_salt: str | None = None     # requests share cached KV only with the same salt
    prefix_cache: bool = True         # False: neither reuse nor store cached KV
    num_cached_tokens: int = 0        # prompt tokens served from the prefix cache
    grammar: object | None = None     # the compiled constraint (opaque to the bookkeeping)
    # speculative decoding: tokens proposed for the next step (not part of the sequence until
    # a target forward accepts them), the recent share of drafts accepted, and the steps left
    # before a request whose drafts kept failing drafts again
    draft_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: float = 1.0
    spec_pause: int = 0
    lora: str | None = None           # the LoRA adapter's name (None: the base model)
    pooling: PoolingParams | None = None  # set: embed the prompt; never sample a token
    embedding: list[float] | None = None  # the pooled vector, once its last chunk ran
    # disaggregated serving (ember/kv_transfer/): the leading prompt tokens whose KV another
    # replica computed, copied in when the request is admitted instead of computed; and, on
    # the replica that computes a prompt for another, that its blocks outlive it (pinned)
    num_external_tokens: int = 0
    keep_blocks: bool = False
    share_key: int = field(init=False, default=0)   # share_key(prompt_token_ids)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.share_key = share_key(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)


@dataclass(frozen=True)
class SampledLogprob:
    """The runner's raw logprobs for one sampled token: its own, and the top (id, logprob)s."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token's log-probability (under the model, before sampling transforms)."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a caller gets for one prompt: its completions, so far or final."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
