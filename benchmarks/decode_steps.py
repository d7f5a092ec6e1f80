"""Decode steps at several batch sizes, through the decode stack and layer by layer.

    .venv/bin/python benchmarks/decode_steps.py [--out FILE]

For each batch size B: B requests with 300-token prompts are prefilled, then `--steps` steps
that only decode are timed twice: with the compiled decode stack (every layer in one call, on
the int4 weights) and with it switched off (layer by layer: up to 8 rows the same int4
kernels, beyond that the dense bfloat16 weights on oneDNN). Reports ms per step for the
whole step and for the model's forward alone. Needs the compiled kernels with AVX-512 BF16
and the default (int4) weights.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ember import LLM
from ember.request import SamplingParams


def time_steps(core, model, stack, steps: int) -> dict[str, float]:
    """ms per step and per model forward over `steps` decode steps, with `stack` in use."""
    model.decode_stack = stack
    forward, spent = model.forward, [0.0]

    def timed(*args):
        start = time.perf_counter()
        out = forward(*args)
        spent[0] += time.perf_counter() - start
        return out

    model.forward = timed
    try:
        start = time.perf_counter()
        for _ in range(steps):
            core.step()
        total = time.perf_counter() - start
    finally:
        del model.forward   # back to the class's method
    return {"step_ms": 1e3 * total / steps, "model_ms": 1e3 * spent[0] / steps}


def measure(llm: LLM, batch: int, steps: int, prompt_len: int = 300) -> dict[str, object]:
    core = llm.engine
    model = core.runner.model
    stack = model.decode_stack
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"b{batch}-{i}", [100 + (i * 31 + j) % 20000 for j in range(prompt_len)],
                         params)
    while core.scheduler.num_waiting or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in core.scheduler.running):
        core.step()
    time_steps(core, model, stack, 2)   # warm both paths
    time_steps(core, model, None, 2)
    result = {"batch": batch, "stack": time_steps(core, model, stack, steps),
              "layers": time_steps(core, model, None, steps)}
    model.decode_stack = stack
    while core.has_unfinished():
        for request in list(core.scheduler.running):
            core.finish(request.request_id)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,8,12,16,26,32,48")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llm = LLM()
    if llm.engine.runner.model.decode_stack is None:
        raise SystemExit("no decode stack here: it needs the compiled kernels with AVX-512 "
                         "BF16 and int4 weights")
    rows = [measure(llm, int(b), args.steps) for b in args.batches.split(",")]
    print(f"{'batch':>6}{'stack step':>12}{'model':>8}{'layers step':>13}{'model':>8}"
          f"{'speed-up':>10}")
    for r in rows:
        s, l = r["stack"], r["layers"]
        print(f"{r['batch']:>6}{s['step_ms']:>12.2f}{s['model_ms']:>8.2f}{l['step_ms']:>13.2f}"
              f"{l['model_ms']:>8.2f}{l['step_ms'] / s['step_ms']:>9.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": "benchmarks/decode_steps.py", "rows": rows},
                                       indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
