"""Frozen, validated configuration.

`ModelConfig` describes a model's architecture and comes from its files. The others are the
user's choices, composed into `EngineConfig`. Values worked out at run time (such as the number
of KV blocks) are return values elsewhere, never edits of these objects.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields

from ember.errors import ConfigError, UnsupportedModel

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                           "Phi3ForCausalLM", "Olmo2ForCausalLM", "MixtralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ROPE_SCALING = ("linear", "llama3", "longrope")
NORM_LAYOUTS = ("pre", "sandwich", "post")  # see ember/models/decoder.py
QK_NORMS = ("head", "full")
DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu", "cost")
KV_CACHE_DTYPES = ("auto", "model", "int8")  # auto: int8 with int4 weights on the kernels
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight formats (ember/quant/packed.py)
# dense matmuls over 8 rows (ember/quant/packed.py); bfloat16-brgemm: torch's brgemm (AMX)
PREFILL_MATMULS = ("auto", "bfloat16", "int8", "bfloat16-brgemm")
KERNELS = ("auto", "torch")  # compiled CPU kernels where they build, or the torch path alone
# proposers of speculative decoding (ember/spec/); "draft:PATH" names a draft model's files
SPECULATIVE = ("ngram", "self", "draft:PATH")
TASKS = ("generate", "embed")  # generate also serves embeddings; embed serves only them
DISTRIBUTED_EXECUTORS = ("mp", "ray")  # how a model's ranks start: local processes, Ray actors
# the ranks' all-reduce (ember/distributed/allreduce.py): shm on one host, else gloo
ALL_REDUCES = ("auto", "shm", "gloo")
KV_HEAD_SPLITS = ("shared", "groups")
ROLES = ("both", "prefill", "decode")  # disaggregated serving (ember/kv_transfer/)
KV_TRANSPORTS = ("auto", "http")       # auto: shared memory on one host, else HTTP
POOLINGS = ("auto", "last", "mean", "cls")  # auto: the model folder's sentence-transformers
                                            # pooling, else the last token


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError naming the choices if `value` is not one of them."""
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of "
                          f"{', '.join(choices)}")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'linear' (positions / factor), 'llama3' (Llama 3.1 bands) or
    'longrope' (Phi-3: per-frequency divisors, short below the original context, long past
    it, and cos/sin scaled by attention_factor)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SUPPORTED_ROPE_SCALING:
            raise UnsupportedModel(f"RoPE scaling {self.kind!r} is not supported; ember runs "
                                   f"{', '.join(SUPPORTED_ROPE_SCALING)} or no scaling")
        if self.factor <= 0:
            raise UnsupportedModel(f"RoPE scaling factor {self.factor} must be positive")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder, as read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    # what sets the variants apart from Llama (ember/models/decoder.py)
    sliding_layers: tuple[bool, ...] | None = None  # per layer (None: all, with a window)
    qk_norm: str | None = None          # RMSNorm on q and k: per "head", or over the "full" row
    norm_layout: str = "pre"            # pre (Llama), sandwich (Gemma 2/3), post (OLMo 2)
    hidden_act: str = "silu"            # silu (SwiGLU) or gelu_tanh (GeGLU)
    norm_plus_one: bool = False         # Gemma: norms compute x * (1 + weight)
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None     # None: head_dim ** -0.5
    attn_softcap: float | None = None   # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' RoPE base
    # mixture of experts (ember/models/moe.py); num_experts 0: a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False        # renormalise the top-k router probabilities
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's expert every token takes
    dense_mlp_layers: tuple[int, ...] = ()    # layers with a dense MLP in a MoE model
    # expert parallel: the experts [start, end) a rank holds whole (None: every expert)
    local_experts: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(f"architecture {self.architecture!r} is not supported; ember "
                                   f"runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UnsupportedModel(f"model config has {name}={getattr(self, name)}; "
                                       "it must be positive (are the model files corrupt?)")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModel(f"num_heads={self.num_heads} is not a multiple of "
                                   f"num_kv_heads={self.num_kv_heads}; the model files are invalid")
        check_choice("norm_layout", self.norm_layout, NORM_LAYOUTS)
        if self.qk_norm is not None:
            check_choice("qk_norm", self.qk_norm, QK_NORMS)
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModel(f"activation {self.hidden_act!r} is not supported; ember "
                                   "runs silu (SwiGLU) and gelu_tanh (GeGLU) MLPs")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UnsupportedModel(f"{self.num_experts_per_tok} experts per token of "
                                   f"{self.num_experts}; the model config is invalid")
        if self.local_experts is not None and \
                not 0 <= self.local_experts[0] < self.local_experts[1] <= self.num_experts:
            raise UnsupportedModel(f"local experts {self.local_experts} are not a range of "
                                   f"the model's {self.num_experts} experts")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModel(f"{len(self.sliding_layers)} layer types for "
                                   f"{self.num_layers} layers; the model config is invalid")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def context_limit(self) -> int:
        """Longest sequence the model can attend over exactly: sliding windows are honoured
        by masking, so they do not limit it."""
        return self.max_position_embeddings

    def is_sliding(self, layer_idx: int) -> bool:
        """Whether this layer attends only to the last sliding_window tokens."""
        if self.sliding_window is None:
            return False
        return self.sliding_layers is None or self.sliding_layers[layer_idx]

    def window_of_every_layer(self) -> int | None:
        """The sliding window when every layer has it (KV blocks behind it can go), else
        None."""
        if self.sliding_window is None or not all(self.is_sliding(i)
                                                   for i in range(self.num_layers)):
            return None
        return self.sliding_window

    @property
    def is_llama(self) -> bool:
        """Whether LlamaForCausalLM runs it as it is (and its compiled decode stack may)."""
        return (self.architecture in SUPPORTED_ARCHITECTURES[:3] and self.sliding_window is None
                and (self.rope_scaling is None or self.rope_scaling.kind != "longrope"))


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and the memory it may take."""

    block_size: int = 16
    kv_cache_gib: float = 1.0
    num_blocks: int | None = None  # overrides the memory budget (tests, tiny caches)
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"   # which idle cached block to give up first: lru, lfu, cost
    kv_cache_dtype: str = "auto"   # auto (int8 with int4 weights on the kernels), model, int8
    # KV events kept for /kv/events pollers; one further behind starts again from a snapshot
    max_kv_events: int = 10_000

    def __post_init__(self) -> None:
        check_choice("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size={self.block_size} must be a positive power of two; "
                              "16 is a good default")
        if self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib={self.kv_cache_gib} must be positive; try 1.0")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks={self.num_blocks} must be positive, or None to "
                              "derive it from kv_cache_gib")
        if self.max_kv_events <= 0:
            raise ConfigError(f"max_kv_events={self.max_kv_events} must be positive; try "
                              "10000")


# a decode replica's prompt tokens per step beside its decodes, unless set: it computes only
# the prompts the gateway keeps local, beside every stream it decodes, so its steps stay
# short (one step of 64 prompt tokens beside 16 streams takes about a third of one of 256)
DECODE_ROLE_PREFILL_TOKENS = 64


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step may take on."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # prompt tokens a step takes on beside running decodes (None: the whole budget): a step's
    # time grows with its tokens, and every decoding stream waits for the step, so a smaller
    # chunk keeps the gap between a stream's tokens short; a lone prompt still gets the budget
    prefill_tokens_with_decodes: int | None = 256
    fair_share: bool = False  # admit the waiting request of the user with fewest running

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs={self.max_num_seqs} must be positive; try 64")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be "
                              "positive; try 512 (the prefill chunk size)")
        cap = self.prefill_tokens_with_decodes
        if cap is not None and cap <= 0:
            raise ConfigError(f"prefill_tokens_with_decodes={cap} must be positive; try 256, "
                              "or max_num_batched_tokens (None in Python) for the whole budget")


@dataclass(frozen=True)
class ParallelConfig:
    """One model over several processes (ember/distributed/): tensor parallel splits every
    layer's heads and MLP columns over `tensor_parallel_size` ranks, pipeline parallel its
    layers over `pipeline_parallel_size` stages of consecutive layers, each stage made of
    tensor_parallel_size ranks; each rank is a process with its own CPU cores; rank 0 is the
    engine's own process and runs the scheduler and sampler. Expert parallel gives the
    tensor-parallel ranks whole experts of a mixture of experts instead of a slice of each."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # mp: local processes on this host; ray: ranks 1.. as Ray actors in a placement group,
    # on the nodes of a Ray cluster
    distributed_executor: str = "mp"
    # the Ray cluster to join (ray): "HOST:PORT" of its head; None: the one `ray start` set
    # up on this machine, else a new local one
    ray_address: str | None = None
    # each rank's CPUs in its placement-group bundle (ray); None: this process's CPUs split
    # evenly among the ranks, as mp does
    ray_cpus_per_rank: int | None = None
    # how long the placement group may wait for room on the cluster before the start fails
    ray_placement_timeout_s: float = 60.0
    # each rank's CPUs, ranks split by "|", e.g. "0-3|4-7" or "0|1"; None: this process's
    # CPUs split evenly among the ranks
    cpu_bind: str | None = None
    # a collective that waits longer than this on a rank (hung, or dead without closing its
    # sockets) ends the engine
    collective_timeout_s: float = 60.0
    all_reduce: str = "auto"   # both kinds add in rank order: the same bits either way
    # let ranks share CPU cores where there are more ranks than cores (slow: for tests and
    # trying a layout out on a small machine)
    oversubscribe: bool = False
    # a step's requests are cut into up to this many micro-batches, which the stages work on
    # at once (None: pipeline_parallel_size of them)
    pipeline_micro_batches: int | None = None
    # a mixture of experts: each tensor-parallel rank holds a contiguous range of whole
    # experts (their weights unsliced) instead of a slice of every expert's columns
    expert_parallel: bool = False
    # KV heads that do not divide among the tensor-parallel ranks (3 over 2): "shared", a
    # head on a cut between two ranks is held by both and each request attends it on one
    # (even attention and KV reads; both read its weights); "groups", each rank whole GQA
    # groups, its MLP columns evening out the weights (ember/distributed/parallel.py)
    kv_head_split: str = "shared"

    @property
    def num_micro_batches(self) -> int:
        """The micro-batches a step is cut into: 1 without pipeline parallel."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.pipeline_micro_batches or self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Every rank of the model: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        check_choice("distributed_executor", self.distributed_executor, DISTRIBUTED_EXECUTORS)
        check_choice("all_reduce", self.all_reduce, ALL_REDUCES)
        check_choice("kv_head_split", self.kv_head_split, KV_HEAD_SPLITS)
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ConfigError(f"tensor_parallel_size={self.tensor_parallel_size} must be in "
                              "[1, 64]; 1 runs the model in one process")
        if not 1 <= self.pipeline_parallel_size <= 64:
            raise ConfigError(f"pipeline_parallel_size={self.pipeline_parallel_size} must be "
                              "in [1, 64]; 1 keeps every layer in each rank")
        if self.pipeline_micro_batches is not None and self.pipeline_micro_batches < 1:
            raise ConfigError(f"pipeline_micro_batches={self.pipeline_micro_batches} must be "
                              "at least 1; try pipeline_parallel_size (the default)")
        if self.collective_timeout_s <= 0:
            raise ConfigError(f"collective_timeout_s={self.collective_timeout_s} must be "
                              "positive; try 60")
        self._check_ray()
        if self.expert_parallel and self.tensor_parallel_size == 1:
            raise ConfigError("expert_parallel shares a mixture's experts among the "
                              "tensor-parallel ranks, and tensor_parallel_size=1 is one rank; "
                              "use tensor_parallel_size=2 or more (at most the model's "
                              "experts), or drop expert_parallel")
        if self.cpu_bind is not None:
            ranks = parse_cpu_bind(self.cpu_bind)
            if len(ranks) != self.world_size:
                raise ConfigError(f"cpu_bind={self.cpu_bind!r} gives CPUs for {len(ranks)} "
                                  f"ranks, tensor_parallel_size={self.tensor_parallel_size} x "
                                  f"pipeline_parallel_size={self.pipeline_parallel_size} = "
                                  f"{self.world_size}; give one CPU list per rank, split by "
                                  "'|' (stage by stage)")


    def _check_ray(self) -> None:
        """The Ray options go with --distributed-executor ray, which places ranks on nodes
        by their CPU counts (it binds no CPUs within a node)."""
        ray = self.distributed_executor == "ray"
        given = [name for name, value in (("ray_address", self.ray_address),
                                          ("ray_cpus_per_rank", self.ray_cpus_per_rank))
                 if value is not None]
        if given and not ray:
            raise ConfigError(f"{' and '.join(given)}: only the Ray executor uses them; add "
                              "distributed_executor='ray' (--distributed-executor ray), or "
                              "drop them")
        if ray and self.cpu_bind is not None:
            raise ConfigError(f"cpu_bind={self.cpu_bind!r} names CPUs of this host, and Ray "
                              "places ranks on any node; give ray_cpus_per_rank (the CPUs "
                              "each rank's bundle takes) instead")
        if self.ray_cpus_per_rank is not None and self.ray_cpus_per_rank < 1:
            raise ConfigError(f"ray_cpus_per_rank={self.ray_cpus_per_rank} must be at least "
                              "1, or None for this process's CPUs split among the ranks")
        if self.ray_placement_timeout_s <= 0:
            raise ConfigError(f"ray_placement_timeout_s={self.ray_placement_timeout_s} must "
                              "be positive; try 60")


def parse_cpu_bind(spec: str) -> list[tuple[int, ...]]:
    """'0-1,4|2-3' -> [(0, 1, 4), (2, 3)]: each rank's CPUs, in order, none given twice."""
    ranks: list[tuple[int, ...]] = []
    for part in spec.split("|"):
        cpus: list[int] = []
        for item in part.split(","):
            first, sep, last = item.strip().partition("-")
            try:
                lo, hi = int(first), int(last if sep else first)
            except ValueError:
                raise ConfigError(f"cpu_bind={spec!r}: {item.strip()!r} is not a CPU number or "
                                  "range; write e.g. '0-3|4-7' (one list per rank)") from None
            if lo < 0 or hi < lo:
                raise ConfigError(f"cpu_bind={spec!r}: range {lo}-{hi} is empty or negative")
            cpus += range(lo, hi + 1)
        ranks.append(tuple(cpus))
    seen = [c for r in ranks for c in r]
    if len(seen) != len(set(seen)):
        raise ConfigError(f"cpu_bind={spec!r} gives a CPU to more than one rank; give each "
                          "rank CPUs of its own")
    return ranks


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: a proposer guesses the next tokens, one target forward checks
    them all. Off (None) by default."""

    speculative: str | None = None
    num_speculative_tokens: int = 4     # drafted tokens per request and step, at most
    ngram_max: int = 4                  # n-gram proposer: longest suffix matched
    ngram_min: int = 2                  # shortest suffix matched
    # a step verifies drafts only while it has at most this many rows (decodes plus drafts):
    # past it a CPU step stops being bound by reading the weights, and drafts cost time
    max_spec_rows: int = 8
    # a request whose recent drafts were accepted less often than this pauses drafting
    min_acceptance: float = 0.3
    # self-draft: the target's first layers that draft (None: a default from the model's
    # depth, ember/spec/layer_skip.py)
    self_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and not self.speculative.startswith("draft:"):
            check_choice("speculative", self.speculative, SPECULATIVE)
        if self.speculative == "draft:":
            raise ConfigError("speculative='draft:' names no model; write draft:PATH, PATH a "
                              "model folder or .gguf file with the target's vocabulary")
        if self.self_draft_layers is not None and self.self_draft_layers < 1:
            raise ConfigError(f"self_draft_layers={self.self_draft_layers} must be at least 1 "
                              "(and below the model's layer count); try 4")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens={self.num_speculative_tokens} must be "
                              "in [1, 16]; try 4")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ConfigError(f"ngram_min={self.ngram_min} and ngram_max={self.ngram_max} "
                              "must satisfy 1 <= ngram_min <= ngram_max <= 16; try 2 and 4")
        if self.max_spec_rows < 2:
            raise ConfigError(f"max_spec_rows={self.max_spec_rows} must be at least 2; try 8")
        if not 0.0 <= self.min_acceptance < 1.0:
            raise ConfigError(f"min_acceptance={self.min_acceptance} must be in [0, 1); "
                              "try 0.3")

    @property
    def enabled(self) -> bool:
        return self.speculative is not None

    @property
    def proposer(self) -> str | None:
        """ngram, self or draft (a draft model at draft_model_path); None when off."""
        if self.speculative is None:
            return None
        return "draft" if self.speculative.startswith("draft:") else self.speculative

    @property
    def draft_model_path(self) -> str | None:
        return self.speculative.removeprefix("draft:") if self.proposer == "draft" else None

    @property
    def drafts_with_a_model(self) -> bool:
        """Whether drafting runs a model, which writes KV past the newest token: the
        scheduler then gives each drafting request that many slots ahead (lookahead)."""
        return self.proposer in ("self", "draft")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated serving: a prefill replica computes prompts and keeps their KV blocks
    pinned for a decode replica, which pulls them and generates the rest (ember/kv_transfer/).
    `both` is an ordinary replica, which does neither."""

    role: str = "both"
    # how a decode replica pulls: auto maps the prefill replica's KV cache where both run on
    # one host (else HTTP); http always asks the prefill replica's server
    kv_transport: str = "auto"
    # a prompt's pinned blocks go back to the pool this long after the prompt finished,
    # unless a decode replica pulled them first
    kv_pin_seconds: float = 30.0
    # a decode replica's whole pull, after which it recomputes the prompt itself
    kv_pull_timeout_s: float = 30.0
    # hosts ("host" or "host:port") a decode replica pulls from; none: this host's loopback
    # only. A request names the prefill replica, so without this list a client could make
    # the replica connect anywhere with the request's credentials
    kv_peers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choice("role", self.role, ROLES)
        check_choice("kv_transport", self.kv_transport, KV_TRANSPORTS)
        for name in ("kv_pin_seconds", "kv_pull_timeout_s"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"{name}={value} must be in (0, 3600] seconds; try 30")

    @property
    def exports(self) -> bool:
        return self.role == "prefill"

    @property
    def imports(self) -> bool:
        return self.role == "decode"


