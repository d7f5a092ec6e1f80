"""int8 / int4 packed weights (ember/quant/packed.py).

References: the dequantized weights in float32 for the kernels; gguf's own Q4_1 dequantizer
for the lossless Q4_1 -> int4 conversion; bf16 dense weights for greedy tokens (closeness rule)
and perplexity (int8 within 1%, int4 within 5%, on Shakespeare); for int8
prompt matmuls (SmoothQuant), the bfloat16 ones.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType
from gguf import quants as gguf_quants

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine.calibrate import activation_group, calibration_prompt
from ember.engine.matmul_timing import layer_projections, measure_candidates
from ember.engine.prefill_choice import MAX_ERROR
from ember.engine.perplexity import perplexity
from ember.errors import ConfigError
from ember.kernels import load_kernels, pack_int4_panels, unpack_int4_panels
from ember.quant.packed import (
    HEAD_ACT_GROUP,
    KernelInt8Linear,
    PackedLinear,
    dequantize_int4,
    dequantize_int8,
    packed_everywhere,
    quantize_int4,
    quantize_int8,
    use_brgemm_prefill,
)
from tests.conftest import (
    CHAT_PROMPTS,
    SHAKESPEARE,
    assert_greedy_close,
    save_tiny_model,
    tiny_hf_model,
)


def _linear(out_features: int, in_features: int, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (torch.randn(out_features, in_features) * 0.05).bfloat16()
    return linear


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_packed_matmul_equals_the_dequantized_weights(method, rows):
    linear = _linear(96, 128)
    packed = PackedLinear(linear, method)
    if method == "int8":
        q, scale = quantize_int8(linear.weight)
        weight = dequantize_int8(q, scale)
    else:
        weight = dequantize_int4(*quantize_int4(linear.weight))
    x = torch.randn(rows, 128).bfloat16()
    ref = x.float() @ weight.T
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    # the kernels round their output (and int4 its scales) to bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_big_batches_take_the_dense_weight_and_small_ones_the_packed():
    linear = _linear(64, 64)
    packed = PackedLinear(linear, "int4", max_packed_rows=4)
    assert packed.prepacked == torch.backends.mkldnn.is_available()  # oneDNN's layout
    x = torch.randn(9, 64).bfloat16()
    assert torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight))
    plain = PackedLinear(linear, "int4", max_packed_rows=4, prepack_dense=False)
    assert not plain.prepacked and torch.equal(plain(x), packed(x))
    small = torch.randn(4, 64).bfloat16()
    assert not torch.equal(packed(small), torch.nn.functional.linear(small, linear.weight))
    with packed_everywhere(packed):
        assert not torch.equal(packed(x), torch.nn.functional.linear(x, linear.weight))
    assert packed.max_packed_rows == 4


def test_round_trip_errors_are_within_half_a_step():
    w = torch.randn(40, 256) * torch.linspace(0.01, 3, 40)[:, None]
    q, scale = quantize_int8(w)
    assert ((dequantize_int8(q, scale) - w).abs() <= 0.5 * scale[:, None] * 1.001 + 1e-7).all()
    q4, s4, lo = quantize_int4(w)
    assert q4.min() >= 0 and q4.max() <= 15
    step = s4.repeat_interleave(32, dim=1)
    assert ((dequantize_int4(q4, s4, lo) - w).abs() <= 0.5 * step * 1.001 + 1e-7).all()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q4_1])
def test_q4_weights_convert_to_int4_without_loss(qtype):
    """A GGUF Q4_0 or Q4_1 tensor, dequantized by gguf, requantizes to the very same 4-bit
    values, and in the kernels' panels, whose scales and minima are float16 as in the file:
    exactly for Q4_1; a Q4_0 block whose largest magnitude is positive has its minimum at
    -7 steps, which float16 rounds by up to 1/256 of a step. Q4_0 blocks whose codes stop
    short of 15 are the case a min-max grid would round again."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(16, 128)).astype(np.float32)
    blocks = gguf_quants.quantize(w, qtype)
    deq = torch.from_numpy(gguf_quants.dequantize(blocks, qtype).reshape(16, 128))
    q, scale, lo = quantize_int4(deq)
    torch.testing.assert_close(dequantize_int4(q, scale, lo), deq, rtol=0, atol=1e-6)
    exact = 1e-6 if qtype == QType.Q4_1 else float(scale.max()) / 256
    torch.testing.assert_close(dequantize_int4(*unpack_int4_panels(
        *pack_int4_panels(q, scale, lo))), deq, rtol=0, atol=exact)


