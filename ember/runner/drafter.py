"""Drafting with a model: a few greedy forwards of a small model (or of the target's first
layers, ember/spec/layer_skip.py) guess each request's next tokens.

After a step, a request's sequence ends with the token the target just chose, x_n at
position n; the target's cache holds positions 0 .. n-1. The drafter runs

    forward 0:  the positions its cache lacks, up to x_n    -> d_0 (argmax)
    forward j:  d_{j-1} at position n + j                    -> d_j

in one batch of every drafting request per forward. Drafts are argmaxes whatever the request
samples with: a proposer that puts all its mass on one token is what verification's rejection
sampling assumes (ember/spec/verify.py), so the output keeps the target's distribution.

Where the K and V go: the draft writes positions n .. n+k-1 in the request's own blocks (the
scheduler allots slots ahead for it: SpecConfig.drafts_with_a_model).
* Self-draft (`shares_kv`): its layers are the target's first ones and it writes into the
  target's caches of those layers. Positions below n hold the target's K and V, which are the
  draft's too; positions from n on are rewritten by the target's verification before it reads
  them. Nothing is kept between steps.
* A draft model has caches of its own, laid out like the target's (same blocks, same slots).
  It has computed positions 0 .. n of the sequence after drafting; past n its K and V are of
  drafts, which the target may reject, and may lie in blocks the scheduler trims: only
  positions up to n are counted valid, and the next drafting starts there.

Split over ranks, a self-draft's layers are each rank's part of the target's first layers
(its heads and columns, its pipeline stage's layers), with their all-reduces and sends, and
its logits reach the driver as the target's do: `everywhere` then has the other ranks run
each of the driver's draft forwards beside it (ember/runner/runner.py), with forward_logits.

With `by_kind` (a draft model) a forward runs its prompt rows and its generated ones apart, as
the target does (ember/runner/inputs.py by_kind_parts): a draft model with the
target's numerics then guesses what the target computes.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ember.models.attention import PagedKV
from ember.models.llama import LlamaForCausalLM
from ember.request import Request
from ember.quant.packed import rows_of_kind, share_step_rows
from ember.runner.inputs import by_kind_parts, prepare_inputs
from ember.scheduler.output import ScheduledRequest, SchedulerOutput


@dataclass
class _Sequence:
    """What prepare_inputs reads of a request: its tokens, here with the drafts so far."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    share_key: int = 0
    lora: None = None
    pooling: None = None


@dataclass
class _Valid:
    """Positions of a request whose K and V the draft model's caches hold (before the
    request's `num_preemptions`-th preemption, which frees its blocks)."""

    num_preemptions: int
    num_tokens: int


@dataclass
class Drafter:
    model: LlamaForCausalLM        # the draft model, or the target's first layers
    kv_caches: list[PagedKV]       # its caches: the target's first ones when shares_kv
    block_size: int
    device: torch.device
    shares_kv: bool
    max_positions: int             # positions must stay below it (the RoPE tables' length)
    by_kind: bool = False          # prompt and generated rows apart, as the target runs them
    # where the draft's layers are split over ranks: has the other ranks run a forward's plan
    # beside this one's (None: the draft runs in this process alone)
    everywhere: Callable[[SchedulerOutput], AbstractContextManager[None]] | None = None
    _valid: dict[str, _Valid] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._step_rows = share_step_rows(self.model)

    def forget(self, request_ids: frozenset[str]) -> None:
        for rid in request_ids:
            self._valid.pop(rid, None)

    @torch.inference_mode()
    def propose(self, items: list[tuple[ScheduledRequest, list[int]]],
                num_drafts: int) -> dict[str, list[int]]:
        """items: (the request's share of the step, its tokens with those the step emitted);
        -> up to `num_drafts` drafts per request (fewer where its slots end)."""
        sequences, starts, budgets, tables = [], [], [], []
        for item, token_ids in items:
            n = len(token_ids) - 1
            room = min(len(item.block_ids) * self.block_size, self.max_positions) - n
            budget = min(num_drafts, room)
            if budget < 1:
                continue
            sequences.append(_Sequence(item.request.request_id, list(token_ids),
                                       item.request.num_prompt_tokens,
                                       item.request.share_key))
            starts.append(n if self.shares_kv else self._start(item.request, n))
            budgets.append(budget)
            tables.append(item.block_ids)
        drafts: dict[str, list[int]] = {s.request_id: [] for s in sequences}
        for j in range(max(budgets, default=0)):
            live = [i for i, b in enumerate(budgets) if b > j]
            plan = [self._share(sequences[i], starts[i] if j == 0 else None, tables[i])
                    for i in live]
            for i, token in zip(live, self._argmax(plan)):
                sequences[i].all_token_ids.append(token)
                drafts[sequences[i].request_id].append(token)
        if not self.shares_kv:   # positions up to each newest token are computed now
            for item, token_ids in items:
                if item.request.request_id in drafts:
                    self._valid[item.request.request_id] = _Valid(
                        item.request.num_preemptions, len(token_ids))
        return drafts

    def _start(self, request: Request, n: int) -> int:
        """The first position the draft model's caches lack for this request (at most n)."""
        valid = self._valid.get(request.request_id)
        if valid is None or valid.num_preemptions != request.num_preemptions:
            return 0
        return min(valid.num_tokens, n)

    @staticmethod
    def _share(sequence: _Sequence, start: int | None, table: list[int]) -> ScheduledRequest:
        """The forward's share of one request: from `start` to its newest token, or (None)
        its newest token alone (the latest draft)."""
        end = len(sequence.all_token_ids)
        first = end - 1 if start is None else start
        return ScheduledRequest(sequence, first, end - first, table, samples=True)  # type: ignore[arg-type]

    def _argmax(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """One forward of the draft over `scheduled` (on every rank, where it is split);
        each request's argmax token."""
        plan = SchedulerOutput(scheduled)
        tokens: dict[str, int] = {}
        with nullcontext() if self.everywhere is None else self.everywhere(plan):
            for requests, logits in self.forward_logits(plan):
                tokens.update((r.request_id, t)
                              for r, t in zip(requests, logits.argmax(-1).tolist()))
        return [tokens[item.request.request_id] for item in scheduled]

    @torch.inference_mode()
    def forward_logits(self, plan: SchedulerOutput) -> list[tuple[list, Tensor]]:
        """The draft's forward over `plan` (two with by_kind: prompt rows, then generated
        ones): each part's sampling requests and their logits [R, vocab] float32 ([R, 0] on
        a rank whose logits are gathered on the driver)."""
        parts = by_kind_parts(plan) if self.by_kind else [(None, plan)]
        out = []
        for prompt, part in parts:
            inputs = prepare_inputs(part, self.block_size, self.device,
                                    self.model.stack_runs_decodes(self.kv_caches),
                                    prompt is not None and
                                    self.model.attends_chunks_alone(self.kv_caches),
                                    by_kind=prompt is not None, share=self.model.head_share)
            # (decode rows by their number: a step drafts for fewer than 8 requests)
            with rows_of_kind(self._step_rows, prompt or None):
                hidden: Tensor = self.model(inputs.input_ids, inputs.positions,
                                            self.kv_caches, inputs.attn)
            if inputs.logits_indices is not None:
                hidden = hidden[inputs.logits_indices]
            out.append((inputs.sampling_requests, self.model.compute_logits(hidden)))
            if self.model.stage_link is not None:   # this stage's sends taken
                self.model.stage_link.finish()
        return out