@dataclass(frozen=True)
class EngineConfig:
    """Everything the user chooses about one engine. `model=None` means the default model."""

    model: str | None = None
    dtype: str = "auto"            # auto: bfloat16 where the CPU has bf16 dot products, or a GPU
    quantization: str = "auto"     # weights: auto (the file's own precision), none, int8, int4
    kernels: str = "auto"          # auto: compiled CPU kernels where they build; torch: none
    # prompt chunks' matmuls with packed weights: int8 (dynamic int8 activations, int8
    # weights) or bfloat16; auto: the faster here, measured once per machine and model and
    # kept beside the weight cache (ember/engine/prefill_choice.py)
    prefill_matmul: str = "auto"
    # a request's tokens and logprobs never depend on the prefix cache, the chunk size,
    # preemption, speculation or the step's prompt rows (every prompt token is a prompt row,
    # every generated one a decode row: docs/architecture.md, "Same request, same answer");
    # with deterministic, not on how many other requests decode beside it either: decode
    # steps of more than 8 rows stay on the int4 weights instead of the faster int8 ones
    deterministic: bool = False
    device: str = "cpu"
    max_model_len: int | None = None
    seed: int = 0
    task: str = "generate"         # embed: embeddings only (and the only task of encoders)
    pooling: str = "auto"          # how embeddings pool the prompt's hidden states
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loras: tuple[tuple[str, str], ...] = ()   # (name, path) of LoRA adapters loaded at start
    max_loras: int = 8             # adapters resident in memory at once (least recently used out)
    max_lora_rank: int = 64
    # the model as the engine runs it is cached in this folder and memory-mapped on the next
    # start (ember/weights/cache.py); None: no cache
    weight_cache_dir: str | None = None

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("prefill_matmul", self.prefill_matmul, PREFILL_MATMULS)
        if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 256:
            raise ConfigError(f"max_loras={self.max_loras} must be >= 1 and max_lora_rank="
                              f"{self.max_lora_rank} in [1, 256]")
        object.__setattr__(self, "loras", tuple((str(n), str(p)) for n, p in self.loras))
        check_choice("task", self.task, TASKS)
        check_choice("pooling", self.pooling, POOLINGS)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len={self.max_model_len} must be positive, or None "
                              "for the model's own context length")
        if self.kv_transfer.role != "both" and self.spec.drafts_with_a_model:
            raise ConfigError(f"--role {self.kv_transfer.role} moves the model's KV only; a "
                              f"drafting model's would stay behind: leave out --speculative "
                              f"{self.spec.speculative} (ngram drafts need no KV)")
        if self.kv_transfer.role != "both" and self.parallel.world_size > 1 and \
                self.parallel.distributed_executor != "mp":
            raise ConfigError(f"--role {self.kv_transfer.role} over {self.parallel.world_size} "
                              "ranks needs every rank on this host (the driver maps each "
                              "rank's KV cache to move its blocks): use --distributed-executor "
                              "mp, or --role both")
        if self.parallel.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.parallel.pipeline_parallel_size > 1:
            self._check_pipeline_parallel()

    def _check_tensor_parallel(self) -> None:
        """What tensor parallel does not run yet, refused before anything starts."""
        if not self.device.startswith("cpu"):
            raise ConfigError(f"tensor_parallel_size={self.parallel.tensor_parallel_size} "
                              f"does not run with device={self.device!r} yet (ranks talk "
                              "over gloo on the CPU); use device='cpu' or "
                              "tensor_parallel_size=1")

    def _check_pipeline_parallel(self) -> None:
        """What pipeline parallel does not run yet, refused before anything starts."""
        if not self.device.startswith("cpu"):
            raise ConfigError(f"--pipeline-parallel-size "
                              f"{self.parallel.pipeline_parallel_size} does not run with "
                              f"--device {self.device} yet (ranks talk over gloo on the "
                              "CPU); use --device cpu or --pipeline-parallel-size 1")

    @classmethod
    def from_options(cls, **options: object) -> "EngineConfig":
        """Build from flat keyword options (`block_size=`, `max_num_seqs=` ...).

        Each option goes to the sub-config that owns it; an unknown one is an error that names
        the close matches.
        """
        groups: dict[type, dict[str, object]] = {cls: {}, CacheConfig: {}, SchedulerConfig: {},
                                                 SpecConfig: {}, ParallelConfig: {},
                                                 KVTransferConfig: {}}
        owners = {f.name: owner for owner in groups for f in fields(owner)
                  if f.name not in ("cache", "scheduler", "spec", "parallel", "kv_transfer")}
        for name, value in options.items():
            if name not in owners:
                close = difflib.get_close_matches(name, owners, n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else \
                    f"; known options: {', '.join(sorted(owners))}"
                raise ConfigError(f"unknown engine option {name!r}{hint}")
            groups[owners[name]][name] = value
        return cls(**groups[cls], cache=CacheConfig(**groups[CacheConfig]),
                   scheduler=SchedulerConfig(**groups[SchedulerConfig]),
                   spec=SpecConfig(**groups[SpecConfig]),
                   parallel=ParallelConfig(**groups[ParallelConfig]),
                   kv_transfer=KVTransferConfig(**groups[KVTransferConfig]))


TENANT_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass(frozen=True)
class ApiKey:
    """One accepted API key and the tenant it belongs to.

    A tenant's requests share cached prefixes only with each other, and are counted under
    its name in the metrics. `best_priority` is the most important priority the key may ask
    for: lower runs first, so a request's priority must be >= it (None: any priority).
    """

    key: str
    tenant: str
    best_priority: int | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise ConfigError("an API key is empty; give each key at least one character")
        if not self.tenant or not set(self.tenant) <= TENANT_NAME_CHARS:
            raise ConfigError(f"tenant name {self.tenant!r} must be letters, digits, '_', '.' "
                              "or '-' (it becomes a metrics label)")


def parse_api_keys(text: str, source: str = "the API keys file") -> tuple[ApiKey, ...]:
    """Lines of `KEY [TENANT [BEST_PRIORITY]]`; blank lines and lines starting with `#` are
    skipped (a `#` inside a key is part of the key).

    A key without a tenant name is a tenant of its own, named after its line (`line7`).
    """
    keys: list[ApiKey] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        parts = line.split()
        if not parts or parts[0].startswith("#"):
            continue
        where = f"{source} line {number}"
        if len(parts) > 3:
            raise ConfigError(f"{where} has {len(parts)} fields; write KEY [TENANT "
                              "[BEST_PRIORITY]], separated by spaces")
        if parts[0] in seen:
            raise ConfigError(f"{where} repeats the key of line {seen[parts[0]]}; "
                              "give each key once")
        try:
            best = int(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ConfigError(f"{where}: BEST_PRIORITY {parts[2]!r} must be an integer "
                              "(lower runs first)") from None
        try:
            keys.append(ApiKey(parts[0], parts[1] if len(parts) > 1 else f"line{number}",
                               best))
        except ConfigError as e:
            raise ConfigError(f"{where}: {e.message}") from None
        seen[parts[0]] = number
    if not keys:
        raise ConfigError(f"{source} holds no key; write one `KEY [TENANT [BEST_PRIORITY]]` "
                          "per line")
    return tuple(keys)


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server: where it listens, whom it lets in, and how much it takes on."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # tenants (--api-keys); with them, api_key is one more key, of the tenant "default"
    api_keys: tuple[ApiKey, ...] = ()
    served_model_name: str | None = None  # default: the model file's or folder's name
    max_waiting: int = 256                # queued requests before new ones get 429
    request_timeout_s: float | None = 600.0
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 32
    max_n: int = 16                       # completions one request may ask for (n, best_of)
    max_embedding_inputs: int = 2048      # inputs one /v1/embeddings request may send (OpenAI's)
    drain_timeout_s: float = 30.0         # SIGTERM: time for in-flight requests to finish
    stall_timeout_s: float = 60.0         # /health/ready turns 503 if a busy engine stalls

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port={self.port} must be in [0, 65535]")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key is empty; pass a non-empty key or none at all")
        if self.api_key is not None and any(k.key == self.api_key for k in self.api_keys):
            raise ConfigError("api_key is also in the API keys file; give each key once")
        for name in ("max_waiting", "max_body_bytes", "max_json_depth", "max_n",
                     "max_embedding_inputs"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be positive")
        for name in ("request_timeout_s", "drain_timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value} must be positive")

    def tenant_keys(self) -> tuple[ApiKey, ...]:
        """Every accepted key with its tenant; empty when the server has no tenants."""
        if not self.api_keys:
            return ()
        extra = (ApiKey(self.api_key, "default"),) if self.api_key is not None else ()
        return self.api_keys + extra