def test_packed_weights_need_bfloat16_and_a_cpu(smollm_path):
    with pytest.raises(ConfigError, match="--dtype bfloat16"):
        LLM(str(smollm_path), dtype="float32", quantization="int4")
    with pytest.raises(ConfigError, match="quantization='int3'"):
        EngineConfig(quantization="int3")


@pytest.fixture(scope="module")
def formats(smollm_path):
    """The default model's weights as bf16 (dense), int8 and int4 (packed); int4 as `auto`
    picks it for the shipped Q4_1 GGUF (test_auto_runs_a_q4_gguf_on_int4)."""
    asked = {"none": "none", "int8": "int8", "int4": "auto"}
    return {q: LLM(str(smollm_path), dtype="bfloat16", quantization=asked[q],
                   max_num_batched_tokens=256) for q in ("none", "int8", "int4")}


def test_auto_runs_a_q4_gguf_on_int4(formats):
    assert formats["int4"].config.quantization == "auto"
    assert formats["int4"].engine.quantization == "int4"
    assert formats["none"].engine.quantization == "none"
    assert formats["int8"].engine.quantization == "int8"


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_packed_greedy_tokens_agree_with_bf16_by_the_closeness_rule(formats, method):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    prompts = [formats["none"].chat_prompt([{"role": "user", "content": p}])
               for p in CHAT_PROMPTS]
    ref, got = (formats[k].generate(prompts, params) for k in ("none", method))
    assert_greedy_close(ref, got)


def test_packed_perplexity_on_shakespeare_within_bounds(formats):
    """The decode path (the packed weights, chunks of 512 rows, never the int8 prompt
    weights): for int4 its output projection on int8 activations, as every decode step runs
    it. The default model ships as Q4_1, so int4 holds its values exactly."""
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} is absent (it ships in ember/bench/data)")
    text = SHAKESPEARE.read_text()[:20000]
    ids = formats["none"].tokenizer.encode(text, add_special_tokens=False)[:1536]
    ppl = {k: perplexity(formats[k].engine, ids, window=512)["perplexity"] for k in formats}
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01, ppl
    assert abs(ppl["int4"] / ppl["none"] - 1) < 0.01, ppl


def test_output_projection_takes_int8_activations_over_int4_weights(formats):
    """int4 formats: the output projection rounds its input to int8 per group of
    HEAD_ACT_GROUP at every batch size (int8_linear_a8, on the weight kept in quads: the same
    sums as from the pairs, up to 8 rows on the kernel's one-stream path, above on its tiles),
    each row on its own, so that a row's logits do not depend on its batch), and keeps the
    weight in quads only, from which the tied embedding reads its rows too; int8 formats keep
    bfloat16 inputs at every size (their 1% budget), on the pairs. Both formats round the
    output projection to the same int8 weight."""
    heads = {k: formats[k].engine.runner.model.lm_head for k in ("int4", "int8")}
    if not isinstance(heads["int4"], KernelInt8Linear) or not heads["int4"].kernels.has_int8_dot:
        pytest.skip("int8 activations need the compiled kernels with AVX-512 VNNI")
    assert heads["int4"].act_group == HEAD_ACT_GROUP and heads["int8"].act_group is None
    assert heads["int4"].quads is not None and heads["int4"].packed is None  # one copy each
    assert heads["int8"].quads is None and heads["int8"].packed is not None
    head, kernels, pairs = heads["int4"], heads["int4"].kernels, heads["int8"].packed
    assert torch.equal(head.scales, heads["int8"].scales)
    batch = torch.randn(32, head.in_features).bfloat16()
    for rows in (1, 3, 8, 9, 32):
        x = batch[:rows]
        plain = kernels.int8_linear(x, pairs, head.scales)
        a8 = kernels.int8_linear_a8(x, pairs, head.scales, HEAD_ACT_GROUP)
        assert not torch.equal(plain, a8)
        assert torch.equal(head(x), a8)
        assert torch.equal(head(x), head(batch)[:rows])    # the same rows in a larger batch
        assert torch.equal(heads["int8"](x), plain)
    ids = torch.tensor([0, 1, 17, 49151, 17])
    embeds = [formats[k].engine.runner.model.model.embed_tokens(ids) for k in ("int4", "int8")]
    assert torch.equal(embeds[0], embeds[1])


