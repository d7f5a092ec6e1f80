"""Loading GGUF files whose weights are K-quants (and the other block formats) mixed, as
llama.cpp's Q4_K_M and similar files mix them.

gguf's numpy code cannot quantize K-quants, so the weights are random valid blocks with
scales chosen to give weights of about +-0.1. References: gguf.quants.dequantize of the
same tensors (the weights, exactly) and transformers' Llama holding those weights (the
logits of ember's greedy generation, in float32).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, quants
from gguf import GGMLQuantizationType as Q
from gguf import LlamaFileType

from ember import LLM, SamplingParams
from ember.weights.gguf import GGUFFile, hf_name
from tests.conftest import assert_greedy_close, tiny_hf_model
from tests.reference.test_gguf import llama_cpp_permute, llama_gguf_writer
from tests.reference.test_kquants import F16_FIELDS
from tests.reference.test_llama_vs_hf import PROMPTS, hf_logits

# K-quant rows hold whole blocks of 256 values, so the tiny model is 256 wide
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
# per type, the f16 fields' values (F16_FIELDS order): a scale d, and for the types with a
# minimum the value that centres the weights near 0 (dmin is subtracted, m added)
FIELDS = {Q.Q2_K: (4e-3, 6e-3), Q.Q3_K: (1e-3,), Q.Q4_K: (1e-4, 7.5e-4),
          Q.Q5_K: (5e-5, 7.75e-4), Q.Q6_K: (2e-5,), Q.IQ4_XS: (2e-5,), Q.IQ4_NL: (7e-4,),
          Q.Q5_0: (6e-3,), Q.Q5_1: (6e-3, -9.6e-2), Q.Q4_0: (1e-2,), Q.Q4_1: (1e-2, -8e-2)}
# GGUF tensor kind -> ggml type, per file; anything else (norms) stays F32
MIXES = {
    "Q4_K_M": {"token_embd": Q.Q8_0, "output": Q.Q6_K, "attn_v": Q.Q6_K, "ffn_down": Q.Q6_K,
               "default": Q.Q4_K},
    "Q2_K": {"token_embd": Q.Q2_K, "output": Q.Q6_K, "attn_v": Q.Q3_K, "ffn_down": Q.Q5_K,
             "default": Q.Q2_K},
    "IQ4_XS": {"token_embd": Q.IQ4_NL, "output": Q.Q5_1, "attn_v": Q.Q5_0, "ffn_down": Q.Q4_1,
               "default": Q.IQ4_XS},
}


def random_tensor(qtype: Q, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes per row] uint8: random blocks of `qtype` with FIELDS' scales, or gguf's
    quantization of random normal weights where gguf can quantize."""
    if qtype == Q.Q8_0:
        return quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), qtype)
    values_per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = shape[0] * shape[1] // values_per_block
    raw = rng.integers(0, 256, (n, block_bytes), dtype=np.uint8)
    for offset, value in zip(F16_FIELDS[qtype], FIELDS[qtype], strict=True):
        raw[:, offset:offset + 2] = np.full((n, 1), value, np.float16).view(np.uint8)
    return raw.reshape(shape[0], -1)


