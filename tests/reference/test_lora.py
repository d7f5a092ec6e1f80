"""Multi-LoRA against transformers + peft, on a tiny random Llama and random adapters made here.

Reference: peft's LoraModel on transformers' Llama with the same weights, float32 on CPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember import SamplingParams
from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.errors import ConfigError, Overloaded
from ember.lora.adapter import write_random_adapter
from ember.request import RequestOptions
from ember.scheduler.output import RunnerOutput
from tests.conftest import hf_greedy, save_tiny_model, tiny_hf_model

peft = pytest.importorskip("peft")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, rsLoRA, targets): each adapter exercises a different scaling and module set
ADAPTERS = {
    "all-r8": (8, 16, False, ALL_TARGETS),
    "attn-r4-rslora": (4, 8, True, ["q_proj", "v_proj", "o_proj"]),
    "mlp-r16": (16, 4, False, ["gate_proj", "down_proj"]),
    "kv-r64": (64, 32, False, ["k_proj", "v_proj", "up_proj"]),
}
PROMPTS = [[1, 500, 77, 9000, 31, 2024, 17], list(range(1000, 1037)), [300, 301]]


def make_adapter(base, folder: Path, rank: int, alpha: int, rslora: bool,
                 targets: list[str], seed: int):
    """A peft LoRA on a copy of `base` with random A and B (peft's default B is zero)."""
    import copy
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora,
                             target_modules=targets, init_lora_weights=False)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # large enough to change the greedy tokens of a random model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path):
    base = tiny_hf_model("llama", tie_word_embeddings=False)
    folder = save_tiny_model(tmp_path_factory.mktemp("lora_base"), base, tokenizer_files)
    refs, paths = {}, {}
    for seed, (name, (rank, alpha, rslora, targets)) in enumerate(ADAPTERS.items()):
        paths[name] = tmp_path_factory.mktemp(f"lora_{name}")
        refs[name] = make_adapter(base, paths[name], rank, alpha, rslora, targets, seed)
    return folder, base, refs, paths


@pytest.fixture(scope="module")
def engine(lora_setup) -> EngineCore:
    folder, _, _, paths = lora_setup
    return EngineCore(EngineConfig(model=str(folder), dtype="float32",
                                   loras=tuple(paths.items())))


def run_greedy(engine: EngineCore, jobs: list[tuple[str | None, list[int]]], steps: int,
               prefix_cache: bool = True) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy-decode every (adapter, prompt) job in one batch, keeping each step's logits."""
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i, (lora, prompt) in enumerate(jobs):
        engine.add_request(str(i), prompt, params,
                           RequestOptions(lora=lora, prefix_cache=prefix_cache))
    out: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in jobs]
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        requests, logits = engine.runner.forward(plan)
        result = RunnerOutput()
        for request, row in zip(requests, logits):
            token = int(row.argmax())
            result.sampled_token_ids[request.request_id] = [token]
            out[int(request.request_id)][0].append(token)
            out[int(request.request_id)][1].append(row)
        engine.scheduler.update(plan, result)
    return out


def test_each_adapter_matches_peft(lora_setup, engine: EngineCore) -> None:
    _, _, refs, _ = lora_setup
    for name, ref in refs.items():
        for prompt in PROMPTS:
            [(tokens, logits)] = run_greedy(engine, [(name, prompt)], 6)
            assert tokens == hf_greedy(ref, prompt, 6), name
            with torch.no_grad():
                want = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            torch.testing.assert_close(torch.stack(logits), want.float(), atol=2e-4, rtol=1e-4)


def test_adapters_change_the_output(lora_setup, engine: EngineCore) -> None:
    """The fixture's adapters are not no-ops: each one's greedy tokens differ from the base."""
    _, base, _, _ = lora_setup
    base_tokens = hf_greedy(base, PROMPTS[1], 6)
    for name in ADAPTERS:
        [(tokens, _)] = run_greedy(engine, [(name, PROMPTS[1])], 6)
        assert tokens != base_tokens, name


