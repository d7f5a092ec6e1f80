"""Turn a step's logits into tokens: processors, then greedy or random choice, then logprobs.

Random choice uses the exponential race: argmax(p / q) with q ~ Exp(1) picks token i with
probability p_i, needs no cumulative sums, and takes its noise from the engine's generator, or,
when the request has a seed, from a generator seeded by the seed and the position of the token
drawn (position_seed). A seeded request's sample at a position is then a function of the request
alone: whatever else shares the batch, after a preemption, and with speculation, whose
verification accepts a draft exactly when this draw picks it (ember/spec/verify.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

from ember.kernels import CpuKernels
from ember.request import Request, SampledLogprob
from ember.sampling import processors as P
from ember.sampling.grammar import Matcher, apply_bitmask, new_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors; None where no row of the batch uses a feature."""

    temperature: Tensor | None = None    # [B] float32; 0 marks a greedy row (None: all are)
    top_k: Tensor | None = None          # [B] long, 0 = off
    top_p: Tensor | None = None          # [B] float32
    min_p: Tensor | None = None          # [B] float32
    repetition: Tensor | None = None     # [B]
    seen: Tensor | None = None           # [B, V] bool: token in prompt or output
    presence: Tensor | None = None       # [B]
    frequency: Tensor | None = None      # [B]
    counts: Tensor | None = None         # [B, V] float32: output token counts
    bias: tuple[Tensor, Tensor, Tensor] | None = None  # rows, token ids, values [N]
    banned: tuple[Tensor, Tensor] | None = None  # rows, token ids [N] (min_tokens holds
    #                                              EOS back)
    num_logprobs: int | None = None      # the most any row asks for


def _column(values: list[float], device: torch.device, dtype: torch.dtype = torch.float32
            ) -> Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _entries(entries: list[tuple], device: torch.device) -> tuple[Tensor, ...]:
    """[(row, token_id[, value]), ...] -> rows and token ids as long columns (and values as a
    float32 one): where a sparse processor acts."""
    columns = list(zip(*entries))
    return tuple(_column(list(c), device, torch.long if i < 2 else torch.float32)
                 for i, c in enumerate(columns))


def build_sampling_batch(requests: list[Request], vocab_size: int,
                         device: torch.device) -> SamplingBatch:
    """Gather the settings of the requests that sample this step, one row each."""
    params = [r.params for r in requests]
    batch = SamplingBatch()
    if not all(p.greedy for p in params):   # greedy rows read no temperature
        batch.temperature = _column([p.temperature for p in params], device)
    if any(p.top_k > 0 for p in params):
        batch.top_k = _column([p.top_k for p in params], device, torch.long)
    if any(p.top_p < 1 for p in params):
        batch.top_p = _column([p.top_p for p in params], device)
    if any(p.min_p > 0 for p in params):
        batch.min_p = _column([p.min_p for p in params], device)
    if any(p.repetition_penalty != 1 for p in params):
        batch.repetition = _column([p.repetition_penalty for p in params], device)
        batch.seen = _token_mask([r.all_token_ids for r in requests], vocab_size, device)
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        batch.presence = _column([p.presence_penalty for p in params], device)
        batch.frequency = _column([p.frequency_penalty for p in params], device)
        batch.counts = _token_counts([r.output_token_ids for r in requests], vocab_size, device)
    if any(p.logit_bias for p in params):
        batch.bias = _entries([(row, token_id, value) for row, p in enumerate(params)
                               for token_id, value in (p.logit_bias or {}).items()], device)
    held_back = [(row, token_id) for row, r in enumerate(requests)
                 for token_id in _held_back_ids(r)]
    if held_back:
        batch.banned = _entries(held_back, device)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    batch.num_logprobs = max(wanted) if wanted else None
    return batch


def argmax_alone(request: Request) -> bool:
    """Greedy with nothing that changes or reads the logits (no bias, penalty, grammar, held
    back stop token or logprobs): the argmax of the model's logits is the token. Such a step
    skips the batch's settings (a batch-1 step's sampling 65-75 -> ~30 us on cold caches)."""
    p = request.params
    return (p.greedy and request.grammar is None and p.logprobs is None and not p.logit_bias
            and p.repetition_penalty == 1 and not p.presence_penalty
            and not p.frequency_penalty and not _held_back_ids(request))


def _held_back_ids(request: Request) -> list[int]:
    """Stop tokens may not end a request before it has min_tokens outputs."""
    if len(request.output_token_ids) >= request.params.min_tokens:
        return []
    return sorted(request.eos_token_ids | set(request.params.stop_token_ids))