def write_mixed_gguf(path: Path, hf_model, mix: dict[str, Q], source: dict,
                     file_type: LlamaFileType | None = None) -> None:
    """A llama GGUF with the hyperparameters and tensor names of `hf_model` (its values
    unused: the 2-D weights are random blocks of the mix's types), `source`'s tokenizer and,
    if given, the general.file_type its maker declared."""
    cfg = hf_model.config
    writer = llama_gguf_writer(path, cfg, source)
    if file_type is not None:
        writer.add_file_type(file_type)
    rng = np.random.default_rng(0)
    for name, shape in gguf_shapes(cfg).items():
        if len(shape) == 1:
            writer.add_tensor(name, rng.uniform(0.8, 1.2, shape).astype(np.float32))
            continue
        kind = name.removesuffix(".weight").split(".")[-1]
        qtype = mix.get(kind, mix["default"])
        packed = random_tensor(qtype, shape, rng)
        writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape (rows, columns) of a Llama config."""
    h, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.num_key_value_heads * h // cfg.num_attention_heads
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        shapes |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
                   f"blk.{i}.attn_q.weight": (h, h), f"blk.{i}.attn_k.weight": (kv, h),
                   f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_output.weight": (h, h),
                   f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                   f"blk.{i}.ffn_down.weight": (h, f)}
    return shapes


@pytest.fixture(scope="module")
def smollm_metadata(smollm_path) -> dict:
    return GGUFFile(smollm_path).metadata


@pytest.fixture(scope="module")
def tiny_wide():
    return tiny_hf_model("llama", **SHAPE)


@pytest.fixture(scope="module", params=list(MIXES))
def mixed_gguf(request, tmp_path_factory, tiny_wide, smollm_metadata) -> Path:
    path = tmp_path_factory.mktemp("kquants") / f"tiny-{request.param}.gguf"
    write_mixed_gguf(path, tiny_wide, MIXES[request.param], smollm_metadata)
    return path


def test_loaded_weights_equal_gguf_dequantize(mixed_gguf):
    """ember's tensors are gguf's dequantization of the same bytes, q/k rows un-permuted."""
    file = GGUFFile(mixed_gguf)
    loaded = dict(file.tensors(file.model_config()))
    config = file.model_config()
    heads = {"attn_q": config.num_heads, "attn_k": config.num_kv_heads}
    reader = GGUFReader(mixed_gguf)
    mix = MIXES[mixed_gguf.stem.removeprefix("tiny-")]
    assert {t.tensor_type for t in reader.tensors} == set(mix.values()) | {Q.F32}
    for t in reader.tensors:
        want = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        got = loaded[hf_name(t.name)].numpy()
        kind = t.name.split(".")[-2]
        if kind in heads:  # the file holds llama.cpp's row order
            got = llama_cpp_permute(got, heads[kind])
        if t.tensor_type != Q.F32:  # the scales make weights of about +-0.1, centred
            assert 0.01 < np.abs(want).mean() < 0.1 and abs(want.mean()) < 0.01, t.name
        assert np.array_equal(got, want), t.name


@pytest.mark.parametrize("mixed_gguf", ["Q4_K_M"], indirect=True)
def test_greedy_logits_match_transformers_on_the_same_weights(mixed_gguf):
    """Reference: transformers' Llama holding the weights ember loaded (checked equal to
    gguf's dequantization above), in float32."""
    reference = tiny_hf_model("llama", **SHAPE)
    file = GGUFFile(mixed_gguf)
    reference.load_state_dict(dict(file.tensors(file.model_config())))
    llm = LLM(str(mixed_gguf), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=1,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        want = hf_logits(reference, prompt + tokens[:-1])[len(prompt) - 1:].log_softmax(-1)
        for step, lp in enumerate(out.outputs[0].logprobs):
            assert lp.token_id == int(want[step].argmax())
            assert abs(lp.logprob - float(want[step, lp.token_id])) < 1e-4


@pytest.mark.parametrize("mix,bits,packing", [("Q4_K_M", 4, "int4"), ("Q2_K", 2, "int8"),
                                              ("IQ4_XS", 4, "int8")])
def test_linear_bits_is_the_decoder_majority_type(tmp_path, tiny_wide, mix, bits, packing):
    """What `--quantization auto` packs to: int4 where most decoder weights are in a type
    int4 holds exactly (Q4_K_M: Q4_K, beside Q6_K attn_v and ffn_down), int8 for other
    quantized types (Q2_K's 16-value sub-blocks, IQ4's non-uniform codebook)."""
    no_vocab = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1],
                "tokenizer.ggml.merges": []}
    path = tmp_path / "m.gguf"
    write_mixed_gguf(path, tiny_wide, MIXES[mix], no_vocab)
    assert GGUFFile(path).linear_bits() == bits
    assert GGUFFile(path).linear_packing() == packing
    uniform = {"default": MIXES[mix]["default"], "token_embd": Q.Q8_0, "output": Q.Q8_0}
    write_mixed_gguf(path, tiny_wide, uniform, no_vocab)
    assert GGUFFile(path).linear_bits() == {"Q4_K_M": 4, "Q2_K": 2, "IQ4_XS": 4}[mix]


def test_files_made_below_4_bits_pack_int8_whatever_their_majority(tmp_path, tiny_wide):
    """llama-quantize's Q2_K/Q3_K files of a model whose rows are not whole 256-value blocks
    hold mostly Q4_0 (its fallback) beside Q3_K; int4 would round the Q3_K tensors again, so
    auto packs the file int8 when it declares a 2-3 bit file type, int4 when it does not."""
    no_vocab = {"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.token_type": [1, 1],
                "tokenizer.ggml.merges": []}
    fallback = {"token_embd": Q.Q4_0, "output": Q.Q6_K, "attn_v": Q.Q3_K, "ffn_down": Q.Q3_K,
                "default": Q.Q4_0}
    path = tmp_path / "m.gguf"
    expected = [(None, "int4"), (LlamaFileType.MOSTLY_Q4_0, "int4"),
                (LlamaFileType.MOSTLY_Q2_K, "int8"), (LlamaFileType.MOSTLY_Q3_K_M, "int8")]
    for file_type, packing in expected:
        write_mixed_gguf(path, tiny_wide, fallback, no_vocab, file_type)
        assert GGUFFile(path).linear_packing() == packing, file_type


@pytest.mark.heavy
@pytest.mark.parametrize("mixed_gguf", ["Q4_K_M"], indirect=True)
def test_packed_weights_agree_with_bfloat16_by_the_closeness_rule(mixed_gguf):
    """The dequantized weights repacked for decode: int4 (what auto picks for Q4_K_M) and
    int8; reference: the same file run on dense bfloat16 weights."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    dense = LLM(str(mixed_gguf), dtype="bfloat16", quantization="none")
    ref = dense.generate(PROMPTS, params)
    auto = LLM(str(mixed_gguf), dtype="bfloat16")
    assert auto.engine.quantization == "int4"
    assert_greedy_close(ref, auto.generate(PROMPTS, params))
    int8 = LLM(str(mixed_gguf), dtype="bfloat16", quantization="int8")
    assert_greedy_close(ref, int8.generate(PROMPTS, params))
