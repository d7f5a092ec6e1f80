"""Mixture-of-experts MLPs: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Each token goes to the top-k of num_experts SwiGLU experts by its router's softmax, their
outputs weighted by those probabilities (renormalised over the k where the model does:
Mixtral always, the others per norm_topk_prob). Qwen2-MoE adds a shared expert to every
token, scaled by sigmoid(shared_expert_gate(x)).

The tokens are grouped by expert: one sort of the (token, choice) pairs, then one batched
call per expert that has tokens (a loop over experts, never over tokens). The experts are
plain SwiGLU modules, so weight packing (ember/quant) treats them as it treats a dense MLP;
the router stays in the model's dtype.

Under expert parallel (config.local_experts) a rank holds a contiguous range of whole experts:
it routes every token over all of them, runs only its own, and the all-reduce that ends the
block adds the other ranks' experts in.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ember.config import ModelConfig
from ember.models.layers import SwiGLU
from ember.models.parallel import AllReduce, reduce_


class Router(nn.Module):
    """A bias-free projection kept out of weight packing: [T, hidden] -> [T, out]."""

    def __init__(self, hidden_size: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk = config.norm_topk_prob
        self.gate = Router(config.hidden_size, config.num_experts)
        self.num_experts = config.num_experts
        # the experts this module holds: [first_expert, first_expert + len(experts))
        self.first_expert, end = config.local_experts or (0, config.num_experts)
        self.experts = nn.ModuleList(SwiGLU(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(self.first_expert, end))
        self.shared_expert: SwiGLU | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(config.hidden_size,
                                        config.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(config.hidden_size, 1)
        # tensor parallel: every expert's down projection gives this rank's partial sum over
        # its columns (expert parallel: its experts' whole outputs); one all-reduce sums the
        # weighted total (None in one process)
        self.all_reduce: AllReduce | None = None

    def forward(self, x: Tensor) -> Tensor:
        """x [T, hidden] -> [T, hidden]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)          # [T, experts]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)          # [T, k] each
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()
        # (token, choice) pairs sorted by expert: each expert's rows are one slice of `order`,
        # this module's experts' from the pairs of the experts before its first
        order = expert_ids.flatten().argsort(stable=True)
        counts = torch.bincount(expert_ids.flatten(), minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = sum(counts[:self.first_expert])
        for expert, count in zip(self.experts, counts[self.first_expert:]):
            if count:
                pairs = order[start:start + count]
                tokens = pairs // self.top_k
                out.index_add_(0, tokens, expert(x[tokens]) * weights[pairs, None])
                start += count
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return reduce_(self.all_reduce, out)


def parameter_counts(config: ModelConfig) -> tuple[int, int]:
    """(active, total) parameters, norms and biases aside: what one token reads, and what
    the model holds."""
    hidden = config.hidden_size
    attn = hidden * (2 * config.q_size + 2 * config.kv_size)
    embed = config.vocab_size * hidden * (1 if config.tie_word_embeddings else 2)
    dense = 3 * hidden * config.intermediate_size
    num_sparse = config.num_layers - len(config.dense_mlp_layers) if config.num_experts else 0
    base = embed + config.num_layers * attn + (config.num_layers - num_sparse) * dense
    if not num_sparse:
        return base, base
    expert = 3 * hidden * config.moe_intermediate_size
    shared = 3 * hidden * config.shared_expert_intermediate_size
    shared += hidden if shared else 0  # its gate
    base += num_sparse * (shared + hidden * config.num_experts)  # and the router
    return (base + num_sparse * config.num_experts_per_tok * expert,
            base + num_sparse * config.num_experts * expert)
