"""A loaded rank's model made tensor-parallel: its row-parallel projections sum across the
ranks, its vocabulary ends are the rank's rows (ember/models/parallel.py)."""
from __future__ import annotations

from ember.distributed.collectives import RankCollectives
from ember.distributed.parallel import TensorShard
from ember.models.layers import SwiGLU
from ember.models.llama import LlamaAttention, LlamaForCausalLM
from ember.models.moe import SparseMoE
from ember.models.parallel import GatheredHead, VocabParallelEmbedding


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
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, start,
                                                      end - start, collectives.all_reduce)
    model.lm_head = GatheredHead(model.lm_head, collectives.gather)