def test_int8_prompt_matmuls_smooth_away_an_outlier_channel():
    """SmoothQuant: with one input channel 50x the others, rounding rows to int8 loses the
    small channels; the calibrated int8 weight moves that range into the weight and comes
    closer to the bfloat16 matmul than the same int8 path without smoothing."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_bf16_dot:
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    linear = _linear(96, 128)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 128, generator=g)
    x[:, 5] *= 50
    x = x.bfloat16()
    want = torch.nn.functional.linear(x.float(), linear.weight.detach().float())
    errors = {}
    for name, amax in (("smoothed", x.float().abs().amax(dim=0)), ("plain", None)):
        packed = PackedLinear(linear, "int4", kernels=kernels)
        if amax is None:  # alpha 1 with unit maxima: smooth = 1, no smoothing
            packed.use_int8_dense(kernels, torch.ones(128), alpha=1.0)
        else:
            packed.use_int8_dense(kernels, amax)
        # in quads for ember's int8 tiles where the CPU has VNNI (96 outputs: 3 x 32)
        assert packed.weight is None and packed.int8_quads == kernels.has_int8_dot
        assert packed.dense_q.dtype == (torch.uint8 if packed.int8_quads else torch.int8)
        assert packed.dense_bytes() == 96 * 128 + 4 * (96 + 128)
        got = packed(x)
        assert torch.equal(packed(x[:4]), PackedLinear(linear, "int4", kernels=kernels)(x[:4]))
        errors[name] = float((got.float() - want).abs().mean())
    assert errors["smoothed"] < 0.5 * errors["plain"], errors


def test_int8_prompt_weights_made_through_an_int8_copy_stay_close_to_bfloat16():
    """How the engine makes them (ember/engine/calibrate.py): the bfloat16 weight shrunk to
    plain int8 first (the packed int4 one serves meanwhile), the smoothed int8 made from that:
    a second rounding, so at most half as much error again as made straight from bfloat16
    (two equal independent roundings would add ~41%), 2% of the outputs' size, copy freed."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_bf16_dot:
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    linear = _linear(96, 128)
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = torch.nn.functional.linear(x.float(), linear.weight.detach().float())
    amax = x.float().abs().amax(dim=0)
    direct, shrunk = (PackedLinear(linear, "int4", kernels=kernels) for _ in range(2))
    direct.use_int8_dense(kernels, amax)
    shrunk.shrink_dense()
    assert shrunk.weight is None and shrunk.int8_source[0].dtype == torch.int8
    assert torch.equal(shrunk(x), PackedLinear(linear, "int4", keep_dense=False,
                                               kernels=kernels)(x))   # int4 meanwhile
    shrunk.use_int8_dense(kernels, amax)
    assert shrunk.int8_source is None
    errors = [float((m(x).float() - want).abs().mean()) for m in (direct, shrunk)]
    assert errors[1] <= 1.5 * errors[0] and errors[1] < 0.02 * float(want.abs().mean())


@pytest.fixture(scope="module")
def bf16_prompts(smollm_path):
    """The default int4 weights with bfloat16 prompt matmuls (formats' int4 has int8 ones)."""
    return LLM(str(smollm_path), dtype="bfloat16", quantization="int4",
               prefill_matmul="bfloat16", max_num_batched_tokens=256)


def test_auto_prompt_matmuls_are_int8_and_the_down_projection_only_over_int4(formats,
                                                                              bf16_prompts):
    engine = formats["int4"].engine
    if engine.prefill_matmul != "int8":
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    assert bf16_prompts.engine.prefill_matmul == "bfloat16"
    assert formats["none"].engine.prefill_matmul == "bfloat16"   # nothing packed there
    for name in ("int4", "int8"):
        layer = formats[name].engine.runner.model.model.layers[3]
        for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
            assert proj.w8a8 is not None and proj.weight is None and proj.int8_source is None
            assert proj.act_group == 0                         # one scale per row
    down = engine.runner.model.model.layers[3].mlp.down_proj
    assert down.w8a8 is not None and down.act_group == 512     # 1536 inputs, three groups
    assert down.weight is None and down.int8_source is None
    down = formats["int8"].engine.runner.model.model.layers[3].mlp.down_proj
    assert down.w8a8 is None and down.weight is not None       # int8's 1% budget: bfloat16
    assert bf16_prompts.engine.runner.model.model.layers[3].mlp.down_proj.w8a8 is None
    assert not engine.has_unfinished() and engine.scheduler.kv.num_free_blocks == \
        engine.scheduler.kv.num_blocks                   # calibration left nothing behind
    assert calibration_prompt(100, 16) == calibration_prompt(100, 16)


