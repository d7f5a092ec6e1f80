"""The boundary between the scheduler and the runner: plain data both sides agree on."""
from __future__ import annotations

from dataclasses import dataclass, field

from ember.kv.kv_manager import BlockCopy
from ember.request import Request, SampledLogprob


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: tokens [start, start + num_new_tokens) are computed."""

    request: Request
    start: int               # num_computed_tokens when scheduled
    num_new_tokens: int
    block_ids: list[int]     # the request's block table (covers start + num_new_tokens)
    samples: bool            # reaches the newest token, so a new one is sampled (False for
                             # the leading chunks of a chunked prefill, and for embeddings)
    # speculative decoding: guesses of the tokens after the newest one, computed after it in
    # this step (they are the last len(draft_token_ids) of the num_new_tokens)
    draft_token_ids: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class KVLoad:
    """Another replica's KV of a request's first tokens, to copy into its blocks: the blocks
    before `first_block` were in this replica's prefix cache, the rest are to be filled.

        block_ids:  [0, first_block)          cached here: skipped
                    [first_block, len)        allocated for the copy, not yet written
    """

    request_id: str
    block_ids: list[int]
    first_block: int


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_request_ids: frozenset[str] = frozenset()  # freed since the last step
    block_copies: list[BlockCopy] = field(default_factory=list)  # made, in order, before
                                                                 # the step writes any KV

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_new_tokens(self) -> dict[str, int]:
        return {s.request.request_id: s.num_new_tokens for s in self.scheduled}


@dataclass
class RunnerOutput:
    """Tokens sampled this step, per request (a list: speculative decoding may add several:
    the accepted drafts, then the target model's own token), the drafts proposed for the
    next step, and the vectors of the embedding requests whose last prompt chunk ran."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[SampledLogprob]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)