def test_mixed_batch_equals_each_alone(engine: EngineCore) -> None:
    """Base and adapters interleaved in one batch (prefills and decodes in the same steps)
    give what each gives alone."""
    jobs = [(None, PROMPTS[0]), ("all-r8", PROMPTS[1]), ("attn-r4-rslora", PROMPTS[0]),
            (None, PROMPTS[2]), ("mlp-r16", PROMPTS[2]), ("all-r8", PROMPTS[0])]
    together = run_greedy(engine, jobs, 8)
    for job, (tokens, logits) in zip(jobs, together):
        [(alone_tokens, alone_logits)] = run_greedy(engine, [job], 8)
        assert tokens == alone_tokens, job
        torch.testing.assert_close(torch.stack(logits), torch.stack(alone_logits),
                                   atol=2e-4, rtol=1e-4)


def test_adapter_kv_is_never_shared(engine: EngineCore) -> None:
    """The prefix cache is salted per adapter: the same prompt under another adapter (or the
    base) reuses nothing, under the same adapter it does."""
    prompt = list(range(2000, 2040))
    params = SamplingParams(temperature=0, max_tokens=1)
    cached = {}
    for i, lora in enumerate(["all-r8", "mlp-r16", None, "all-r8"]):
        request = engine.add_request(f"salt{i}", prompt, params, RequestOptions(lora=lora))
        while engine.has_unfinished():
            engine.step()
        cached[i] = request.num_cached_tokens
    assert cached[0] == cached[1] == 0 and cached[2] == 0
    assert cached[3] > 0


def test_resident_adapters_are_bounded(lora_setup) -> None:
    folder, _, refs, paths = lora_setup
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32", max_loras=2,
                                     loras=tuple(paths.items())))
    assert engine.loras.names() == list(ADAPTERS)
    assert len(engine.loras.resident_names()) == 2
    # an evicted adapter is read again when named, and still computes the same thing
    name = next(n for n in ADAPTERS if n not in engine.loras.resident_names())
    [(tokens, _)] = run_greedy(engine, [(name, PROMPTS[0])], 5)
    assert tokens == hf_greedy(refs[name], PROMPTS[0], 5)
    assert name in engine.loras.resident_names() and len(engine.loras.resident_names()) == 2
    # with both slots held by queued requests, a third adapter is refused, not evicted under them
    held = [n for n in ADAPTERS if n != name][:2]
    for i, n in enumerate(held):
        engine.add_request(f"hold{i}", PROMPTS[0], SamplingParams(max_tokens=2),
                           RequestOptions(lora=n))
    third = next(n for n in ADAPTERS if n not in held)
    with pytest.raises(Overloaded, match="max-loras"):
        engine.add_request("third", PROMPTS[0], SamplingParams(), RequestOptions(lora=third))
    while engine.has_unfinished():
        engine.step()
    engine.add_request("third", PROMPTS[0], SamplingParams(max_tokens=1),
                       RequestOptions(lora=third))  # room again once they finished


def test_bad_adapters_are_refused(lora_setup, tmp_path: Path) -> None:
    folder, base, _, _ = lora_setup
    with pytest.raises(ConfigError, match="does not exist"):
        EngineCore(EngineConfig(model=str(folder), dtype="float32",
                                loras=(("x", str(tmp_path / "missing")),)))
    big = tmp_path / "big"
    make_adapter(base, big, 8, 8, False, ["q_proj"], 0)
    with pytest.raises(ConfigError, match="rank 8"):
        EngineCore(EngineConfig(model=str(folder), dtype="float32", max_lora_rank=4,
                                loras=(("big", str(big)),)))


