"""Qwen3, Gemma 2/3, Phi-3, OLMo 2, windowed Mistral and the mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE) against transformers, on tiny random models made here and saved
as Hugging Face folders.

Reference: transformers' own modelling code with the same weights, float32 on CPU, generating
token by token with its cache.

Phi-3's LongRoPE: transformers uses the short factors while a sequence fits the original
context and recomputes it with the long ones past it; ember (as llama.cpp) picks them by the
context it serves. So the Phi-3 case serves the original context (short factors, generation
compared), and test_longrope_past_the_original_context serves more (long factors, compared
with transformers' forward over a sequence past the original context).
"""
from __future__ import annotations

import pytest
import torch

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.core import EngineCore
from ember.models.moe import parameter_counts
from ember.quant.packed import PackedLinear
from ember.weights.safetensors import model_config_from_hf
from tests.conftest import TINY, assert_greedy_close, first_mismatch, save_tiny_model
from tests.reference.test_llama_vs_hf import PROMPTS, ember_greedy_logits, hf_logits

NUM_STEPS = 12
WINDOW = 8  # shorter than most prompts, so that the window cuts keys off
HEAD = dict(head_dim=16)
# factors for head_dim 16: 8 frequencies
ORIGINAL_CONTEXT = 96  # more than any prompt here with its new tokens
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [1.5 + 0.4 * i for i in range(8)],
            "original_max_position_embeddings": ORIGINAL_CONTEXT}

CASES = {
    "qwen3": ("Qwen3", dict(HEAD)),
    "gemma2": ("Gemma2", dict(HEAD, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3Text", dict(HEAD, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention"],
                                  rope_parameters={
                                      "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                         "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 1e4}})),
    "phi3-longrope-window": ("Phi3", dict(pad_token_id=0, sliding_window=16,
                                          rope_parameters=LONGROPE,
                                          original_max_position_embeddings=ORIGINAL_CONTEXT)),
    "olmo2": ("Olmo2", dict(pad_token_id=0)),
    "mistral-window": ("Mistral", dict(sliding_window=WINDOW)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2moe-shared": ("Qwen2Moe", dict(num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48,
                                         mlp_only_layers=[1])),
    "qwen3moe": ("Qwen3Moe", dict(HEAD, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("Olmoe", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=0)),
}


# engine options per case: Phi-3 serves its original context (see the module's docstring)
ENGINE = {"phi3-longrope-window": dict(max_model_len=ORIGINAL_CONTEXT)}


def tiny_variant(kind: str, **overrides):
    """A tiny randomly initialised transformers model of `kind` (seeded), in float32."""
    import transformers
    torch.manual_seed(0)
    config = getattr(transformers, f"{kind}Config")(**{**TINY, **overrides})
    model_cls = getattr(transformers, f"{kind.removesuffix('Text')}ForCausalLM")
    return model_cls(config).eval().float()


@pytest.fixture(scope="module", params=list(CASES))
def variant_pair(request, tmp_path_factory, tokenizer_files):
    kind, options = CASES[request.param]
    model = tiny_variant(kind, **options)
    folder = save_tiny_model(tmp_path_factory.mktemp(request.param), model, tokenizer_files)
    return folder, model, ENGINE.get(request.param, {})


def hf_step_logits(model, prompt: list[int], num_steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logits [num_steps, vocab], token by token."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=num_steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def assert_steps_match_transformers(engine: EngineCore, hf_model, prompt: list[int],
                                    num_steps: int, atol: float) -> None:
    """ember's greedy tokens from `prompt` equal transformers', and so do the logits of the
    prefill and every decode step (within `atol`)."""
    tokens, logits = ember_greedy_logits(engine, prompt, num_steps)
    want_tokens, want = hf_step_logits(hf_model, prompt, num_steps)
    assert tokens == want_tokens, f"diverged at {first_mismatch(want_tokens, tokens)}"
    for step, got in enumerate(logits):
        torch.testing.assert_close(got, want[step], atol=atol, rtol=0,
                                   msg=lambda m, step=step: f"step {step}: {m}")


def test_logits_match_transformers_at_prefill_and_every_decode_step(variant_pair):
    folder, hf_model, options = variant_pair
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32", **options))
    for prompt in PROMPTS:
        assert_steps_match_transformers(engine, hf_model, prompt, NUM_STEPS, atol=1e-4)


# the cases whose batched steps take paths the logits test does not: windows over continued
# chunks, and experts serving several requests' tokens at once
BATCHED = ("gemma2", "phi3-longrope-window", "mistral-window", "mixtral", "qwen2moe-shared")


@pytest.mark.parametrize("variant_pair", BATCHED, indirect=True)
def test_greedy_tokens_match_transformers_batched_in_chunks(variant_pair):
    """All prompts at once, in steps of 16 tokens: the long prompts' later chunks attend over
    the cache beside the others' decodes (the windowed path's groups)."""
    folder, hf_model, options = variant_pair
    llm = LLM(str(folder), dtype="float32", max_num_batched_tokens=16, **options)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        want, _ = hf_step_logits(hf_model, prompt, 24)
        got = out.outputs[0].token_ids
        assert got == want, f"diverged at token {first_mismatch(want, got)}"


def test_longrope_past_the_original_context(tmp_path, tokenizer_files):
    """Served past the original context, every position takes the long factors, as in
    transformers' forward over a sequence longer than the original context."""
    kind, options = CASES["phi3-longrope-window"]
    hf_model = tiny_variant(kind, **options)
    folder = save_tiny_model(tmp_path, hf_model, tokenizer_files)
    prompt = list(range(2000, 2000 + ORIGINAL_CONTEXT + 10))
    engine = EngineCore(EngineConfig(model=str(folder), dtype="float32"))
    tokens, logits = ember_greedy_logits(engine, prompt, 4)
    want = hf_logits(hf_model, prompt + tokens[:-1])[len(prompt) - 1:]
    torch.testing.assert_close(torch.stack(logits), want, atol=1e-4, rtol=0)


