"""xgrammar vs llguidance on this CPU, with SmolLM2's vocabulary (49,152 tokens).

    .venv/bin/python benchmarks/grammar_engines.py [--out FILE]

For each schema of tests/data/schemas.json: first compile (cold, p50 over schemas), a repeated
compile (cached), and the per-token cost of a constrained step (fill the next-token bitmask,
then accept the token) walked along a valid instance's tokens. Median of 3 runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from ember.bench.cli import results_dir
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf_metadata import read_gguf_metadata
from ember.weights.loader import default_model_path

SCHEMAS = json.loads((Path(__file__).parents[1] / "tests/data/schemas.json").read_text())


def bench_xgrammar(tok: Tokenizer) -> dict:
    import xgrammar as xgr
    start = time.perf_counter()
    vocab = [tok.backend.id_to_token(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size,
                             stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    init = time.perf_counter() - start
    cold, warm, per_token = [], [], []
    bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)
    for case in SCHEMAS:
        schema = json.dumps(case["schema"])
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False,
                                                separators=(",", ":"))
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
        warm.append(time.perf_counter() - t)
        matcher = xgr.GrammarMatcher(compiled)
        ids = tok.encode(json.dumps(case["example"], separators=(",", ":")),
                         add_special_tokens=False)
        t = time.perf_counter()
        for token in ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert matcher.accept_token(token), case["name"]
        per_token.append((time.perf_counter() - t) / len(ids))
    return {"init_s": init, "compile_p50_s": statistics.median(cold),
            "compile_max_s": max(cold), "cached_compile_p50_s": statistics.median(warm),
            "step_us_p50": statistics.median(per_token) * 1e6}


def bench_llguidance(tok: Tokenizer) -> dict:
    import llguidance
    import llguidance.torch as lltorch
    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), eos_token=sorted(tok.eos_token_ids))
    init = time.perf_counter() - start
    cold, warm, per_token = [], [], []
    bitmask = lltorch.allocate_token_bitmask(1, lltok.vocab_size)
    cache = {}
    for case in SCHEMAS:
        schema = json.dumps(case["schema"])
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        cold.append(time.perf_counter() - t)
        cache[schema] = grammar
        t = time.perf_counter()
        llguidance.LLMatcher(lltok, cache[schema])
        warm.append(time.perf_counter() - t)
        ids = tok.encode(json.dumps(case["example"], separators=(",", ":")),
                         add_special_tokens=False)
        t = time.perf_counter()
        for token in ids:
            lltorch.fill_next_token_bitmask(matcher, bitmask, 0)
            assert matcher.consume_token(token), (case["name"], matcher.get_error())
        per_token.append((time.perf_counter() - t) / len(ids))
    return {"init_s": init, "compile_p50_s": statistics.median(cold),
            "compile_max_s": max(cold), "cached_compile_p50_s": statistics.median(warm),
            "step_us_p50": statistics.median(per_token) * 1e6}


def bench_ember(tok: Tokenizer) -> dict:
    """What ember itself does: Grammars (xgrammar) compiling through ember's Constraint."""
    from ember.constraint import Constraint
    from ember.sampling.grammar import Grammars
    start = time.perf_counter()
    grammars = Grammars(tok, tok.vocab_size)
    init = time.perf_counter() - start
    cold, warm = [], []
    for case in SCHEMAS:
        constraint = Constraint.json_schema(case["schema"])
        t = time.perf_counter()
        grammars.compile(constraint)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammars.compile(constraint)
        warm.append(time.perf_counter() - t)
    return {"init_s": init, "compile_p50_s": statistics.median(cold),
            "compile_max_s": max(cold), "cached_compile_p50_s": statistics.median(warm)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    out_dir = results_dir(os.environ, Path.home())  # never the tree
    parser.add_argument("--out", default=str(out_dir / "grammar_engines.json"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    tok = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    results = {}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance),
                     ("ember (xgrammar via Grammars)", bench_ember)):
        runs = [fn(tok) for _ in range(3)]
        results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(name, {k: round(v * 1000, 2) if k.endswith("_s") else round(v, 1)
                     for k, v in results[name].items()}, "(ms, or us per step)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