def test_default_model_adapter_matches_peft(smollm_llm, hf_smollm, tmp_path: Path) -> None:
    """A rank-8 adapter on every projection of SmolLM2, beside the base in one batch."""
    from tests.reference.test_smollm_gguf import assert_greedy_match
    import copy
    torch.manual_seed(0)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS,
                             init_lora_weights=False)
    ref = peft.get_peft_model(copy.deepcopy(hf_smollm), config).eval()
    ref.save_pretrained(tmp_path)
    smollm_llm.engine.loras.add("smol-lora", tmp_path)
    prompts = [smollm_llm.chat_prompt([{"role": "user", "content": p}])
               for p in ("What is the capital of France?", "Write a haiku about the sea.")]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with_adapter = smollm_llm.generate(prompts, params, RequestOptions(lora="smol-lora"))
    base = smollm_llm.generate(prompts, params)
    for prompt, out, plain in zip(prompts, with_adapter, base):
        got = out.outputs[0].token_ids
        assert_greedy_match(ref, prompt, hf_greedy(ref, prompt, 16), got)
        assert got != plain.outputs[0].token_ids  # the adapter is not a no-op


def write_lora_gguf(path: Path, peft_folder: Path, alpha: float, cfg) -> None:
    """A PEFT adapter as llama.cpp's LoRA converter lays it out: general.type 'adapter',
    adapter.lora.alpha, tensors blk.N.<part>.weight.lora_a [r, in] / .lora_b [out, r], with
    lora_b's q/k rows permuted like the base model's (written from its description)."""
    import numpy as np
    from gguf import GGUFWriter
    from safetensors.torch import load_file

    from tests.reference.test_gguf import llama_cpp_permute
    parts = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    writer = GGUFWriter(path, "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for key, tensor in load_file(peft_folder / "adapter_model.safetensors").items():
        layer = key.split("layers.")[1].split(".")[0]
        module = key.split(".lora_")[0].rsplit(".", 1)[1]
        side = "a" if ".lora_A." in key else "b"
        w = tensor.float().numpy().astype(np.float32)
        if side == "b" and module in ("q_proj", "k_proj"):
            w = llama_cpp_permute(w, cfg.num_attention_heads if module == "q_proj"
                                  else cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{parts[module]}.weight.lora_{side}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_adapter_matches_peft(lora_setup, engine: EngineCore, tmp_path: Path) -> None:
    _, base, refs, paths = lora_setup
    rank, alpha, _, _ = ADAPTERS["all-r8"]
    write_lora_gguf(tmp_path / "all-r8.gguf", paths["all-r8"], alpha, base.config)
    engine.loras.add("all-r8-gguf", tmp_path / "all-r8.gguf")
    for prompt in PROMPTS[:2]:
        [(tokens, logits)] = run_greedy(engine, [("all-r8-gguf", prompt)], 6)
        assert tokens == hf_greedy(refs["all-r8"], prompt, 6)
        [(_, peft_logits)] = run_greedy(engine, [("all-r8", prompt)], 6)
        torch.testing.assert_close(torch.stack(logits), torch.stack(peft_logits),
                                   atol=1e-4, rtol=1e-4)


def random_fused_adapter(uid: int, ranks: dict[str, int], sizes: dict[str, tuple[int, ...]],
                         hidden: int, gen: torch.Generator):
    """A one-layer LoraAdapter with fused factors as adapter.py builds them: per projection,
    each module's A columns side by side and its B rows in its own columns only; values
    rounded to bfloat16 so that both forms of a step hold the same factors."""
    from ember.lora.adapter import LoraAdapter
    ins = {"qkv": hidden, "o": sizes["qkv"][0], "gate_up": hidden, "down": sizes["gate_up"][0]}
    layer = {}
    for projection, outs in sizes.items():
        r = ranks.get(projection, 0)
        if r == 0:
            continue
        a = torch.zeros(ins[projection], r * len(outs))
        b = torch.zeros(r * len(outs), sum(outs))
        for i, n in enumerate(outs):
            a[:, i * r:(i + 1) * r] = torch.randn(ins[projection], r, generator=gen)
            b[i * r:(i + 1) * r, sum(outs[:i]):sum(outs[:i + 1])] = \
                torch.randn(r, n, generator=gen) * 0.1
        layer[projection] = (a.bfloat16().float(), b.bfloat16().float())
    return LoraAdapter(f"r{uid}", Path("."), uid, f"test:{uid}", max(ranks.values()), [layer])


def test_lora_kernel_adds_each_rows_adapter() -> None:
    """The compiled lora_add (one call per projection, x A and t B on int8 dot products,
    zero blocks skipped) gives y + (x A) B, computed in float64, within one bfloat16 unit of
    the last place plus what rounding x and t per row, A per rank and B per column to int8
    can move it (half a step of each scale times the other operand's magnitudes), for uneven
    adapter groups at odd sizes (in not a multiple of 64, out not of 16, odd ranks); the
    torch form (float32) within the same; base rows stay untouched, bit for bit."""
    from ember.kernels import load_kernels
    from ember.lora.batch import LoraStepBuilder
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_int8_dot:
        pytest.skip("this CPU has no AVX-512 BF16 and VNNI kernels")
    gen = torch.Generator().manual_seed(0)
    hidden, sizes = 72, {"qkv": (40, 24, 24), "o": (72,), "gate_up": (50, 50), "down": (72,)}
    adapters = [random_fused_adapter(1, {"qkv": 3, "o": 5, "gate_up": 15, "down": 1},
                                     sizes, hidden, gen),
                random_fused_adapter(2, {"qkv": 5, "down": 7}, sizes, hidden, gen),
                random_fused_adapter(3, {"qkv": 3, "o": 2, "gate_up": 4, "down": 2},
                                     sizes, hidden, gen)]
    plan = [(adapters[1], 5), (None, 2), (adapters[0], 1), (adapters[2], 9), (None, 1),
            (adapters[1], 3), (adapters[0], 11)]
    owner = [a for a, n in plan for _ in range(n)]
    compiled = LoraStepBuilder(torch.bfloat16, torch.device("cpu"), kernels).build(plan)
    reference = LoraStepBuilder(torch.bfloat16, torch.device("cpu")).build(plan)
    ins = {"qkv": hidden, "o": 40, "gate_up": hidden, "down": 50}
    for projection, outs in sizes.items():
        x = torch.randn(len(owner), ins[projection], generator=gen).bfloat16()
        y = torch.randn(len(owner), sum(outs), generator=gen).bfloat16()
        exact, slack = y.double(), torch.zeros(y.shape, dtype=torch.float64)
        for row, adapter in enumerate(owner):
            if adapter is not None and projection in adapter.factors[0]:
                a, b = (f.double() for f in adapter.factors[0][projection])
                xr = x[row].double()
                t = xr @ a
                exact[row] += t @ b
                x_step = xr.abs().max() / 127                     # per row
                a_step = a.abs().amax(0) / 127                    # per rank
                t_error = 0.5 * x_step * a.abs().sum(0) + 0.5 * a_step * xr.abs().sum() + \
                    0.25 * x_step * a_step * len(xr)
                t_most = t.abs() + t_error
                b_step = b.abs().amax(0) / 127                    # per column
                slack[row] = (t_most @ b.abs()) * 1e-6 + t_error @ b.abs() + \
                    0.5 * t_most.sum() * b_step + 0.5 * t_most.max() / 127 * b.abs().sum(0)
        bound = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7) + slack
        got = compiled.layer(0).add_(projection, y.clone(), x)
        base = [row for row, adapter in enumerate(owner) if adapter is None]
        assert torch.equal(got[base], y[base])
        assert ((got.double() - exact).abs() <= bound).all(), projection
        torch_form = reference.layer(0).add_(projection, y.clone(), x)
        assert ((torch_form.double() - exact).abs() <= bound).all(), projection


def test_compiled_steps_share_one_stack_as_the_set_changes() -> None:
    """The compiled form stacks every adapter it has seen once: steps running any subset of
    them reuse that stack (no restacking as requests come and go) and give each row what the
    step with every adapter gives it, bit for bit; forgetting an adapter restacks without it."""
    from ember.kernels import load_kernels
    from ember.lora.batch import LoraStepBuilder
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_int8_dot:
        pytest.skip("this CPU has no AVX-512 BF16 and VNNI kernels")
    gen = torch.Generator().manual_seed(1)
    hidden, sizes = 72, {"qkv": (40, 24, 24), "gate_up": (50, 50)}
    adapters = [random_fused_adapter(i, {"qkv": 4}, sizes, hidden, gen) for i in (1, 2, 3)]
    builder = LoraStepBuilder(torch.bfloat16, torch.device("cpu"), kernels)
    full = builder.build([(adapters[0], 3), (adapters[1], 2), (adapters[2], 4)])
    x = torch.randn(9, hidden, generator=gen).bfloat16()
    y = torch.randn(9, sum(sizes["qkv"]), generator=gen).bfloat16()
    want = full.layer(0).add_("qkv", y.clone(), x)
    part = builder.build([(None, 3), (adapters[1], 2), (None, 4)])
    assert part._stacks is full._stacks
    got = part.layer(0).add_("qkv", y.clone(), x)
    assert torch.equal(got[3:5], want[3:5]) and torch.equal(got[:3], y[:3])
    builder.forget(adapters[0].uid)
    again = builder.build([(adapters[1], 2)])
    assert again._stacks is not full._stacks
    assert torch.equal(again.layer(0).add_("qkv", y[3:5].clone(), x[3:5]), want[3:5])


def test_decode_stack_adds_adapters_as_the_layers_do(smollm_path: Path, tmp_path: Path) -> None:
    """The production path (int4 weights, bfloat16, compiled kernels): steps with adapter rows
    through the whole-model decode stack equal the same steps layer by layer, at batch sizes
    on both of its paths (int4 up to 8 rows, int8 above)."""
    from ember.weights.loader import open_model_files
    config = open_model_files(str(smollm_path)).model_config()
    for i in range(2):
        write_random_adapter(tmp_path / f"a{i}", config, 8, i, std=0.05, alpha=8)
    engine = EngineCore(EngineConfig(model=str(smollm_path), loras=(
        ("a0", str(tmp_path / "a0")), ("a1", str(tmp_path / "a1")))))
    model = engine.runner.model
    if model.decode_stack is None:
        pytest.skip("this CPU has no compiled decode stack (AVX-512 BF16)")
    prompts = [list(range(100 + 9 * i, 140 + 9 * i)) for i in range(12)]
    for jobs in ([("a1", prompts[0])],
                 [(["a0", None, "a1"][i % 3], p) for i, p in enumerate(prompts)]):
        stacked = run_greedy(engine, jobs, 6, prefix_cache=False)
        stack, model.decode_stack = model.decode_stack, None
        try:
            layered = run_greedy(engine, jobs, 6, prefix_cache=False)
        finally:
            model.decode_stack = stack
        for (tokens, logits), (want_tokens, want_logits) in zip(stacked, layered):
            assert tokens == want_tokens
            torch.testing.assert_close(torch.stack(logits), torch.stack(want_logits),
                                       atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "qwen3moe"])
