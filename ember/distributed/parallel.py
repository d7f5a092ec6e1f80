"""Which part of the model each tensor-parallel rank holds, and which CPUs it runs on.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes some of their
outputs), o and down row-parallel (each rank a partial sum over its inputs, summed across the
ranks by one all-reduce each), the embedding and the output projection vocabulary-parallel.

Heads go to ranks as whole GQA groups, so that each rank's attention is an ordinary GQA
attention (a uniform number of query heads per KV head, what every attention path assumes).
Where the KV heads divide among the ranks, each rank holds its share; where they do not, the
ranks cut the KV heads as a line cut evenly and hold every head their cut touches, so a head
on a cut is held by both ranks beside it:

    9 query heads, 3 KV heads (groups of 3), 2 ranks (cut at 1.5):
      rank 0: KV heads 0-1, query heads 0-5      rank 1: KV heads 1-2, query heads 3-8

Both write KV head 1 into their caches, and each request attends over it on one of the two
(chosen by its prompt: ember/models/parallel.py HeadShare), so that each reads about half of
the shared head's cache; the other's output for those query heads is zeros, which the
all-reduce after o adds. Without the shared head rank 0 held KV heads 0-1 and rank 1 head 2:
at 32 requests of a few hundred tokens rank 0 read twice rank 1's cache each step and did
twice its attention, and rank 1 waited for it at every all-reduce.

With more ranks than KV heads, each KV head is replicated on the ranks that share its group's
query heads (4 ranks: KV 0 on ranks 0-1 with query heads 0-1 and 2, KV 1 on rank 2, KV 2 on
rank 3). A rank needs at least one query head, so there can be at most as many ranks as
query heads. Ranks before others get the larger share where a count does not divide evenly;
MLP columns and vocabulary rows go in whole units (UNIT_*), so that int4's groups of 32
inputs and the int8 output projection's tiles of 16 rows stay whole on every rank. Where the
heads split unevenly, the columns and rows do too, so that every rank reads about as many
weights per decoded token (balanced_split: 4 query heads over 3 ranks, 2 + 1 + 1, for
instance; the default model's shared head leaves its 2 ranks even: MLP columns 768 + 768,
vocabulary rows 24,576 + 24,576).

A mixture of experts' experts are cut like the dense MLP (each rank a slice of every
expert's columns), or, with expert parallel, shared out whole (each rank a contiguous range
of experts, unsliced; 3 experts over 2 ranks: 0-1 and 2). Either way each rank's output is
a partial sum that the block's one all-reduce completes; the router is on every rank, and
Qwen2-MoE's shared expert is sliced like a dense MLP.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from ember.config import ModelConfig, ParallelConfig, parse_cpu_bind
from ember.errors import ConfigError
from ember.models.parallel import HeadShare
from ember.request import SHARE_KEYS

log = logging.getLogger(__name__)

UNIT_COLUMNS = 32   # MLP columns per unit: int4's group of inputs (ember/quant/packed.py)
UNIT_VOCAB = 16     # vocabulary rows per unit: the int8 output projection's tile

Range = tuple[int, int]   # [start, end)

_Q = re.compile(r".*\.self_attn\.q_proj\.(weight|bias)")
_KV = re.compile(r".*\.self_attn\.[kv]_proj\.(weight|bias)")
_O = re.compile(r".*\.self_attn\.o_proj\.weight")
_DENSE_IN = re.compile(r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight")
_DENSE_OUT = re.compile(r"model\.layers\.\d+\.mlp\.down_proj\.weight")
_EXPERT_IN = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up)_proj\.weight")
_EXPERT_OUT = re.compile(r".*\.mlp\.experts\.\d+\.down_proj\.weight")
_SHARED_IN = re.compile(r".*\.mlp\.shared_expert\.(gate|up)_proj\.weight")
_SHARED_OUT = re.compile(r".*\.mlp\.shared_expert\.down_proj\.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
# an expert's index in a tensor's name (transformers', Mixtral's or GGUF's split one)
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")
# shipped fused (Phi-3): rows [q | k | v] and [gate | up]
_QKV = re.compile(r".*\.self_attn\.qkv_proj\.(weight|bias)")
_GATE_UP = re.compile(r"model\.layers\.\d+\.mlp\.gate_up_proj\.weight")


def even_ranges(count: int, parts: int, unit: int = 1) -> list[Range]:
    """[0, count) cut into `parts` contiguous ranges of whole units, the first ones larger by
    a unit where the units do not divide evenly (e.g. 5 units of 1 into 2: 3 + 2)."""
    units, extra = divmod(count // unit, parts)
    ranges, start = [], 0
    for part in range(parts):
        end = start + (units + (part < extra)) * unit
        ranges.append((start, end))
        start = end
    return ranges


def split_columns(count: int, parts: int, unit: int, what: str) -> list[Range]:
    """even_ranges in units of `unit` where `count` is made of at least `parts` of them,
    else of single columns; every part gets at least one."""
    return even_ranges(count, parts, column_unit(count, parts, unit, what))


def column_unit(count: int, parts: int, unit: int, what: str) -> int:
    """`unit` where `count` is made of at least `parts` of them, else 1 (single columns); a
    ConfigError where there are fewer columns than parts."""
    if count < parts:
        raise ConfigError(f"{what} has {count} columns, fewer than tensor_parallel_size="
                          f"{parts}; lower tensor_parallel_size to {count} or less")
    return 1 if count % unit or count // unit < parts else unit


def decode_params(config: ModelConfig, q_heads: int, kv_heads: int, columns: int,
                  vocab_rows: int) -> int:
    """Weights (parameters) a rank holding these parts reads per decoded token: in each layer
    q and o for its query heads, k and v for its KV heads, gate, up and down for its MLP
    columns; and its output projection's vocabulary rows (its embedding rows are the same
    ones, of which a token reads one). Biases and norms are left out (vectors)."""
    h, d = config.hidden_size, config.head_dim
    return config.num_layers * h * (2 * d * (q_heads + kv_heads) + 3 * columns) + h * vocab_rows


def balance_units(loads: list[int], units: list[int], cost: int) -> list[int]:
    """`units` (each rank's, each adding `cost` to its load) moved one at a time from the
    heaviest rank that has more than one to the lightest while their gap exceeds `cost`:
    each move lowers the sum of the loads' squares, so it ends, with the gaps at most a
    unit's cost where the units allow."""
    loads, units = list(loads), list(units)
    while True:
        order = sorted(range(len(loads)), key=loads.__getitem__)
        low = order[0]
        high = next((r for r in reversed(order) if units[r] > 1), low)
        if loads[high] - loads[low] <= cost:
            return units
        units[high] -= 1
        units[low] += 1
        loads[high] -= cost
        loads[low] += cost


def balanced_split(config: ModelConfig, heads: list[tuple[Range, Range]]
                   ) -> tuple[list[Range], list[Range]]:
    """Each rank's MLP columns and vocabulary rows, so that the ranks read about as many
    weights per decoded token (decode_params; every rank holds the same format, so bytes
    follow parameters). Decode is weight-bandwidth bound and each all-reduce waits for the
    slowest rank, so where the heads split unevenly (10 query heads over 3 ranks: 4, 6 and
    4 with 2, 3 and 2 KV heads) the ranks with fewer heads take more MLP columns, then
    vocabulary rows make up what whole column units cannot (balance_units). Ranges stay
    contiguous in rank order and in whole units (UNIT_COLUMNS, UNIT_VOCAB). The even split
    stands where the heads split evenly, and for mixtures of experts (what a token reads
    there follows its routing)."""
    parts = len(heads)
    mlp_unit = column_unit(config.intermediate_size, parts, UNIT_COLUMNS, "the MLP")
    vocab_unit = column_unit(config.vocab_size, parts, UNIT_VOCAB, "the vocabulary")
    mlp = [(b - a) // mlp_unit for a, b in even_ranges(config.intermediate_size, parts,
                                                        mlp_unit)]
    vocab = [(b - a) // vocab_unit for a, b in even_ranges(config.vocab_size, parts, vocab_unit)]
    counts = [(q1 - q0, k1 - k0) for (q0, q1), (k0, k1) in heads]
    if not config.num_experts and len(set(counts)) > 1:
        def loads() -> list[int]:
            return [decode_params(config, q, kv, m * mlp_unit, v * vocab_unit)
                    for (q, kv), m, v in zip(counts, mlp, vocab)]
        mlp = balance_units(loads(), mlp, decode_params(config, 0, 0, mlp_unit, 0))
        vocab = balance_units(loads(), vocab, decode_params(config, 0, 0, 0, vocab_unit))
    return _ranges(mlp, mlp_unit), _ranges(vocab, vocab_unit)


def _ranges(units: list[int], unit: int) -> list[Range]:
    """Contiguous ranges of `units[i]` units of `unit` each, in order from 0."""
    ends = [unit * sum(units[:i + 1]) for i in range(len(units))]
    return list(zip([0, *ends[:-1]], ends))


def split_experts(num_experts: int, parts: int) -> list[Range]:
    """Each rank's whole experts under expert parallel: contiguous, the first ranks one
    more where they do not divide."""
    if parts > num_experts:
        raise ConfigError(f"expert_parallel over tensor_parallel_size={parts} ranks needs an "
                          f"expert per rank, and the model has {num_experts} experts; use "
                          f"tensor_parallel_size={num_experts} or less, or drop "
                          "expert_parallel (each rank then holds a slice of every expert)")
    return even_ranges(num_experts, parts)


def split_heads(num_heads: int, num_kv_heads: int, parts: int, shared: bool = True
                ) -> list[tuple[Range, Range]]:
    """(query heads, KV heads) of each rank: whole GQA groups where there are at least as
    many KV heads as ranks (where they do not divide, with `shared` those on the even cuts of
    the KV heads held by the ranks on both sides, shared_kv_ranges; else the first ranks one
    more), else a share of one group's query heads with its KV head."""
    if parts > num_heads:
        raise ConfigError(f"tensor_parallel_size={parts} exceeds the model's {num_heads} query "
                          f"heads (with {num_kv_heads} KV heads): each rank needs a query head; "
                          f"use at most {num_heads}")
    group = num_heads // num_kv_heads
    if parts <= num_kv_heads:
        ranges = even_ranges(num_kv_heads, parts) if num_kv_heads % parts == 0 or not shared \
            else shared_kv_ranges(num_kv_heads, parts)
        return [((a * group, b * group), (a, b)) for a, b in ranges]
    out = []
    for kv, (first, end) in enumerate(even_ranges(parts, num_kv_heads)):
        for a, b in even_ranges(group, end - first):   # ranks sharing KV head `kv`
            out.append(((kv * group + a, kv * group + b), (kv, kv + 1)))
    return out


def shared_kv_ranges(num_kv_heads: int, parts: int) -> list[Range]:
    """Each rank's KV heads where `parts` does not divide them: the heads [0, K) as a line
    cut into `parts` equal lengths, each rank every head its length touches (3 over 2:
    0-1 and 1-2; 5 over 3: 0-1, 1-3, 3-4)."""
    return [(r * num_kv_heads // parts, -(-(r + 1) * num_kv_heads // parts))
            for r in range(parts)]


@dataclass(frozen=True)
class TensorShard:
    """What rank `rank` of `world_size` holds: ranges of the model's heads, MLP columns and
    vocabulary rows."""

    rank: int
    world_size: int
    q_heads: Range
    kv_heads: Range
    head_dim: int
    intermediate: Range
    moe_intermediate: Range
    shared_intermediate: Range
    vocab: Range
    max_vocab_rows: int   # the largest rank's vocabulary rows (logits are gathered padded)
    num_heads: int        # the whole model's query and KV heads
    num_kv_heads: int
    # expert parallel: the whole experts this rank holds (moe_intermediate is then every
    # column); None: a slice of every expert, moe_intermediate's columns
    experts: Range | None = None
    # a KV head on a cut between two ranks is on both (split_heads' `shared`, where the KV
    # heads do not divide among the ranks)
    shares_kv_heads: bool = False

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The model as this rank builds it: its heads, columns, experts and vocabulary rows."""
        def size(r: Range) -> int:
            return r[1] - r[0]
        return replace(config, num_heads=size(self.q_heads), num_kv_heads=size(self.kv_heads),
                       intermediate_size=size(self.intermediate),
                       moe_intermediate_size=size(self.moe_intermediate),
                       shared_expert_intermediate_size=size(self.shared_intermediate),
                       vocab_size=size(self.vocab), local_experts=self.experts)

    def head_share(self) -> HeadShare | None:
        """Which requests this rank attends over the KV heads it shares with another rank
        (split_heads); None where it shares none (each of its query heads is its alone)."""
        first, end = self.kv_heads
        if not self.shares_kv_heads:
            return None
        return HeadShare(self.rank, self.world_size, first, end - first, self.num_kv_heads,
                         SHARE_KEYS)

    def local_name(self, name: str) -> str | None:
        """A loaded tensor's name in this rank's model: under expert parallel an expert's
        renumbered from the rank's first (None: another rank's expert); others unchanged."""
        match = _EXPERT_INDEX.search(name)
        if self.experts is None or match is None:
            return name
        first, end = self.experts
        expert = int(match.group(1))
        if not first <= expert < end:
            return None
        return f"{name[:match.start(1)]}{expert - first}{name[match.end(1):]}"

    def take(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of one loaded tensor (transformers' name, q/k/v and gate/up not
        yet fused), a copy of its own; replicated tensors come back as they are."""
        if _QKV.fullmatch(name) or _GATE_UP.fullmatch(name):
            return self._take_fused(name, tensor)
        rows, cols = self._split(name)
        if rows is not None:
            return tensor[rows[0]:rows[1]].clone()
        if cols is not None:
            return tensor[:, cols[0]:cols[1]].contiguous()
        return tensor

    def _take_fused(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's rows of each part of a fused projection, fused again."""
        d = self.head_dim
        if _QKV.fullmatch(name):
            q, kv = self.num_heads * d, self.num_kv_heads * d
            parts = [(tensor[:q], self.q_heads), (tensor[q:q + kv], self.kv_heads),
                     (tensor[q + kv:], self.kv_heads)]
            return torch.cat([t[a * d:b * d] for t, (a, b) in parts])
        gate, up = tensor.chunk(2)
        a, b = self.intermediate
        return torch.cat([gate[a:b], up[a:b]])

    def _split(self, name: str) -> tuple[Range | None, Range | None]:
        """(rows, columns) of `name` this rank keeps; (None, None) where it keeps all."""
        d = self.head_dim
        if _Q.fullmatch(name):
            return (self.q_heads[0] * d, self.q_heads[1] * d), None
        if _KV.fullmatch(name):
            return (self.kv_heads[0] * d, self.kv_heads[1] * d), None
        if _O.fullmatch(name):
            return None, (self.q_heads[0] * d, self.q_heads[1] * d)
        expert_columns = self.moe_intermediate if self.experts is None else None   # (whole)
        for column_parallel, row_parallel, columns in (
                (_DENSE_IN, _DENSE_OUT, self.intermediate),
                (_EXPERT_IN, _EXPERT_OUT, expert_columns),
                (_SHARED_IN, _SHARED_OUT, self.shared_intermediate)):
            if column_parallel.fullmatch(name):
                return columns, None
            if row_parallel.fullmatch(name):
                return None, columns
        if name in _VOCAB:
            return self.vocab, None
        return None, None


def plan_shards(config: ModelConfig, world_size: int, expert_parallel: bool = False,
                share_kv_heads: bool = True) -> list[TensorShard]:
    """Every rank's TensorShard (with expert_parallel: whole experts each; with
    share_kv_heads, KV heads on the cuts held by two ranks where they do not divide); a
    ConfigError naming the numbers where the model cannot be split `world_size` ways."""
    if config.qk_norm == "full" and world_size > 1:
        raise ConfigError(f"{config.architecture} normalises q and k over all heads together "
                          "(qk_norm 'full'), which tensor parallel does not split yet; use "
                          "tensor_parallel_size=1")
    heads = split_heads(config.num_heads, config.num_kv_heads, world_size, share_kv_heads)
    shares = share_kv_heads and world_size <= config.num_kv_heads and \
        config.num_kv_heads % world_size != 0
    mlp, vocab = balanced_split(config, heads)
    experts: list[Range | None] = [None] * world_size
    if expert_parallel:
        if not config.num_experts:
            raise ConfigError(f"expert_parallel shares out a mixture's experts, and "
                              f"{config.architecture} is a dense model (0 experts); drop "
                              "expert_parallel (tensor parallel splits its MLP columns)")
        experts = list(split_experts(config.num_experts, world_size))
        moe = [(0, config.moe_intermediate_size)] * world_size
    elif config.moe_intermediate_size:
        moe = split_columns(config.moe_intermediate_size, world_size, UNIT_COLUMNS, "an expert")
    else:
        moe = [(0, 0)] * world_size
    shared = split_columns(config.shared_expert_intermediate_size, world_size, UNIT_COLUMNS,
                           "the shared expert") \
        if config.shared_expert_intermediate_size else [(0, 0)] * world_size
    widest = max(b - a for a, b in vocab)
    return [TensorShard(rank, world_size, q, kv, config.head_dim, mlp[rank], moe[rank],
                        shared[rank], vocab[rank], widest, config.num_heads, config.num_kv_heads,
                        experts[rank], shares)
            for rank, (q, kv) in enumerate(heads)]


def describe_shards(shards: list[TensorShard], config: ModelConfig) -> str:
    """E.g. 'rank 0: query heads 0-5, KV heads 0-1, MLP columns 0-767, vocabulary 0-24575,
    71.7M parameters read a token; rank 1: ...', with each rank's whole experts under expert
    parallel (a mixture's reads follow its routing, so none are counted there)."""
    def span(r: Range) -> str:
        return f"{r[0]}-{r[1] - 1}" if r[1] - r[0] > 1 else str(r[0])

    def experts(s: TensorShard) -> str:
        return "" if s.experts is None else f", experts {span(s.experts)}"

    def reads(s: TensorShard) -> str:
        if config.num_experts:
            return ""
        size = [b - a for a, b in (s.q_heads, s.kv_heads, s.intermediate, s.vocab)]
        return f", {decode_params(config, *size) / 1e6:.1f}M parameters read a token"
    shared = "; a KV head on two ranks is attended for each request on one of them" \
        if shards and shards[0].head_share() is not None else ""
    return "; ".join(f"rank {s.rank}: query heads {span(s.q_heads)}, KV heads "
                     f"{span(s.kv_heads)}, MLP columns {span(s.intermediate)}{experts(s)}, "
                     f"vocabulary {span(s.vocab)}{reads(s)}" for s in shards) + shared


def rank_cpus(parallel: ParallelConfig, available: list[int],
              nodes: list[tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
    """Each rank's CPUs (ranks stage by stage): cpu_bind's, which must be among `available`
    (the CPUs this process may run on); else, on a machine of several NUMA nodes (`nodes`,
    each one's CPUs; read from the OS when None), as many ranks on each node (numa_split);
    else `available` split evenly in order. A rank needs a CPU of its own, unless
    oversubscribe lets ranks take turns on them."""
    size = parallel.world_size
    if parallel.cpu_bind is not None:
        ranks = parse_cpu_bind(parallel.cpu_bind)
        outside = sorted({c for r in ranks for c in r} - set(available))
        if outside:
            raise ConfigError(f"cpu_bind={parallel.cpu_bind!r} names CPUs {outside} that this "
                              f"process may not run on (it may use {format_cpus(available)})")
        return ranks
    if size > len(available):
        if parallel.oversubscribe:
            return [(available[rank % len(available)],) for rank in range(size)]
        layout = f"tensor_parallel_size={parallel.tensor_parallel_size}" \
            if parallel.pipeline_parallel_size == 1 else \
            (f"tensor_parallel_size={parallel.tensor_parallel_size} x pipeline_parallel_size="
             f"{parallel.pipeline_parallel_size} = {size} ranks")
        raise ConfigError(f"{layout} needs a CPU core per rank, and this process may run on "
                          f"{len(available)} ({format_cpus(available)}); use at most "
                          f"{len(available)} ranks, or --oversubscribe-cpus to let ranks "
                          "share cores (slow)")
    by_node = numa_split(available, numa_nodes() if nodes is None else nodes, size)
    if by_node is not None:
        log.info("ranks bound by NUMA node, each reading its weights from local memory: "
                 "%s (--cpu-bind to choose)", " | ".join(format_cpus(r) for r in by_node))
        return by_node
    return [tuple(available[a:b]) for a, b in even_ranges(len(available), size)]


def numa_split(available: list[int], nodes: list[tuple[int, ...]], size: int
               ) -> list[tuple[int, ...]] | None:
    """`size` ranks' CPUs where `available` spans several NUMA nodes: the same number of
    ranks on each node, each rank's cores within one node (a rank reading its weights across
    the socket link runs at remote-memory bandwidth), or, with fewer ranks than nodes, the
    same number of whole nodes to each rank. None where one node holds them all, or where
    the ranks do not divide among the nodes (or the nodes among the ranks)."""
    allowed = set(available)
    mine = [tuple(c for c in node if c in allowed) for node in nodes]
    mine = [m for m in mine if m]
    if len(mine) < 2:
        return None
    if size % len(mine) == 0:
        per_node = size // len(mine)
        if any(len(m) < per_node for m in mine):
            return None
        return [m[a:b] for m in mine for a, b in even_ranges(len(m), per_node)]
    if len(mine) % size == 0:
        group = len(mine) // size
        return [tuple(c for m in mine[r * group:(r + 1) * group] for c in m)
                for r in range(size)]
    return None


def numa_nodes() -> list[tuple[int, ...]]:
    """Each NUMA node's CPUs, as Linux lists them (none elsewhere, or where it shows one)."""
    found = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist"),
                       key=lambda p: int(p.parent.name[4:])):
        text = path.read_text().strip()
        if text:
            found.append(parse_cpu_bind(text)[0])
    return found


def ray_rank_cpus(parallel: ParallelConfig, available: list[int]) -> list[int]:
    """Each rank's CPU count under Ray (its bundle's): ray_cpus_per_rank, or `available` (the
    CPUs this process may run on) split evenly, at least one each. Ray places the bundles
    on nodes with that many CPUs free; it picks no CPUs within a node."""
    size = parallel.world_size
    if parallel.ray_cpus_per_rank is not None:
        return [parallel.ray_cpus_per_rank] * size
    return [max(1, b - a) for a, b in even_ranges(len(available), size)]


@dataclass(frozen=True)
class PipelineStage:
    """Stage `stage` of `num_stages`: layers [first_layer, end_layer) of the model, in
    tensor_parallel_size ranks; the first stage embeds the tokens, the last one applies the
    final norm and the output projection."""

    stage: int
    num_stages: int
    first_layer: int
    end_layer: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """`config` with this stage's layers only (what sizes its KV cache)."""
        layers = range(self.first_layer, self.end_layer)
        sliding = None if config.sliding_layers is None else \
            config.sliding_layers[self.first_layer:self.end_layer]
        dense = tuple(i - self.first_layer for i in config.dense_mlp_layers if i in layers)
        return replace(config, num_layers=self.num_layers, sliding_layers=sliding,
                       dense_mlp_layers=dense)

    def local_name(self, name: str, tied: bool) -> str | None:
        """A loaded tensor's name in this stage's model (its layers renumbered from 0), or
        None where the stage does not hold it. The final norm is kept everywhere (a vector;
        its dtype is the activations'); a tied embedding also on the last stage, whose
        output projection reads it."""
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            if not self.first_layer <= layer < self.end_layer:
                return None
            return f"model.layers.{layer - self.first_layer}{name[match.end():]}"
        if name == "model.embed_tokens.weight":
            return name if self.is_first or (self.is_last and tied) else None
        if name == "lm_head.weight":
            return name if self.is_last else None
        return name


_LAYER = re.compile(r"model\.layers\.(\d+)")


def plan_stages(num_layers: int, num_stages: int) -> list[PipelineStage]:
    """Consecutive layers per stage, as even as they go (the first stages one more where
    they do not divide); a ConfigError naming the numbers where there are too few layers."""
    if num_stages > num_layers:
        raise ConfigError(f"pipeline_parallel_size={num_stages} exceeds the model's "
                          f"{num_layers} layers: each stage needs a layer; use at most "
                          f"{num_layers}")
    return [PipelineStage(stage, num_stages, a, b)
            for stage, (a, b) in enumerate(even_ranges(num_layers, num_stages))]


def describe_stages(stages: list[PipelineStage]) -> str:
    """E.g. 'stage 0: layers 0-14 and the embedding; stage 1: layers 15-29 and the head'."""
    def what(s: PipelineStage) -> str:
        ends = [e for e, on in (("the embedding", s.is_first), ("the head", s.is_last)) if on]
        return f"layers {s.first_layer}-{s.end_layer - 1}" + \
            (f" and {' and '.join(ends)}" if ends else "")
    return "; ".join(f"stage {s.stage}: {what(s)}" for s in stages)


def format_cpus(cpus: list[int] | tuple[int, ...]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][-1] + 1:
            runs[-1].append(cpu)
        else:
            runs.append([cpu])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
