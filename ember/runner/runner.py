"""ModelRunner.execute(plan) -> RunnerOutput: inputs, forward, logits, sample.

Where the model is split over several processes (tensor parallel, ember/distributed/), this
runner is the driver rank's: before each forward it hands the step to `peers`, which has the
other ranks' runners run the same forward on their parts of the model; only the driver
samples.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from ember.config import SpecConfig
from ember.errors import EngineDead
from ember.kernels import CpuKernels
from ember.lora.batch import LoraStep, LoraStepBuilder
from ember.lora.ranks import AdapterPart, RankAdapters, StepAdapters
from ember.lora.registry import LoraRegistry
from ember.models.attention import PagedKV
from ember.models.llama import LlamaForCausalLM
from ember.request import Request
from ember.runner.drafter import Drafter
from ember.quant.packed import rows_of_kind, share_step_rows
from ember.runner.inputs import (ModelInputs, by_kind_parts, copy_slot_batches,
                                 micro_batches, prepare_inputs)
from ember.runner.pooling import Pooler
from ember.sampling.sampler import Sampler, argmax_alone
from ember.scheduler.output import RunnerOutput, ScheduledRequest, SchedulerOutput
from ember.spec.ngram import propose_ngram
from ember.spec.verify import verify

if TYPE_CHECKING:
    from ember.kv_transfer.shm import SharedKV


# Sampling rows from which a split output projection's ranks send each row's best token
# rather than their logits: gathering logits costs a copy of 4 bytes per vocabulary row and
# sampling row (~0.3 ms a step at 32 rows of the default model, on two ranks), sending the
# best tokens a dozen small torch ops (more than the copy of one row's logits)
ARGMAX_APART_ROWS = 8


@dataclass(frozen=True)
class ForwardStep:
    """One forward as every rank runs it: the runner method ("forward", "forward_argmax"
    (a forward of which the driver reads only each sampling row's argmax: the ranks of a
    split output projection then send their best token, not their logits), "forward_all"
    or "draft", a self-draft's), its plan, plain data (token ids, positions, block tables) from
    which each rank builds its own tensors, and its LoRA adapters (None: neither any row's
    nor any to forget)."""

    method: str
    plan: SchedulerOutput
    adapters: StepAdapters | None = None


class Calibration(Protocol):
    """A rank's side of the int8 prompt matmuls' calibration (ember/engine/calibrate.py's
    RankCalibration), which every rank runs around the same calibration prompt."""

    def start(self) -> None:
        """Record the inputs of this rank's linears from now on."""

    def stop(self) -> None:
        """Stop recording."""

    def finish(self) -> int:
        """Stop recording and make this rank's int8 weights; how many linears."""


class StepPeers(Protocol):
    """The other ranks of a model split over processes (ember/distributed/executor.py)."""

    def send(self, step: ForwardStep) -> None:
        """Have every other rank run `step` (they join this rank's collectives)."""

    def failed(self, error: BaseException) -> EngineDead:
        """What a forward that raised means for the engine: its ranks are out of step."""


@dataclass
class PipelineBubble:
    """How much of its time a pipeline stage idles, by the schedule: a forward of m
    micro-batches through P stages takes m + P - 1 slots, of which each stage works m (with
    micro-batches of equal time), so P - 1 idle: one micro-batch idles (P-1)/P."""

    num_stages: int
    idle_slots: int = 0
    slots: int = 0

    def add(self, num_micro_batches: int) -> None:
        self.idle_slots += self.num_stages - 1
        self.slots += num_micro_batches + self.num_stages - 1

    @property
    def share(self) -> float:
        """Idle slots / all slots, over every forward so far (0 before any)."""
        return self.idle_slots / self.slots if self.slots else 0.0


class ModelRunner:
    # this rank's KV cache in a memory file (kv_transfer/shm.py SharedKV), which the driver
    # maps: a worker rank of a prefill or decode replica, whose driver moves its blocks
    kv_shared: SharedKV | None = None

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[PagedKV], block_size: int,
                 device: str, seed: int, kernels: CpuKernels | None = None,
                 loras: LoraRegistry | None = None, spec: SpecConfig = SpecConfig(),
                 drafter: Drafter | None = None,
                 place_lora: Callable[[list[Tensor]], list[Tensor]] | None = None,
                 batch_invariant: bool = False, peers: StepPeers | None = None,
                 vocab_size: int | None = None, micro_batches: int = 1,
                 num_stages: int = 1, lora_part: AdapterPart | None = None,
                 calibration: Calibration | None = None) -> None:
        """`loras`: the adapters a driver reads (None on the other ranks, which get theirs
        with the steps); `lora_part`: this rank's part of a whole adapter (None: all of it,
        the model being whole here); `calibration`: this rank's side of the int8 prompt
        matmuls' calibration (None: the model has none)."""
        self.model = model
        self.calibration = calibration
        # a step's forwards are cut into this many runs of requests at most (a pipeline's
        # micro-batches, which its stages work on at once); 1 without pipeline parallel
        self.micro_batches = micro_batches
        self.bubble = PipelineBubble(num_stages)
        self.peers = peers   # the model's other ranks (None: it runs in this process alone)
        # the logits' width: the whole vocabulary where this rank's model holds a part and
        # its logits are gathered here; 0 on the other ranks, which get none
        self.vocab_size = model.config.vocab_size if vocab_size is None else vocab_size
        # every row by its kind, whatever the step holds: prompt rows and decode rows run as
        # two forwards, each on its kind's path (docs/architecture.md, "Same request, same
        # answer"); with batch_invariant, decode rows on the packed weights at any count
        self.batch_invariant = batch_invariant
        self.step_rows = share_step_rows(model)
        self.spec = spec
        self.drafter = drafter   # drafts with a model (self-draft or a draft model), else n-gram
        if drafter is not None and drafter.shares_kv and peers is not None:
            # a self-draft's layers are the target's, split over the ranks as they are
            drafter.everywhere = lambda plan: self._on_every_rank(ForwardStep("draft", plan))
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(seed, self.device, kernels)
        self.loras = loras
        # the activations' dtype: the norms are never quantized
        self.lora_steps = LoraStepBuilder(model.model.norm.weight.dtype, self.device,
                                          kernels, place_lora)
        self.rank_loras = RankAdapters(lora_part, self.lora_steps.forget)
        # uids the registry dropped (from any thread), for every rank to forget with a step
        self._evicted: deque[int] = deque()
        if loras is not None:
            loras.on_evict = self._on_evict
        self.pooler = Pooler()

    def _on_evict(self, uid: int) -> None:
        self.lora_steps.forget(uid)
        self._evicted.append(uid)

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput, pooled: dict[str, list[float]] | None = None
                ) -> tuple[list[Request], Tensor]:
        """Run the model over the plan's tokens, writing their K/V into the cache.

        Returns the requests that sample this step and the logits of their rows [R, vocab]
        float32: a row each, or 1 + its drafts for a request verifying drafts
        (rows_per_request); `pooled`, if given, gets the vectors of the embedding requests
        whose prompt ended.
        """
        return self._forward(ForwardStep("forward", plan, self._step_adapters(plan)), pooled)

    def _forward(self, step: ForwardStep, pooled: dict[str, list[float]] | None = None
                 ) -> tuple[list[Request], Tensor]:
        plan = step.plan
        with self._on_every_rank(step):
            uids = self._take_adapters(step.adapters)
            self._copy_blocks(plan)
            # every part's forward first, then their logits: on a pipeline the driver's
            # stage then runs micro-batch i + 1 while the next stage runs micro-batch i
            parts = self._parts(plan)
            self.bubble.add(len(parts))   # back to back through the stages
            forwards = [self._forward_part(part, pooled, prompt, uids)
                        for prompt, part in parts]
            requests: list[Request] = []
            logits: list[Tensor] = []
            argmax = step.method == "forward_argmax"
            for inputs, part_hidden in forwards:
                part_requests, part_logits = self._logits(inputs, part_hidden, argmax)
                requests += part_requests
                logits.append(part_logits)
            self._finish_sends()
        if len(logits) == 1:
            return requests, logits[0]
        return requests, torch.cat(logits)

    def _parts(self, plan: SchedulerOutput) -> list[tuple[bool | None, SchedulerOutput]]:
        """The plan as the forwards that run it: prompt rows, then decode rows (each with
        the kind its linears take: StepRows' True prompt, False decode, None by their
        number), each cut into micro-batches on a pipeline."""
        parts = []
        for prompt, part in by_kind_parts(plan):
            kind = True if prompt else (False if self.batch_invariant else None)
            parts += [(kind, batch) for batch in micro_batches(part, self.micro_batches)]
        return parts

    def _finish_sends(self) -> None:
        """Wait for this rank's sends to the next stage (or the driver) to be taken."""
        link = self.model.stage_link
        if link is not None:
            link.finish()

    @contextmanager
    def _on_every_rank(self, step: ForwardStep) -> Iterator[None]:
        """Run `step` here and on the peers; a failure there or here (the ranks are then out
        of step) is the engine's death, EngineDead, not a request's fault."""
        if self.peers is None:
            yield
            return
        try:
            self.peers.send(step)
            yield
        except EngineDead:
            raise
        except Exception as e:
            raise self.peers.failed(e) from e

    @torch.inference_mode()
    def run_step(self, step: ForwardStep) -> None:
        """A peer rank's side of a driver's step (its outputs stay with the driver)."""
        if step.method in ("forward", "forward_argmax"):
            self._forward(step)
        elif step.method == "forward_all":
            self._forward_all(step)
        elif step.method == "draft" and self.drafter is not None:
            self.drafter.forward_logits(step.plan)   # (the driver's drafter takes the argmax)
        elif step.method in ("calibrate_start", "calibrate_finish"):
            self._calibrate(step.method.removeprefix("calibrate_"))
        else:
            raise ValueError(f"unknown step method {step.method!r}")

    def calibrate(self, phase: str) -> int:
        """The int8 prompt matmuls' calibration on every rank: "start" records each rank's
        linears' inputs over the steps that follow (the calibration prompt's, which every
        rank runs), "finish" makes each rank's int8 weights from them; returns how many
        linears this rank's has (0 for "start")."""
        with self._on_every_rank(ForwardStep(f"calibrate_{phase}", SchedulerOutput([]))):
            return self._calibrate(phase)

    def _calibrate(self, phase: str) -> int:
        if self.calibration is None:
            raise RuntimeError("this rank's runner has no calibration")
        if phase == "start":
            self.calibration.start()
            return 0
        return self.calibration.finish()

    def _forward_part(self, plan: SchedulerOutput, pooled: dict[str, list[float]] | None,
                      prompt: bool | None, uids: dict[str, int]) -> tuple[ModelInputs, Tensor]:
        """forward() of a part of by_kind_parts, whose linears take rows as `prompt` says
        (StepRows: True prompt rows, False decode rows, None by their number): its inputs
        and final hidden states."""
        inputs = prepare_inputs(plan, self.block_size, self.device,
                                self.model.stack_runs_decodes(self.kv_caches),
                                self.model.attends_chunks_alone(self.kv_caches),
                                by_kind=True, share=self.model.head_share)
        with rows_of_kind(self.step_rows, prompt):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                inputs.attn, self._lora_step(plan, uids))
        link = self.model.stage_link
        if link is not None and any(s.request.pooling is not None for s in plan.scheduled):
            hidden = link.final(hidden)   # a pipeline's last stage's, on the driver
        if pooled is not None:
            pooled.update(self.pooler.pool(plan, hidden))
        return inputs, hidden

    def _logits(self, inputs: ModelInputs, hidden: Tensor, argmax: bool = False
                ) -> tuple[list[Request], Tensor]:
        """The sampling requests and their rows' logits [R, vocab] float32, or with `argmax`
        each row's argmax [R] long."""
        if not inputs.sampling_requests:
            if argmax:
                return [], hidden.new_empty((0,), dtype=torch.long)
            return [], hidden.new_empty((0, self.vocab_size), dtype=torch.float32)
        if inputs.logits_indices is not None:
            hidden = hidden[inputs.logits_indices]
        if argmax:
            return inputs.sampling_requests, self.model.compute_argmax(hidden)
        return inputs.sampling_requests, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward_all(self, plan: SchedulerOutput) -> tuple[ModelInputs, Tensor]:
        """Like forward(), but logits [T, vocab] float32 for every new token of the step (for
        scoring text); rows follow the flat batch of `prepare_inputs`."""
        return self._forward_all(ForwardStep("forward_all", plan, self._step_adapters(plan)))

    def _forward_all(self, step: ForwardStep) -> tuple[ModelInputs, Tensor]:
        plan = step.plan
        with self._on_every_rank(step):
            uids = self._take_adapters(step.adapters)
            self._copy_blocks(plan)
            # scored text is prompt rows: on the prompt path as any prompt takes it
            by_kind = all(s.end <= s.request.num_prompt_tokens for s in plan.scheduled)
            inputs = prepare_inputs(plan, self.block_size, self.device, chunks_alone=by_kind
                                    and self.model.attends_chunks_alone(self.kv_caches),
                                    by_kind=by_kind, share=self.model.head_share)
            with rows_of_kind(self.step_rows, True if by_kind else None):
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                    inputs.attn, self._lora_step(plan, uids))
            logits = self.model.compute_logits(hidden)
            self._finish_sends()
            return inputs, logits

    def _step_adapters(self, plan: SchedulerOutput) -> StepAdapters | None:
        """The driver's side: the adapters the step's rows name, read where they are not
        resident (before any rank starts the step: a failure here is the requests', and
        the ranks stay in step), with what the ranks must forget first; None where there
        is neither."""
        names = {s.request.lora for s in plan.scheduled if s.request.lora is not None}
        if self.loras is None or not (names or self._evicted):
            return None
        adapters = {name: self.loras.acquire(name) for name in sorted(names)}
        evicted = []
        while self._evicted:
            evicted.append(self._evicted.popleft())
        step, later = self.rank_loras.plan(adapters, evicted)
        self._evicted.extend(later)
        return step

    def _take_adapters(self, step: StepAdapters | None) -> dict[str, int]:
        """Apply a step's loads and forgets to this rank's adapters; its uids by name."""
        if step is None:
            return {}
        self.rank_loras.apply(step)
        return step.uids

    def _lora_step(self, plan: SchedulerOutput, uids: dict[str, int]) -> LoraStep | None:
        """The step's adapters, row by row (rows follow plan.scheduled), or None."""
        if all(s.request.lora is None for s in plan.scheduled):
            return None
        return self.lora_steps.build([
            (None if s.request.lora is None else self.rank_loras.get(uids[s.request.lora]),
             s.num_new_tokens) for s in plan.scheduled])

    def _copy_blocks(self, plan: SchedulerOutput) -> None:
        """Partial prefix-cache hits: copy cached slots into the requests' own blocks (two
        torch ops per layer for the whole step, where there are several)."""
        for src, dst in copy_slot_batches(plan.block_copies, self.block_size, self.device):
            for cache in self.kv_caches:
                cache.copy_slots(src, dst)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        self.sampler.forget(plan.finished_request_ids)
        self.pooler.forget(plan.finished_request_ids)
        if self.drafter is not None:
            self.drafter.forget(plan.finished_request_ids)
        if not plan.scheduled:
            return RunnerOutput()
        output = RunnerOutput()
        if self._argmax_only(plan):   # the ranks' best tokens, not their logits
            requests, best = self._forward(ForwardStep("forward_argmax", plan,
                                                       self._step_adapters(plan)), output.pooled)
            tokens = [[t] for t in best.tolist()]
            logprob_lists: list[list | None] = [None] * len(requests)
        else:
            requests, logits = self.forward(plan, output.pooled)
            if requests:
                tokens, logprob_lists = self._sample(plan, requests, logits)
        if not requests:
            return output
        for request, emitted, logprob in zip(requests, tokens, logprob_lists):
            output.sampled_token_ids[request.request_id] = emitted
            if logprob is not None:
                output.logprobs[request.request_id] = logprob
        if self.spec.enabled and len(plan.scheduled) < self.spec.max_spec_rows:
            self._propose(plan, requests, tokens, output)
        return output

    def _sample(self, plan: SchedulerOutput, requests: list[Request], logits: Tensor
                ) -> tuple[list[list[int]], list[list | None]]:
        """Each sampling request's tokens (one, or those its drafts earn) and logprobs."""
        counts = _rows_per_request(requests, plan.scheduled)
        if counts is not None:
            return self._verify(plan, requests, counts, logits)
        token_ids, logprobs = self.sampler.sample(logits, requests)
        return [[t] for t in token_ids], [None if lp is None else [lp] for lp in logprobs]

    def _argmax_only(self, plan: SchedulerOutput) -> bool:
        """Whether the step's tokens are the argmax of the model's logits and nothing else
        reads them (every row plain greedy, none verifying drafts), where the output
        projection is split over ranks that can then send their best tokens instead, and
        the step samples enough rows for that to pay (the tokens are the same either way)."""
        return self.model.argmax_apart() and \
            sum(s.samples for s in plan.scheduled) >= ARGMAX_APART_ROWS and all(
                not s.draft_token_ids and argmax_alone(s.request) for s in plan.scheduled)

    def _verify(self, plan: SchedulerOutput, requests: list[Request], counts: list[int],
                logits: Tensor) -> tuple[list[list[int]], list[list | None]]:
        """A step with drafts: requests without any sample as usual (grammars advance there),
        those with drafts are verified. counts: logits rows per request."""
        drafts = _drafts_by_request(plan.scheduled)
        starts = [sum(counts[:i]) for i in range(len(counts))]
        plain = [i for i, n in enumerate(counts) if n == 1]
        spec = [i for i, n in enumerate(counts) if n > 1]
        tokens: list[list[int]] = [[] for _ in requests]
        logprobs: list[list | None] = [None] * len(requests)
        if plain:
            ids, lps = self.sampler.sample(logits[[starts[i] for i in plain]],
                                           [requests[i] for i in plain])
            for i, t, lp in zip(plain, ids, lps):
                tokens[i], logprobs[i] = [t], None if lp is None else [lp]
        rows = [r for i in spec for r in range(starts[i], starts[i] + counts[i])]
        spec_tokens, spec_logprobs = verify(
            self.sampler, logits[rows], [requests[i] for i in spec],
            [drafts[requests[i].request_id] for i in spec])
        for i, t, lp in zip(spec, spec_tokens, spec_logprobs):
            tokens[i], logprobs[i] = t, lp
        return tokens, logprobs

    def _propose(self, plan: SchedulerOutput, requests: list[Request],
                 tokens: list[list[int]], output: RunnerOutput) -> None:
        """Drafts for the next step, from each request's sequence with this step's tokens
        (constrained requests draft nothing: their grammar advances token by token; nor do
        requests too close to max_tokens for the next step to verify a draft)."""
        spec = self.spec
        items = {s.request.request_id: s for s in plan.scheduled}
        candidates = [(items[r.request_id], r.all_token_ids + emitted)
                      for r, emitted in zip(requests, tokens)
                      if r.grammar is None and r.spec_pause == 0
                      and r.max_tokens - len(r.output_token_ids) - len(emitted) >= 2]
        if self.drafter is not None:
            drafts = self.drafter.propose(candidates, spec.num_speculative_tokens)
        else:
            drafts = {item.request.request_id: propose_ngram(
                token_ids, spec.num_speculative_tokens, spec.ngram_max, spec.ngram_min)
                for item, token_ids in candidates}
        output.draft_token_ids.update((rid, d) for rid, d in drafts.items() if d)


def _rows_per_request(requests: list[Request], scheduled: list[ScheduledRequest]
                      ) -> list[int] | None:
    """Logits rows of each sampling request in `requests`' order (1 + its drafts), where any
    verifies drafts; None where every one has a single row."""
    if not any(item.draft_token_ids for item in scheduled):
        return None
    drafts = _drafts_by_request(scheduled)
    return [1 + len(drafts[r.request_id]) for r in requests]


def _drafts_by_request(scheduled: list[ScheduledRequest]) -> dict[str, tuple[int, ...]]:
    return {s.request.request_id: s.draft_token_ids for s in scheduled}
