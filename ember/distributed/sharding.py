"""A loaded rank's model made tensor-parallel (its row-parallel projections sum across the
ranks, its vocabulary ends are the rank's rows) and linked to its pipeline stage's
neighbours (ember/models/parallel.py); a rank's part of a LoRA adapter."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from ember.distributed.allreduce import AllReduceFn, ShmAllReduce
from ember.distributed.collectives import RankCollectives
from ember.distributed.parallel import PipelineStage, TensorShard
from ember.kernels import CpuKernels
from ember.lora.adapter import LoraAdapter
from ember.lora.ranks import AdapterPart
from ember.models.layers import SwiGLU
from ember.models.llama import LlamaAttention, LlamaForCausalLM
from ember.models.moe import SparseMoE
from ember.models.parallel import (GatheredHead, LogitsFromLastStage, LogitsToDriver, NoLogits,
                                   StackAllReduce, StageLink, VocabParallelEmbedding)


def parallelize(model: LlamaForCausalLM, shard: TensorShard,
                collectives: RankCollectives) -> None:
    """In place, after quantization (which swaps the linears) and before use_kernels (which
    then builds no whole-model decode stack): one all-reduce after each attention's o_proj
    and each MLP's down_proj (a mixture of experts: one after all its experts), the
    embedding over the rank's vocabulary rows, and the logits gathered on the driver."""
    in_experts = {id(m) for moe in model.modules() if isinstance(moe, SparseMoE)
                  for m in moe.modules() if m is not moe}
    for module in model.modules():
        if isinstance(module, (LlamaAttention, SparseMoE)) or \
                (isinstance(module, SwiGLU) and id(module) not in in_experts):
            module.all_reduce = collectives.all_reduce
    model.head_share = shard.head_share()
    start, end = shard.vocab
    if not isinstance(model.model.embed_tokens, nn.Identity):   # (a stage without it)
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, start,
                                                          end - start, collectives.all_reduce)
    if not isinstance(model.lm_head, nn.Identity):
        model.lm_head = GatheredHead(model.lm_head, collectives.gather,
                                     collectives.all_reduce, start, shard.rank,
                                     shard.world_size)


def stack_all_reduce(model: LlamaForCausalLM, kernels: CpuKernels | None,
                     all_reduce: AllReduceFn) -> None:
    """Once the rank's group exists: where its all-reduce goes through shared memory, the
    model's compiled decode stack calls it itself (the same handle, so every call keeps the
    order the other ranks see); over gloo, steps stay layer by layer (every rank decides
    alike: open_shm gives every rank the same transport)."""
    if isinstance(all_reduce, ShmAllReduce):
        model.use_stack_all_reduce(StackAllReduce(all_reduce.handle, all_reduce.timeout_s,
                                                  all_reduce.spin_us), kernels)


def link_stage(model: LlamaForCausalLM, stage: PipelineStage, collectives: RankCollectives,
               driver: bool, vocab_size: int) -> None:
    """In place, after parallelize where there is tensor parallel: the stage's model takes
    its input from the stage before and sends its output on (ember/models/parallel.py); the
    last stage sends its logits to the driver, which receives them as its output
    projection's (and its final hidden states, where the driver pools them); the other
    ranks compute none."""
    model.stage_link = StageLink(stage.is_first, stage.is_last, collectives.receive_previous,
                                 collectives.send_next, collectives.finish_sends,
                                 collectives.send_final if stage.is_last else None,
                                 collectives.receive_final if driver else None)
    if stage.is_last:
        model.lm_head = LogitsToDriver(model.lm_head, collectives.send_logits)
    elif driver:
        model.lm_head = LogitsFromLastStage(collectives.receive_logits, vocab_size,
                                            model.model.norm.weight.dtype)
    else:
        model.lm_head = NoLogits()


def lora_part(shard: TensorShard | None, stage: PipelineStage | None) -> AdapterPart | None:
    """The part of a whole LoRA adapter (ember/lora/adapter.py's fused factors) that a rank
    with `shard` of `stage` applies, or None where it holds the whole model. Each factor is
    cut like the base weight beside it:

        qkv, gate_up (column-parallel): A [hidden, R] whole, B [R, out] to the rank's columns
        o, down (row-parallel):         A [in, R] to the rank's rows,  B [R, hidden] whole

    so a row-parallel projection's adapter term is a partial sum too, added before its
    all-reduce (which then sums it once); a stage keeps its layers' factors."""
    if shard is None and stage is None:
        return None

    def part(adapter: LoraAdapter) -> LoraAdapter:
        layers = adapter.factors if stage is None else \
            adapter.factors[stage.first_layer:stage.end_layer]
        if shard is not None:
            layers = [{p: _cut_factors(shard, p, a, b) for p, (a, b) in layer.items()}
                      for layer in layers]
        return replace(adapter, factors=[dict(layer) for layer in layers])
    return part


def _cut_factors(shard: TensorShard, projection: str, a: Tensor, b: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """One projection's (A [in, R], B [R, out]) cut to `shard`'s part."""
    d = shard.head_dim
    (q0, q1), (k0, k1) = shard.q_heads, shard.kv_heads
    if projection == "qkv":   # B's columns [q | k | v]: each part's heads of the rank
        q, kv = shard.num_heads * d, shard.num_kv_heads * d
        columns = [(q0 * d, q1 * d), (q + k0 * d, q + k1 * d), (q + kv + k0 * d, q + kv + k1 * d)]
        return a, torch.cat([b[:, s:e] for s, e in columns], dim=1)
    if projection == "gate_up":   # B's columns [gate | up]: the rank's MLP columns of each
        half, (i0, i1) = b.shape[1] // 2, shard.intermediate
        return a, torch.cat([b[:, i0:i1], b[:, half + i0:half + i1]], dim=1)
    if projection == "o":
        return a[q0 * d:q1 * d].clone(), b
    if projection == "down":
        i0, i1 = shard.intermediate
        return a[i0:i1].clone(), b
    raise ValueError(f"no tensor-parallel cut for LoRA projection {projection!r}")
