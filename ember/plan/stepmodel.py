"""How long one engine step takes, as a linear function of what the step computes.

The runner computes a step's prompt rows and its decode rows in two forwards (docs/
architecture.md, "Same request, same answer"), so a step costs the sum of

    prompt forward   p0 + p1 * prompt rows + p2 * keys the prompt rows attend to
    decode forward   d0 + d1 * decode rows up to 8 + d2 * decode rows past 8
                     + d3 * keys they read

(each forward's constant only when it runs). Past 8 decode rows a decode step moves from the
int4 weights to the int8 prompt weights, and a row costs less there (a matrix product reads
the weights once for all rows): the two slopes are fitted apart. A row at
position p attends to p + 1 keys. The coefficients are fitted by least squares on relative
error (a 5 ms decode step matters as much as a 500 ms prompt step), from measured steps
(measure.py); a coefficient that comes out negative is dropped and the rest refitted, so
the model never predicts less for more work.

A served step takes longer than the engine's in-process one by the server's own work, fitted
the same way from served step intervals (served.py) as a ServingOverhead:

    served step = predicted step + per_step_s + per_token_s * tokens the step streams
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from ember.scheduler.output import SchedulerOutput

FEATURES = ("prompt_forward", "prompt_rows", "prompt_keys", "decode_forward",
            "decode_rows_to_8", "decode_rows_past_8", "decode_keys")
# an earlier profile format: one slope for every decode row, plus an extra slope past 8
OLD_FEATURES = ("prompt_forward", "prompt_rows", "prompt_keys", "decode_forward",
                "decode_rows", "decode_rows_past_8", "decode_keys")
INT8_DECODE_ROWS = 8  # decode steps of more rows run on the int8 prompt weights
SPREAD_QUANTILES = 101   # a served interval's ratio to its prediction: percentiles 0..100


@dataclass(frozen=True)
class StepShape:
    """What one step computes: its prompt rows and decode rows, and the keys each kind
    attends to in all (the attention's work)."""

    prompt_rows: int = 0
    prompt_keys: int = 0
    decode_rows: int = 0
    decode_keys: int = 0

    def features(self) -> tuple[float, ...]:
        """The step's values of FEATURES, in order."""
        return (float(self.prompt_rows > 0), float(self.prompt_rows), float(self.prompt_keys),
                float(self.decode_rows > 0), float(min(self.decode_rows, INT8_DECODE_ROWS)),
                float(max(0, self.decode_rows - INT8_DECODE_ROWS)), float(self.decode_keys))

    @property
    def kind(self) -> str:
        if self.prompt_rows and self.decode_rows:
            return "mixed"
        return "prompt" if self.prompt_rows else "decode"


def _keys(start: int, end: int) -> int:
    """Keys attended to by rows at positions [start, end): sum of (p + 1)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def step_shape(plan: SchedulerOutput) -> StepShape:
    """The shape of a planned step. A request's positions before its prompt's end are prompt
    rows; the rest are decode rows (a preempted request recomputes its generated tokens as
    decode rows, as the runner does)."""
    prompt_rows = prompt_keys = decode_rows = decode_keys = 0
    for item in plan.scheduled:
        start, end = item.start, item.start + item.num_new_tokens
        split = min(max(len(item.request.prompt_token_ids), start), end)
        if split > start:
            prompt_rows += split - start
            prompt_keys += _keys(start, split)
        if end > split:   # (a decode: one row reading end keys)
            decode_rows += end - split
            decode_keys += end if end - split == 1 else _keys(split, end)
    return StepShape(prompt_rows, prompt_keys, decode_rows, decode_keys)


@dataclass(frozen=True)
class StepModel:
    """Fitted seconds per unit of each feature, and the shortest step measured (a floor)."""

    coefficients: tuple[float, ...]
    min_step_s: float = 0.0

    def predict(self, shape: StepShape) -> float:
        p0, p1, p2, d0, d1, d2, d3 = self.coefficients   # (written out: a simulation calls
        seconds = 0.0                                    # this once per step)
        if shape.prompt_rows:
            seconds += p0 + p1 * shape.prompt_rows + p2 * shape.prompt_keys
        rows = shape.decode_rows
        if rows:
            seconds += d0 + d3 * shape.decode_keys + (
                d1 * rows if rows <= INT8_DECODE_ROWS else
                d1 * INT8_DECODE_ROWS + d2 * (rows - INT8_DECODE_ROWS))
        return max(seconds, self.min_step_s)

    def to_json(self) -> dict[str, object]:
        return {"features": list(FEATURES), "coefficients": list(self.coefficients),
                "min_step_s": self.min_step_s}

    @classmethod
    def from_json(cls, data: dict) -> "StepModel":
        coefficients = [float(c) for c in data["coefficients"]]
        if list(data["features"]) == list(OLD_FEATURES):   # the same model, other slopes
            coefficients[5] += coefficients[4]
        elif list(data["features"]) != list(FEATURES):
            raise ValueError(f"the profile's step model has features {data['features']}, this "
                             f"ember fits {list(FEATURES)}; measure again with "
                             "`ember plan profile`")
        return cls(tuple(coefficients), float(data["min_step_s"]))


def fit(shapes: Sequence[StepShape], seconds: Sequence[float],
        interference: float | None = None) -> StepModel:
    """Least squares on relative error, non-negative by dropping negative coefficients.
    With `interference` (e.g. 1.5), steps measured over that many times the first fit's
    prediction are taken as disturbed (another process had the cores) and left out of a
    second fit; interfered() says which."""
    model = _fit(shapes, seconds)
    if interference is None:
        return model
    kept = [i for i in range(len(shapes)) if not interfered(model, shapes[i], seconds[i],
                                                            interference)]
    if len(kept) == len(shapes) or len(kept) < len(FEATURES):
        return model
    return _fit([shapes[i] for i in kept], [seconds[i] for i in kept])


def interfered(model: StepModel, shape: StepShape, seconds: float, factor: float) -> bool:
    return seconds > factor * model.predict(shape)


def _fit(shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepModel:
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("fit needs one duration per step shape, and at least one step")
    y = np.asarray(seconds, dtype=np.float64)
    x = np.asarray([s.features() for s in shapes], dtype=np.float64) / y[:, None]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)   # columns of similar size for lstsq
    active = [j for j in range(len(FEATURES)) if x[:, j].any()]
    coef = np.zeros(len(FEATURES))
    while active:
        solution = np.linalg.lstsq(x[:, active] / scale[active], np.ones(len(y)), rcond=None)[0]
        coef[:] = 0.0
        coef[active] = solution / scale[active]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            break
        active = [j for j in active if j not in negative]
    return StepModel(tuple(float(c) for c in coef), float(y.min()) * 0.5)


def residuals(model: StepModel, shapes: Sequence[StepShape], seconds: Sequence[float]
              ) -> dict[str, dict[str, float]]:
    """Relative errors (predicted / measured - 1) by step kind and over all steps: their
    count, median and 90th percentile of the absolute value, and the mean (the bias)."""
    rel: dict[str, list[float]] = {"all": []}
    for shape, measured in zip(shapes, seconds):
        error = model.predict(shape) / measured - 1.0
        rel["all"].append(error)
        rel.setdefault(shape.kind, []).append(error)
    return {kind: {"steps": len(v), "median_abs": float(np.median(np.abs(v))),
                   "p90_abs": float(np.percentile(np.abs(v), 90)),
                   "mean": float(np.mean(v))} for kind, v in rel.items()}


@dataclass(frozen=True)
class ServingOverhead:
    """What a served step costs beyond the engine's in-process one (the step model's): the
    server's work per step (the event loop's wake-up, the engine thread's inbox) and per
    streamed token (the SSE chunk, its JSON, the socket write, the GIL they take from the
    engine thread), in seconds. Measured by serving the model briefly (served.py); zero in
    a profile made without it (`measured` False). `spread`: how served intervals scatter
    around the prediction, as SPREAD_QUANTILES quantiles of measured / predicted over every
    interval (those disturbed too: on shared cores the server's, the client's and the
    gateway's work lands on some step, which is the tail a client sees); empty where not
    measured."""

    per_step_s: float = 0.0
    per_token_s: float = 0.0
    measured: bool = False
    residuals: dict[str, dict[str, float]] = field(default_factory=dict)
    runs: list[dict[str, float]] = field(default_factory=list)   # each served run
    spread: tuple[float, ...] = ()

    def seconds(self, num_tokens: int) -> float:
        """The overhead of a step that streams `num_tokens` tokens."""
        return self.per_step_s + self.per_token_s * num_tokens

    def plus(self, other: "ServingOverhead") -> "ServingOverhead":
        """Both overheads in one (their fits' details left out). The spread is `other`'s
        where it has one: it was measured with both at work (the gateway's on top of the
        replica's)."""
        return ServingOverhead(self.per_step_s + other.per_step_s,
                               self.per_token_s + other.per_token_s,
                               self.measured or other.measured,
                               spread=other.spread or self.spread)

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "ServingOverhead":
        return cls(float(data["per_step_s"]), float(data["per_token_s"]),
                   bool(data["measured"]), dict(data.get("residuals", {})),
                   list(data.get("runs", [])),
                   tuple(float(q) for q in data.get("spread", ())))


def fit_overhead(model: StepModel, shapes: Sequence[StepShape], num_tokens: Sequence[int],
                 seconds: Sequence[float], interference: float | None = None,
                 base: ServingOverhead | None = None) -> ServingOverhead:
    """The per-step and per-token overhead that, added to `model`'s prediction (and `base`'s
    overhead, if given), best fits served step intervals `seconds` (least squares on
    relative error, as fit(); a negative term is dropped and the other refitted). With
    `interference`, intervals over that many times the first fit's prediction are left out
    of a second fit, as fit() does. Its residuals: the prediction without the overhead and
    with it, against the intervals kept."""
    if not (len(shapes) == len(num_tokens) == len(seconds)) or not shapes:
        raise ValueError("fit_overhead needs one token count and interval per step shape, "
                         "and at least one step")
    base = base or ServingOverhead()
    predicted = np.asarray([model.predict(s) + base.seconds(n)
                            for s, n in zip(shapes, num_tokens)])
    tokens = np.asarray(num_tokens, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    kept = np.ones(len(y), dtype=bool)
    per_step, per_token = _fit_overhead(predicted, tokens, y)
    if interference is not None:
        below = y <= interference * (predicted + per_step + per_token * tokens)
        if 2 <= below.sum() < len(y):
            kept = below
            per_step, per_token = _fit_overhead(predicted[kept], tokens[kept], y[kept])
    served = predicted + per_step + per_token * tokens
    spread = np.quantile(y / served, np.linspace(0.0, 1.0, SPREAD_QUANTILES))
    return ServingOverhead(per_step, per_token, True, {
        "without": _relative_errors(predicted[kept], y[kept]),
        "with": _relative_errors(served[kept], y[kept]) | {"left_out": int((~kept).sum())}},
        spread=tuple(round(float(q), 4) for q in spread))


def _fit_overhead(predicted: np.ndarray, tokens: np.ndarray, y: np.ndarray
                  ) -> tuple[float, float]:
    # (predicted + a + b * n) / y = 1  ->  a / y + b * n / y = 1 - predicted / y
    x = np.stack([1.0 / y, tokens / y], axis=1)
    target = 1.0 - predicted / y
    active = [j for j in (0, 1) if x[:, j].any()]
    while active:
        coef = np.zeros(2)
        coef[active] = np.linalg.lstsq(x[:, active], target, rcond=None)[0]
        negative = [j for j in active if coef[j] < 0]
        if not negative:
            return float(coef[0]), float(coef[1])
        active = [j for j in active if j not in negative]
    return 0.0, 0.0


def _relative_errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    error = predicted / measured - 1.0
    return {"steps": int(len(error)), "median_abs": float(np.median(np.abs(error))),
            "p90_abs": float(np.percentile(np.abs(error), 90)), "mean": float(np.mean(error))}


class StepSpread:
    """Factors that scatter simulated steps as served ones scatter around the prediction:
    POOL draws from a ServingOverhead's spread (a uniform quantile, interpolated), divided by
    the spread's median so that a typical step stays as predicted; step k of a replica gets
    draw k (modulo POOL), so a step's factor depends on its index alone (a run of steps
    priced at once gets what they would get one by one)."""

    POOL = 4096

    def __init__(self, spread: Sequence[float], seed: int) -> None:
        if len(spread) < 2:
            raise ValueError("a step spread needs at least two quantiles")
        quantiles = np.asarray(spread, dtype=np.float64)
        grid = np.linspace(0.0, 1.0, len(quantiles))
        draws = np.interp(np.random.default_rng(seed).random(self.POOL), grid, quantiles)
        self.factors = [float(f) for f in draws / float(np.median(quantiles))]

    def factor(self, step: int) -> float:
        return self.factors[step % self.POOL]