def test_adapters_on_variant_models_match_peft(kind: str, tmp_path: Path,
                                               tokenizer_files: Path) -> None:
    """The variant decoders (q/k norms, GeGLU, windows, experts) take adapters the same way;
    on a mixture of experts, attention adapters only (an MLP one is refused)."""
    from tests.reference.test_variants_vs_hf import CASES, tiny_variant
    arch, options = CASES[kind]
    base = tiny_variant(arch, **options)
    folder = save_tiny_model(tmp_path / "base", base, tokenizer_files)
    moe = kind == "qwen3moe"
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] + ([] if moe else ["gate_proj",
                                                                        "down_proj"])
    ref = make_adapter(base, tmp_path / "lora", 8, 16, False, targets, 3)
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32",
                                     loras=(("a", str(tmp_path / "lora")),)))
    jobs = [("a", PROMPTS[0]), (None, PROMPTS[1]), ("a", PROMPTS[1])]
    for (lora, prompt), (tokens, _) in zip(jobs, run_greedy(engine, jobs, 6)):
        assert tokens == hf_greedy(ref if lora else base, prompt, 6), (kind, lora)
    if moe:
        make_adapter(base, tmp_path / "mlp", 4, 4, False, ["down_proj"], 4)
        with pytest.raises(ConfigError, match="attention|not a LoRA factor"):
            engine.loras.add("mlp", tmp_path / "mlp")