@pytest.mark.parametrize(("features", "group"), [(1536, 512), (11008, 256), (14336, 512),
                                                 (576, 288), (100, 0)])
def test_sharp_inputs_take_the_largest_activation_group_that_divides_them(features, group):
    assert activation_group(features) == group


def test_int8_prompt_matmul_perplexity_within_each_formats_budget(formats, bf16_prompts):
    """The prompt path (every chunk on the weights prompt chunks take) against the bf16
    model: int4 weights (int8 activations on all four projections) within 5%, int8 weights
    (the down projection on bfloat16) within 1%, the formats' budgets; and the down
    projection's int8 costs something (the two int4 paths differ)."""
    if formats["int4"].engine.prefill_matmul != "int8":
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} is absent (it ships in ember/bench/data)")
    text = SHAKESPEARE.read_text()[:40000]   # 3072 tokens in windows of 1024, as the docs
    ids = formats["none"].tokenizer.encode(text, add_special_tokens=False)[:3072]
    ppl = {name: perplexity(llm.engine, ids, window=1024, path="prefill")["perplexity"]
           for name, llm in (("int4", formats["int4"]), ("int8", formats["int8"]),
                             ("int4-bf16", bf16_prompts), ("none", formats["none"]))}
    assert abs(ppl["int4"] / ppl["none"] - 1) < 0.05, ppl
    assert abs(ppl["int8"] / ppl["none"] - 1) < 0.01, ppl
    assert abs(ppl["int4-bf16"] / ppl["none"] - 1) < 0.01, ppl
    assert ppl["int4"] != ppl["int4-bf16"]   # the two paths do differ


@pytest.mark.heavy
def test_calibration_fits_a_small_kv_cache_and_any_step_budget(smollm_path):
    if load_kernels("auto", "cpu") is None or not load_kernels("auto", "cpu").has_bf16_dot:
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    small = LLM(str(smollm_path), num_blocks=4, block_size=16)   # 64 tokens in all
    assert small.engine.prefill_matmul == "int8"
    layer = small.engine.runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.w8a8 is not None
    # every prompt row is calibrated, whatever the step budget cuts its prompt into: the
    # same int8 weights in chunks of 8 as in one step
    chunked = LLM(str(smollm_path), max_num_batched_tokens=8).engine.runner.model
    whole = LLM(str(smollm_path)).engine.runner.model
    for a, b in zip(chunked.modules(), whole.modules()):
        if getattr(a, "w8a8", None) is not None:
            assert torch.equal(a.dense_q, b.dense_q) and torch.equal(a.smooth, b.smooth)


def test_int8_prompt_matmuls_need_packed_weights_and_the_kernels(smollm_path):
    with pytest.raises(ConfigError, match="--quantization int8 or int4"):
        LLM(str(smollm_path), dtype="bfloat16", quantization="none", prefill_matmul="int8")
    with pytest.raises(ConfigError, match="prefill-matmul bfloat16"):
        LLM(str(smollm_path), dtype="bfloat16", quantization="int4", kernels="torch",
            prefill_matmul="int8")
    with pytest.raises(ConfigError, match="prefill_matmul='fp8'"):
        EngineConfig(prefill_matmul="fp8")