def _token_mask(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    for i, ids in enumerate(rows):
        if ids:
            mask[i, torch.tensor(ids, device=device)] = True
    return mask


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    counts = torch.zeros(len(rows), vocab_size, device=device)
    for i, ids in enumerate(rows):
        if ids:
            counts[i] = torch.bincount(torch.tensor(ids, device=device),
                                       minlength=vocab_size).float()
    return counts


def process_logits(logits: Tensor, batch: SamplingBatch, in_place: bool = False) -> Tensor:
    """Bias, bans and penalties: what both greedy and random choice see. [B, V] float32.
    With `in_place`, `logits` may be overwritten (the caller reads them no more)."""
    if batch.bias is not None:
        logits = P.apply_logit_bias(logits, *batch.bias, in_place=in_place)
        in_place = True   # a tensor of our own from here on
    if batch.repetition is not None:
        logits = P.apply_repetition_penalty(logits, batch.seen, batch.repetition)
        in_place = True
    if batch.counts is not None:
        logits = P.apply_presence_frequency_penalties(logits, batch.counts, batch.presence,
                                                      batch.frequency)
        in_place = True
    if batch.banned is not None:
        logits = P.mask_tokens(logits, *batch.banned, in_place=in_place)
    return logits


def sampling_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Temperature, top-k, top-p and min-p applied to processed logits -> probabilities."""
    if batch.temperature is None:
        raise ValueError("sampling_probs needs the rows' temperatures (a batch of greedy rows "
                         "has none): sample greedy rows with argmax_rows")
    temperature = batch.temperature.clamp(min=1e-5)  # greedy rows are not read from this
    # +inf (a seen token under a vanishing repetition penalty) becomes the largest finite
    # logit, so the tokens it forces share the probability rather than softmax giving NaN
    logits = P.apply_temperature(logits, temperature).clamp(max=torch.finfo(logits.dtype).max)
    if batch.top_k is not None or batch.top_p is not None:
        logits = P.apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        logits = P.apply_min_p(logits, batch.min_p)
    return logits.softmax(dim=-1)


def position_seed(seed: int, position: int) -> int:
    """The seed of the noise a seeded request draws its token at `position` with (64 bits).
    Seeds are taken mod 2**64, as torch reads them (-1 and 2**64 - 1 draw alike)."""
    digest = hashlib.blake2b((seed % 2**64).to_bytes(8, "little")
                             + position.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """Holds the random state: one generator for unseeded requests; a seeded request's noise
    comes from its seed and the position drawn (position_seed)."""

    def __init__(self, seed: int, device: torch.device,
                 kernels: CpuKernels | None = None) -> None:
        self.device = device
        self.kernels = kernels  # compiled CPU kernels (their argmax), if the engine has them
        self.generator = torch.Generator(device).manual_seed(seed)
        self._positional = torch.Generator(device)   # reseeded per seeded draw
        self._matchers: dict[str, Matcher] = {}

    def forget(self, request_ids: frozenset[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def _constrain(self, logits: Tensor, requests: list[Request]
                   ) -> tuple[Tensor, list[Matcher | None]]:
        """The logits with every token a request's grammar forbids now set to -inf (a copy,
        when any row is constrained: logprobs still report the model's own distribution)."""
        matchers: list[Matcher | None] = []
        for r in requests:
            if r.grammar is not None and r.request_id not in self._matchers:
                self._matchers[r.request_id] = Matcher(r.grammar)
            matchers.append(self._matchers.get(r.request_id))
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits, matchers
        bitmask = new_bitmask(len(requests), logits.shape[-1])
        for i in rows:
            matchers[i].fill_mask(bitmask, i)
        masked = logits.clone()
        apply_bitmask(masked, bitmask, rows)
        return masked, matchers

    def noise(self, out: Tensor, request: Request, position: int) -> Tensor:
        """Fill out [V] with Exp(1) noise for `request`'s token at `position` (its sequence's
        length when drawn): from the seed and the position where the request has a seed,
        else from the engine's generator."""
        seed = request.params.seed
        if seed is None:
            return out.exponential_(generator=self.generator)
        self._positional.manual_seed(position_seed(seed, position))
        return out.exponential_(generator=self._positional)

    def sample(self, logits: Tensor, requests: list[Request]
               ) -> tuple[list[int], list[SampledLogprob | None]]:
        """logits [B, V] float32, one row per request -> a token per row (+ logprobs if asked).
        Overwrites `logits` where no row asks for logprobs (the runner reads them no more)."""
        if all(argmax_alone(r) for r in requests):   # the usual greedy step
            return self._argmax(logits).tolist(), [None] * len(requests)
        batch = build_sampling_batch(requests, logits.shape[-1], logits.device)
        masked, matchers = self._constrain(logits, requests)
        # the model's own logits are read again only for logprobs; a masked copy never
        processed = process_logits(masked, batch,
                                   in_place=masked is not logits or batch.num_logprobs is None)
        _let_finished_grammars_stop(processed, requests, matchers)
        tokens = self._argmax(processed)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            probs = sampling_probs(processed[random_rows], _rows(batch, random_rows))
            noise = torch.empty_like(probs)
            for j, row in enumerate(random_rows):
                self.noise(noise[j], requests[row], len(requests[row].all_token_ids))
            tokens[random_rows] = self._argmax(probs / noise)
        token_list = tokens.tolist()
        for matcher, token_id in zip(matchers, token_list):
            if matcher is not None and not matcher.accept(token_id):
                raise RuntimeError(f"the grammar refused token {token_id} that its own mask "
                                   "allowed")
        return token_list, self._logprobs(logits, tokens, requests, batch.num_logprobs)

    def _argmax(self, x: Tensor) -> Tensor:
        """argmax_rows(x), on the compiled kernel where there is one (a vector pass: ~7 us
        for a row of 49152 where torch's argmax takes 47-85)."""
        if self.kernels is not None and x.dtype == torch.float32 and x.stride(-1) == 1:
            return self.kernels.argmax_rows(x)
        return argmax_rows(x)

    @staticmethod
    def _logprobs(logits: Tensor, tokens: Tensor, requests: list[Request],
                  num_top: int | None) -> list[SampledLogprob | None]:
        """Log-probabilities under the model's own distribution (before any processing)."""
        if num_top is None:
            return [None] * len(requests)
        logprobs = logits.log_softmax(dim=-1)
        chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
        top_values, top_ids = logprobs.topk(max(num_top, 1), dim=-1)
        out: list[SampledLogprob | None] = []
        for i, request in enumerate(requests):
            n = request.params.logprobs
            if n is None:
                out.append(None)
                continue
            top = tuple(zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist()))
            out.append(SampledLogprob(chosen[i], top))
        return out