def test_window_frees_blocks_behind_it(tmp_path, tokenizer_files):
    """Windowed Mistral with a cache too small for all prompts' whole sequences at once (43
    blocks of 4) but room for their windows (24): the blocks behind every window go back
    as the requests advance, nobody is preempted, and the tokens stay transformers'."""
    kind, options = CASES["mistral-window"]
    hf_model = tiny_variant(kind, **options)
    folder = save_tiny_model(tmp_path, hf_model, tokenizer_files)
    engine = EngineCore(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                  block_size=4, num_blocks=24))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    requests = dict(engine.scheduler.requests)
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_preemptions == 0
    assert engine.scheduler.kv.num_free_blocks == 24
    for i, prompt in enumerate(PROMPTS):
        want, _ = hf_step_logits(hf_model, prompt, 24)
        assert requests[str(i)].output_token_ids == want


@pytest.mark.parametrize("case", ["mixtral", "qwen2moe-shared", "qwen3moe", "olmoe", "qwen3"])
def test_parameter_counts_match_transformers(case):
    """Total parameters are transformers' (norms and biases aside); a MoE's active ones
    count top-k experts of each sparse layer in place of all of them."""
    kind, options = CASES[case]
    hf_model = tiny_variant(kind, **options)
    hf_config = hf_model.config.to_dict() | {"architectures": [type(hf_model).__name__]}
    config = model_config_from_hf(hf_config)
    active, total = parameter_counts(config)
    want = sum(p.numel() for name, p in hf_model.named_parameters()
               if "norm" not in name and not name.endswith("bias"))
    assert total == want
    sparse = config.num_layers - len(config.dense_mlp_layers)
    idle = config.num_experts - config.num_experts_per_tok
    assert total - active == sparse * idle * 3 * config.hidden_size * \
        config.moe_intermediate_size


def test_experts_pack_like_dense_weights(tmp_path, tokenizer_files):
    """--quantization int8 packs every expert's projections (not the router), and greedy
    tokens stay close to the dense bfloat16 model's (the closeness rule)."""
    kind, options = CASES["qwen2moe-shared"]
    folder = save_tiny_model(tmp_path, tiny_variant(kind, **options), tokenizer_files)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    dense = LLM(str(folder), dtype="bfloat16", quantization="none")
    packed = LLM(str(folder), dtype="bfloat16", quantization="int8")
    moe = packed.engine.runner.model.model.layers[0].mlp
    linears = [m for expert in [*moe.experts, moe.shared_expert]
               for m in (expert.gate_up_proj, expert.down_proj)]
    assert all(isinstance(m, PackedLinear) for m in linears)
    assert not isinstance(moe.gate, PackedLinear)
    assert_greedy_close(dense.generate(PROMPTS, params), packed.generate(PROMPTS, params))


def test_roofline_counts_active_expert_weights():
    """The roofline's per-token parameters are the active ones: parameter_counts' less the
    input embedding (a lookup) and the routers (kept out of the linears)."""
    from ember.engine.roofline import model_cost
    from ember.models.decoder import VariantForCausalLM
    kind, options = CASES["mixtral"]
    hf_model = tiny_variant(kind, **options)
    config = model_config_from_hf(hf_model.config.to_dict()
                                  | {"architectures": ["MixtralForCausalLM"]})
    with torch.device("meta"):
        model = VariantForCausalLM(config)
    active, _ = parameter_counts(config)
    routers = config.num_layers * config.hidden_size * config.num_experts
    embedding = config.vocab_size * config.hidden_size
    assert model_cost(model, 0).params == active - embedding - routers


# one prompt of three blocks, so that a repeat hits the cache for two and a partial one
REPEATED = list(range(100, 141))
# heads the compiled kernels attend (64 wide): the path whose rows are summed alike whatever
# the step (docs/architecture.md, "Same request, same answer"); the torch path's float32
# matmuls may not be
WIDE = dict(head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)


def repeat_answers(folder, options: dict, times: int = 4) -> list[tuple[list[int], list]]:
    """The same greedy request `times` times in a row on the engine's defaults for the model
    (prefix cache on: later ones hit it): each one's tokens and logprobs."""
    engine = LLM(str(folder), **options).engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    answers = []
    for i in range(times):
        request = engine.add_request(f"again-{i}", REPEATED, params)
        while not request.is_finished:
            engine.step()
        answers.append((request.output_token_ids,
                        [(lp.logprob, lp.top) for lp in request.output_logprobs]))
    return answers


@pytest.mark.parametrize("case", ["llama", "qwen2", *CASES])
def test_a_repeated_request_gets_the_same_answer_on_every_architecture(case, tmp_path,
                                                                       tokenizer_files):
    """Every architecture, 64-wide heads, the defaults (bfloat16, the compiled kernels):
    the same tokens and logprobs, bit for bit, from a cold cache and from a warm one."""
    if case in ("llama", "qwen2"):
        kind, options = {"llama": "Llama", "qwen2": "Qwen2"}[case], {}
    else:
        kind, options = CASES[case]
    if kind == "Phi3":   # LongRoPE's factors are sized for 16-wide heads
        options = dict(pad_token_id=0, sliding_window=16)
    model = tiny_variant(kind, **{**options, **WIDE})
    folder = save_tiny_model(tmp_path, model, tokenizer_files)
    first, *again = repeat_answers(folder, {} if kind == "Phi3" else ENGINE.get(case, {}))
    assert all(a == first for a in again)