def test_int8_prompt_matmuls_with_a_qkv_bias_agree_with_bfloat16_ones(tokenizer_files,
                                                                      tmp_path_factory):
    """A tiny Qwen2 (q/k/v with a bias, hidden 64): its int8 prompt matmuls add the bias after
    the int8 product; greedy tokens by the closeness rule against bfloat16 prompt matmuls."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_bf16_dot:
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    model = tiny_hf_model("qwen2", tie_word_embeddings=True)
    with torch.no_grad():   # transformers starts biases at zero: give them weight
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    folder = save_tiny_model(tmp_path_factory.mktemp("qwen2_w8a8"), model, tokenizer_files)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = [[100 + (7 * i + j) % 5000 for j in range(40 + 9 * i)] for i in range(4)]
    outs = {}
    for matmul in ("bfloat16", "int8"):
        llm = LLM(str(folder), dtype="bfloat16", quantization="int8", prefill_matmul=matmul)
        assert llm.engine.prefill_matmul == matmul
        outs[matmul] = llm.generate(prompts, params)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and qkv.w8a8 is not None
    assert_greedy_close(outs["bfloat16"], outs["int8"])


def test_each_timed_prefill_candidate_computes_the_projections_close_to_float32():
    """ember/engine/matmul_timing.py against the float32 products of the same values: the
    bfloat16 candidate within its rounding, the int8 one (int8 activations per row, per
    group for the down projection over int4 weights) within the guard, farther than
    bfloat16; over int8 weights the int8 candidate keeps the down projection bfloat16
    (int8_act_group), so there it computes what the bfloat16 one does."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_bf16_dot:
        pytest.skip("int8 prompt matmuls need the compiled kernels with AVX-512 BF16")
    config = SimpleNamespace(hidden_size=128, intermediate_size=512, num_experts=0,
                             q_size=128, kv_size=64)
    projections = layer_projections(config)
    int8, bf16 = measure_candidates(["int8", "bfloat16"], projections, "int4", kernels,
                                    rows=64, repeats=2)
    assert bf16.error < 0.01 and bf16.error < int8.error < MAX_ERROR, (int8, bf16)
    assert len(int8.rounds) == len(bf16.rounds) == 2 and min(int8.rounds) > 0
    down = [p for p in projections if p.sharp]
    over_int8 = measure_candidates(["int8", "bfloat16"], down, "int8", kernels, rows=64,
                                   repeats=1)
    over_int4 = measure_candidates(["int8"], down, "int4", kernels, rows=64, repeats=1)
    assert over_int8[0].error == over_int8[1].error < over_int4[0].error
    # torch's brgemm (timed only where it runs the ukernel; here too, on its fallback)
    [brgemm] = measure_candidates(["bfloat16-brgemm"], projections, "int4", kernels,
                                  rows=64, repeats=1)
    assert brgemm.error < 0.01


def test_brgemm_prompt_weights_run_prompt_rows_on_brgemm_and_leave_decode_rows():
    """bfloat16-brgemm prefill matmuls (use_brgemm_prefill): the decoder's prepacked dense
    weights go into brgemm's blocks and prompt rows run brgemm_linear, the bfloat16 matmul
    (float32 reference); decode rows keep the packed weight; an output projection (not
    prepacked: its weight may be the embedding's) and sizes brgemm does not take keep
    oneDNN."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None:
        pytest.skip("brgemm_linear is one of the compiled kernels")
    model = torch.nn.ModuleDict({
        "proj": PackedLinear(_linear(96, 128), "int4", kernels=kernels),
        "odd": PackedLinear(_linear(48, 128, seed=1), "int4", kernels=kernels),
        "head": PackedLinear(_linear(64, 128, seed=2), "int8", prepack_dense=False)})
    x = torch.randn(32, 128, generator=torch.Generator().manual_seed(5)).bfloat16()
    before = {name: (m(x), m(x[:4])) for name, m in model.items()}
    assert use_brgemm_prefill(model, kernels) == 1
    proj = model["proj"]
    assert proj.brgemm is kernels and proj.weight.shape == (3, 128, 32)
    assert "dense=bfloat16 brgemm" in proj.extra_repr()
    assert torch.equal(proj(x), kernels.brgemm_linear(x, proj.weight))
    torch.testing.assert_close(proj(x).float(), F.linear(x.float(), _linear(96, 128).weight
                                                         .float()), atol=2e-2, rtol=2e-2)
    assert torch.equal(proj(x[:4]), before["proj"][1])          # decode rows: int4
    for name in ("odd", "head"):
        assert model[name].brgemm is None
        assert torch.equal(model[name](x), before[name][0])


def test_a_model_on_brgemm_prompt_weights_gives_onednns_greedy_tokens(tiny_llama_dir):
    """The whole engine with the decoder's prompt matmuls moved to brgemm_linear (what the
    engine does where auto picks bfloat16-brgemm) against the same engine on oneDNN's
    bfloat16: greedy tokens by the closeness rule, prompts long enough for dense rows."""
    kernels = load_kernels("auto", "cpu")
    if kernels is None or not kernels.has_bf16_dot:
        pytest.skip("packed int4 weights with prompt weights need the compiled kernels")
    folder, _ = tiny_llama_dir
    llm = LLM(str(folder), dtype="bfloat16", quantization="int4", prefill_matmul="bfloat16")
    prompts = [[100 + (7 * i + j) % 5000 for j in range(24 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    want = llm.generate(prompts, params)
    assert use_brgemm_prefill(llm.engine.runner.model, kernels) == 8   # 4 per layer
    assert_greedy_close(want, llm.generate(prompts, params))