ARGMAX_BLOCK = 256


def argmax_rows(x: Tensor) -> Tensor:
    """x [B, V] -> [B] long: each row's first index of its largest value, as x.argmax(-1).

    torch's CPU argmax walks a long row in one scalar loop (1.1 ms for 32 x 49152 here,
    where amax takes 0.05): so take the block of ARGMAX_BLOCK values that holds the row's
    maximum first (the first such block: argmax of the blocks' maxima), then the argmax
    within it. A row with NaNs may get any NaN's index (torch: the first). One row keeps the
    single call: in a decode step, after the weights have streamed through the caches, each
    extra op costs more than the scan saves (89 vs 163 us a step at batch 1)."""
    b, v = x.shape
    n = v - v % ARGMAX_BLOCK
    if n < 8 * ARGMAX_BLOCK or b == 1:   # short rows, or one: one call is quicker
        return x.argmax(dim=-1)
    blocks = x[:, :n].reshape(b, n // ARGMAX_BLOCK, ARGMAX_BLOCK)   # a view where x allows
    best = blocks.amax(dim=-1).argmax(dim=-1)
    index = best * ARGMAX_BLOCK + blocks[torch.arange(b, device=x.device), best].argmax(dim=-1)
    if n == v:
        return index
    tail = x[:, n:].argmax(dim=-1) + n   # wins only when larger: the blocks come first
    larger = x.gather(1, tail[:, None])[:, 0] > x.gather(1, index[:, None])[:, 0]
    return torch.where(larger, tail, index)


def _let_finished_grammars_stop(logits: Tensor, requests: list[Request],
                                matchers: list) -> None:
    """A grammar that is complete allows only EOS; if min_tokens banned that too, the row has
    no token left. End the request instead (in place)."""
    for i, matcher in enumerate(matchers):
        if matcher is not None and torch.isinf(logits[i]).all():
            logits[i, sorted(requests[i].eos_token_ids)] = 0.0


def _rows(batch: SamplingBatch, rows: list[int]) -> SamplingBatch:
    """The same settings for a subset of rows."""
    def pick(t: Tensor | None) -> Tensor | None:
        return None if t is None else t[rows]
    return SamplingBatch(temperature=pick(batch.temperature), top_k=pick(batch.top_k),
                         top_p=pick(batch.top_p), min_p=pick(batch.min_p))
