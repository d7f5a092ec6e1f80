"""ember's perplexity beside llama.cpp's llama-perplexity, per GGUF format, on the same files.

    PYTHONPATH=. .venv/bin/python benchmarks/perplexity_vs_llamacpp.py \\
        --llama-bin-dir LLAMA_CPP_BUILD/bin [--quant-dir ~/.cache/ember-quants] \\
        [--types Q4_K_M,Q8_0,...] [--ctx 512] [--chunks 8] [--threads 2] \\
        [--quantization none] [--dtype auto] [--out results.json]

The default model (SmolLM2-135M-Instruct, Q4_1) is requantized into each type with
`llama-quantize --allow-requantize SRC DST TYPE` (only the files missing from --quant-dir).
Each file's perplexity on the Shakespeare excerpt shipped with ember
(ember/bench/data/corpus.txt) then comes from

    llama-perplexity -m FILE -f corpus.txt -c CTX --chunks N -t THREADS
    ember perplexity --model FILE --text corpus.txt --like-llama-cpp --window CTX \\
        --num-tokens CTX*N --quantization Q --dtype D

which score the same tokens: the second half of each of the first N windows of CTX tokens
(positions CTX/2 + 1 .. CTX - 1 of each window, given the tokens before them in the window).
Prints a markdown table: type, file MB, ember's perplexity, llama.cpp's, and the difference.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

from gguf import GGUFReader

from ember.bench.cli import results_dir
from ember.weights.paths import default_model_path

TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "IQ4_NL", "IQ4_XS", "Q2_K",
         "Q3_K_M")
FINAL_PPL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def corpus_path() -> Path:
    return Path(str(resources.files("ember.bench").joinpath("data/corpus.txt")))


def requantize(bin_dir: Path, source: Path, dest: Path, qtype: str, threads: int) -> str | None:
    """Writes dest unless it exists; None when it is there, else llama-quantize's last words."""
    if dest.exists():
        return None
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    run = subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(source),
                          str(partial), qtype, str(threads)], capture_output=True, text=True)
    if run.returncode != 0 or not partial.exists():
        partial.unlink(missing_ok=True)
        return (run.stderr or run.stdout).strip().splitlines()[-1]
    partial.rename(dest)
    return None


def llama_ppl(bin_dir: Path, model: Path, args: argparse.Namespace) -> tuple[float, float]:
    """(llama-perplexity's final estimate, seconds)."""
    start = time.perf_counter()
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model),
                          "-f", str(args.text), "-c", str(args.ctx), "--chunks", str(args.chunks),
                          "-t", str(args.threads)], capture_output=True, text=True)
    found = FINAL_PPL.search(run.stdout + run.stderr)
    if run.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed on {model}: {run.stderr[-2000:]}")
    return float(found.group(1)), time.perf_counter() - start


def ember_ppl(model: Path, args: argparse.Namespace) -> tuple[dict, float]:
    """(`ember perplexity --like-llama-cpp`'s JSON, seconds)."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ppl.json"
        run = subprocess.run(
            [sys.executable, "-m", "ember.cli", "perplexity", "--model", str(model),
             "--text", str(args.text), "--like-llama-cpp", "--window", str(args.ctx),
             "--num-tokens", str(args.ctx * args.chunks), "--quantization", args.quantization,
             "--dtype", args.dtype, "--path", args.path, "--out", str(out), "-q"],
            capture_output=True, text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if run.returncode != 0:
            raise RuntimeError(f"ember perplexity failed on {model}: {run.stderr[-2000:]}")
        return json.loads(out.read_text()), time.perf_counter() - start


def composition(path: Path) -> str:
    """The file's tensor types by share of bytes, largest first: llama-quantize falls back to
    another type for a tensor whose rows are not a multiple of the type's block (256 values
    for the K-quants and IQ4_XS)."""
    sizes: dict[str, int] = {}
    for t in GGUFReader(path).tensors:
        sizes[t.tensor_type.name] = sizes.get(t.tensor_type.name, 0) + int(t.n_bytes)
    total = sum(sizes.values())
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in ranked if n >= total / 200)


def measure(qtype: str, args: argparse.Namespace) -> dict:
    dest = args.quant_dir / f"{args.source.stem.split('.')[0]}.{qtype}.gguf"
    refused = requantize(args.llama_bin_dir, args.source, dest, qtype, args.threads)
    if refused:
        return {"type": qtype, "refused": refused}
    llama, llama_s = llama_ppl(args.llama_bin_dir, dest, args)
    ours, ember_s = ember_ppl(dest, args)
    return {"type": qtype, "file": str(dest), "mb": dest.stat().st_size / 1e6,
            "tensor_types": composition(dest),
            "ember_ppl": ours["perplexity"], "llama_cpp_ppl": llama,
            "difference_percent": 100 * (ours["perplexity"] / llama - 1),
            "tokens_scored": ours["tokens_scored"], "ember_weights": ours["weights"],
            "ember_dtype": ours["dtype"], "ember_seconds": ember_s, "llama_cpp_seconds": llama_s}


def table(rows: list[dict]) -> str:
    lines = ["| type | file MB | tensors (share of bytes) | ember ppl | llama.cpp ppl | "
             "difference |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['type']} | | | | | llama-quantize refused: {r['refused']} |")
        else:
            lines.append(f"| {r['type']} | {r['mb']:.1f} | {r['tensor_types']} | "
                         f"{r['ember_ppl']:.4f} | {r['llama_cpp_ppl']:.4f} | "
                         f"{r['difference_percent']:+.2f}% |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin-dir", type=Path, required=True,
                        help="the folder holding llama-quantize and llama-perplexity")
    parser.add_argument("--quant-dir", type=Path, default=Path.home() / ".cache/ember-quants")
    parser.add_argument("--source", type=Path, default=None,
                        help="the GGUF to requantize (default: the default model)")
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--text", type=Path, default=corpus_path())
    parser.add_argument("--ctx", type=int, default=512, help="window (llama-perplexity's -c)")
    parser.add_argument("--chunks", type=int, default=8, help="windows scored")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="none",
                        help="ember's packing of the weights (none: the GGUF's values)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--path", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.source = (args.source or default_model_path()).expanduser()
    args.quant_dir = args.quant_dir.expanduser()
    return args


def main() -> None:
    args = parse_args()
    rows = []
    for qtype in args.types.split(","):
        rows.append(measure(qtype, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    out = args.out or results_dir(os.environ, Path.home()) / "perplexity_vs_llamacpp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "load_average": os.getloadavg(), "rows": rows}, indent=2))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
