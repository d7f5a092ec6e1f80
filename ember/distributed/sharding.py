"""A loaded rank's model made tensor-parallel (its row-parallel projections sum across the
ranks, its vocabulary ends are the rank's rows) and linked to its pipeline stage's
neighbours (ember/models/parallel.py)."""
from __future__ import annotations

from torch import nn

from ember.distributed.collectives import RankCollectives
from ember.distributed.parallel import PipelineStage, TensorShard
from ember.models.layers import SwiGLU
from ember.models.llama import LlamaAttention, LlamaForCausalLM
from ember.models.moe import SparseMoE
from ember.models.parallel import (GatheredHead, LogitsFromLastStage, LogitsToDriver, NoLogits,
                                   StageLink, VocabParallelEmbedding)


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
    start, end = shard.vocab
    if not isinstance(model.model.embed_tokens, nn.Identity):   # (a stage without it)
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, start,
                                                          end - start, collectives.all_reduce)
    if not isinstance(model.lm_head, nn.Identity):
        model.lm_head = GatheredHead(model.lm_head, collectives.gather)


def link_stage(model: LlamaForCausalLM, stage: PipelineStage, collectives: RankCollectives,
               driver: bool, vocab_size: int) -> None:
    """In place, after parallelize where there is tensor parallel: the stage's model takes
    its input from the stage before and sends its output on (ember/models/parallel.py); the
    last stage sends its logits to the driver, which receives them as its output
    projection's; the other ranks compute none."""
    model.stage_link = StageLink(stage.is_first, stage.is_last, collectives.receive_previous,
                                 collectives.send_next, collectives.finish_sends)
    if stage.is_last:
        model.lm_head = LogitsToDriver(model.lm_head, collectives.send_logits)
    elif driver:
        model.lm_head = LogitsFromLastStage(collectives.receive_logits, vocab_size,
                                            model.model.norm.weight.dtype)
    else:
        model.lm_head = NoLogits()
