"""Imports point one way (docs/architecture.md), checked by walking every module's AST."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ember

PACKAGE = Path(ember.__file__).parent

# module prefix -> imports it must never make
FORBIDDEN = {
    "ember.errors": {"torch", "ember."},
    "ember.config": {"torch", "ember.request", "ember.kv", "ember.scheduler", "ember.runner",
                     "ember.engine", "ember.models"},
    "ember.request": {"torch", "ember.kv", "ember.scheduler", "ember.runner", "ember.engine"},
    "ember.kv": {"torch", "ember.scheduler", "ember.runner", "ember.engine", "ember.models"},
    "ember.scheduler": {"torch", "ember.runner", "ember.engine", "ember.models"},
    "ember.tokenizer": {"torch", "ember.weights", "ember.models", "ember.runner", "ember.engine"},
    "ember.quant": {"ember.models", "ember.weights", "ember.runner", "ember.engine"},
    "ember.kernels": {"ember.models", "ember.weights", "ember.runner", "ember.engine",
                      "ember.scheduler", "ember.kv", "ember.server"},
    "ember.models": {"ember.weights", "ember.runner", "ember.engine", "ember.scheduler",
                     "ember.distributed"},
    "ember.weights": {"ember.runner", "ember.engine", "ember.scheduler", "ember.tokenizer",
                      "ember.distributed"},
    "ember.sampling": {"ember.runner", "ember.engine", "ember.models", "ember.scheduler"},
    "ember.runner": {"ember.engine", "ember.distributed"},
    # ranks run below the engine: the engine starts them, they never reach up to it
    "ember.distributed": {"ember.engine", "ember.server", "ember.cli"},
    "ember.lora": {"ember.runner", "ember.engine", "ember.scheduler", "ember.server"},
    "ember.engine": {"ember.server", "ember.cli"},
    # the engine's KV hand-off: below the server; its parameters are plain data the server
    # reads, so they stay free of torch
    "ember.kv_transfer": {"ember.engine", "ember.server", "ember.router", "ember.cli"},
    "ember.kv_transfer.params": {"torch", "ember.kv_transfer.connector", "ember.runner"},
    # the server speaks HTTP and the AsyncEngine API; it never touches tensors
    "ember.server": {"torch", "ember.runner", "ember.models", "ember.sampling", "ember.kv",
                     "ember.scheduler", "ember.quant", "ember.weights"},
    # the fleet talks HTTP to replicas: no tensors, no engine (ray only as a launcher)
    "ember.router": {"torch", "ember.engine", "ember.runner", "ember.models", "ember.sampling",
                     "ember.scheduler", "ember.quant", "ember.weights.loader",
                     "ember.weights.gguf", "ember.server.state", "ember.server.app"},
    "ember": {"transformers", "accelerate"},  # the runtime never needs the test oracle
    # the benchmark speaks HTTP to any server; only bench/offline.py runs the engine itself
    "ember.bench": {"torch", "ember.runner", "ember.models", "ember.server", "ember.scheduler",
                    "ember.kv", "ember.sampling", "ember.quant"},
    # capacity planning drives the scheduler, the KV pool and the router's policies itself;
    # only the profiler and the simulated replica touch the engine (test below)
    "ember.plan": {"torch", "ember.runner", "ember.models", "ember.sampling", "ember.quant",
                   "ember.server"},
}
ENGINE_ALLOWED_IN_BENCH = {"ember.bench.offline"}
ENGINE_ALLOWED_IN_PLAN = {"ember.plan.measure", "ember.plan.served", "ember.plan.replica"}


def module_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_imports_point_down():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        module = "ember." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        for prefix, banned in FORBIDDEN.items():
            if module != prefix and not module.startswith(prefix + "."):
                continue
            for name in module_imports(path):
                for ban in banned:
                    if name == ban.rstrip(".") or name.startswith(ban if ban.endswith(".")
                                                                 else ban + "."):
                        violations.append(f"{module} imports {name}")
    assert not violations, "\n".join(violations)


def test_bench_runs_the_engine_only_offline():
    for path in (PACKAGE / "bench").rglob("*.py"):
        module = "ember.bench." + path.stem
        if module in ENGINE_ALLOWED_IN_BENCH:
            continue
        assert not any(n.startswith("ember.engine") for n in module_imports(path)), module


def test_plan_runs_the_engine_only_to_profile_and_to_serve():
    for path in (PACKAGE / "plan").rglob("*.py"):
        module = "ember.plan." + path.stem
        if module in ENGINE_ALLOWED_IN_PLAN:
            continue
        assert not any(n.startswith("ember.engine") for n in module_imports(path)), module


def test_planning_runs_without_torch():
    """`ember plan` simulates fleets without loading torch or the engine."""
    code = ("import sys, ember.cli, ember.plan.commands; "
            "print(sorted(m for m in ('torch', 'ember.engine') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_router_runs_without_torch():
    """`ember route` imports neither torch nor the engine, through any import chain."""
    code = ("import sys, ember.cli, ember.router.main, ember.router.ray_replicas; "
            "print(sorted(m for m in ('torch', 'ember.engine', 'ember.server.state') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"


def test_walk_sees_real_imports():
    """Guard against a vacuous pass: the walker does find known imports."""
    assert "torch" in module_imports(PACKAGE / "models" / "llama.py")
    assert "ember.kv.kv_manager" in module_imports(PACKAGE / "scheduler" / "scheduler.py")


def test_serving_imports_no_compiler_stack_grammar_engine_or_oracle(smollm_path):
    """Loading the model and generating imports neither transformers nor torch._dynamo and
    triton (~140 MB resident for their import alone, pulled in by meta-device ops), nor
    xgrammar (imported on the first constrained request)."""
    code = (f"import sys; from ember import LLM, SamplingParams; "
            f"LLM({str(smollm_path)!r}).generate('Hi', SamplingParams(max_tokens=2)); "
            "print(sorted(m for m in ('transformers', 'torch._dynamo', 'triton', 'xgrammar') "
            "if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
