"""A replica's knee: the concurrency past which more requests at once stop paying.

From the profile's fitted step model: with B requests decoding at a context of L tokens, a
served step lasts s(B) = predict(B decode rows reading B * L keys) plus the profile's serving
overhead for a step streaming B tokens, each request gets a token per
step (latency s(B) per token) and the replica makes B / s(B) tokens a second. The knee is
the B that maximises throughput over latency, B / s(B)^2 (Kleinrock's power): below it, one
more request adds more throughput than latency; past it, less (doubling B there raises each
token's latency by more than it raises the replica's tokens a second by the square root of
two). For a step time d0 + d1 * B it is d0 / d1: the batch whose rows cost what the step's
fixed part does.

`ember route --plan profile.json` aims the autoscaler at it: --target-ongoing (in-flight +
queued requests per replica) defaults to the knee.
"""
from __future__ import annotations

from ember.plan.profile import Profile
from ember.plan.stepmodel import ServingOverhead, StepModel, StepShape

KNEE_CONTEXT_TOKENS = 512   # a decoding request's context: a mid-sized prompt and answer


def power(model: StepModel, batch: int, context_tokens: int,
          serving: ServingOverhead = ServingOverhead()) -> float:
    """Tokens a second over seconds a token, with `batch` requests decoding."""
    seconds = model.predict(StepShape(decode_rows=batch, decode_keys=batch * context_tokens)) \
        + serving.seconds(batch)
    return batch / seconds ** 2


def knee(model: StepModel, max_batch: int, context_tokens: int = KNEE_CONTEXT_TOKENS,
         serving: ServingOverhead = ServingOverhead()) -> int:
    """The batch in [1, max_batch] of the most power (the smallest, on a tie)."""
    if max_batch < 1:
        raise ValueError(f"max_batch={max_batch} must be at least 1")
    return max(range(1, max_batch + 1),
               key=lambda b: (power(model, b, context_tokens, serving), -b))


def profile_knee(profile: Profile, context_tokens: int = KNEE_CONTEXT_TOKENS) -> int:
    """The profiled replica's knee, no larger than its --max-num-seqs or than the number of
    such requests its KV cache holds."""
    fits = profile.num_blocks() * profile.block_size // context_tokens
    return knee(profile.step_model, max(1, min(profile.scheduler.max_num_seqs, fits)),
                context_tokens, profile.serving)
