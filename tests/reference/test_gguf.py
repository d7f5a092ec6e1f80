"""GGUF reading and dequantization.

References: the `gguf` package's numpy dequantizers for every block format, and transformers
models whose weights the GGUF files here were written from.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants

from ember import LLM, EngineConfig, SamplingParams
from ember.errors import ModelLoadError, UnsupportedModel
from ember.quant.formats import dequantize
from ember.weights.gguf import GGUFFile, hf_name, unpermute_rows
from ember.weights.gguf_metadata import open_reader
from ember.weights.loader import open_model_files
from tests.conftest import tiny_hf_model
from tests.reference.test_llama_vs_hf import PROMPTS, hf_logits

QUANT_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_block_dequant_matches_gguf_numpy(qtype):
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((48, 256)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    packed = quants.quantize(weights, qtype)
    want = quants.dequantize(packed, qtype)
    got = dequantize(packed, qtype, (48, 256))
    assert torch.equal(got, torch.from_numpy(want.astype(np.float32)))


def test_shipped_model_tensors_dequantize_exactly(smollm_path):
    reader = GGUFReader(smollm_path)
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        assert torch.equal(dequantize(t.data, t.tensor_type, shape), want.reshape(shape)), t.name
    assert {Q.Q4_1, Q.Q8_0, Q.F32} <= seen


def test_reader_reads_what_the_gguf_package_reads(smollm_path):
    stock, ours = GGUFReader(smollm_path), open_reader(smollm_path)
    assert list(ours.fields) == list(stock.fields)
    for key, field in stock.fields.items():
        assert ours.fields[key].types == field.types, key
        assert ours.fields[key].contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in stock.tensors]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert np.array_equal(mine.data, theirs.data), mine.name
        # a window on the file, not a copy: the loader reads weights straight from the map
        assert np.shares_memory(mine.data, ours.data), mine.name


def test_plain_types_keep_their_values():
    values = np.linspace(-3, 3, 64, dtype=np.float32).reshape(2, 32)
    assert torch.equal(dequantize(values, Q.F32, (2, 32)), torch.from_numpy(values))
    half = values.astype(np.float16)
    assert torch.equal(dequantize(half, Q.F16, (2, 32)).float(),
                       torch.from_numpy(half.astype(np.float32)))
    bf16 = quants.quantize(values, Q.BF16)
    got = dequantize(bf16, Q.BF16, (2, 32))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.float(), torch.from_numpy(quants.dequantize(bf16, Q.BF16)))


def test_metadata_becomes_model_config(smollm_path):
    config = GGUFFile(smollm_path).model_config()
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == \
        (30, 576, 9, 3)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (1536, 49152, 64)
    assert config.rope_theta == 100000.0 and config.max_position_embeddings == 8192
    assert config.tie_word_embeddings and not config.qkv_bias
    assert abs(config.rms_norm_eps - 1e-5) < 1e-9


def test_tensor_names_map_to_transformers():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert hf_name("blk.1.unknown.weight") is None


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to attn_q/attn_k rows (written from its description)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.arange(12 * 5, dtype=np.float32).reshape(12, 5)
    back = unpermute_rows(torch.from_numpy(llama_cpp_permute(w, 3)), 3)
    assert torch.equal(back, torch.from_numpy(w))


def llama_gguf_writer(path: Path, cfg, source: dict) -> GGUFWriter:
    """A GGUFWriter holding a llama model's hyperparameters from the transformers config
    `cfg` and the tokenizer metadata of `source`; the caller adds the tensors."""
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(source["tokenizer.ggml.tokens"])
    writer.add_token_types(source["tokenizer.ggml.token_type"])
    writer.add_token_merges(source["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


def write_tiny_gguf(path: Path, hf_model, qtype: Q, source: dict) -> dict[str, np.ndarray]:
    """Write a transformers Llama as a llama.cpp-style GGUF, with the tokenizer metadata of
    `source`; returns what each weight decodes to."""
    cfg = hf_model.config
    writer = llama_gguf_writer(path, cfg, source)
    decoded = {}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
             "output_norm.weight", "lm_head.weight": "output.weight"}
    parts = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm":
             "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.numpy().astype(np.float32)
        if name in names:
            gname = names[name]
        else:
            layer, part = name.removeprefix("model.layers.").removesuffix(".weight").split(".", 1)
            gname = f"blk.{layer}.{parts[part]}.weight"
        if gname.endswith("attn_q.weight"):
            w = llama_cpp_permute(w, cfg.num_attention_heads)
        elif gname.endswith("attn_k.weight"):
            w = llama_cpp_permute(w, cfg.num_key_value_heads)
        if w.ndim == 2 and qtype != Q.F32:
            packed = quants.quantize(w, qtype)
            writer.add_tensor(gname, packed, raw_shape=packed.shape, raw_dtype=qtype)
            decoded[gname] = quants.dequantize(packed, qtype).astype(np.float32)
        else:
            writer.add_tensor(gname, w)
            decoded[gname] = w
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


@pytest.fixture(scope="module")
def smollm_metadata(smollm_path) -> dict:
    return GGUFFile(smollm_path).metadata


@pytest.fixture(scope="module")
def tiny_untied():
    return tiny_hf_model("llama", tie_word_embeddings=False)


# each type dequantizes as gguf does (above); end to end, two types suffice by default
@pytest.mark.parametrize("qtype", [pytest.param(q, marks=pytest.mark.heavy)
                                   for q in (Q.F32, Q.F16, Q.Q8_0)] + [Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
def test_written_gguf_runs_like_transformers_on_the_decoded_weights(
        tmp_path, tiny_untied, smollm_metadata, qtype):
    """Reference: the transformers model with each weight replaced by gguf's dequantization."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    decoded = write_tiny_gguf(path, tiny_untied, qtype, smollm_metadata)
    reference = tiny_hf_model("llama", tie_word_embeddings=False)
    state = reference.state_dict()
    written = GGUFFile(path)
    for name, w in written.tensors(written.model_config()):
        state[name] = w.float()
    reference.load_state_dict(state)
    if qtype == Q.F32:  # no quantization: the original weights exactly
        for name, w in tiny_untied.state_dict().items():
            assert torch.equal(reference.state_dict()[name], w), name
    else:
        blk0 = torch.from_numpy(decoded["blk.0.attn_v.weight"])
        assert torch.equal(reference.state_dict()["model.layers.0.self_attn.v_proj.weight"], blk0)
    llm = LLM(str(path), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, logprobs=1,
                                                   ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        tokens = out.outputs[0].token_ids
        want = hf_logits(reference, prompt + tokens[:-1])[len(prompt) - 1:].log_softmax(-1)
        for step, lp in enumerate(out.outputs[0].logprobs):
            assert abs(lp.logprob - float(want[step, lp.token_id])) < 1e-4
            assert lp.token_id == int(want[step].argmax())


def test_corrupt_header_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        open_model_files(path)


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        open_model_files(path)


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))


def test_unknown_gguf_architecture_lists_supported(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel, match="'gpt2' is not supported.*llama, qwen2"):
        EngineConfig(model=str(path)) and LLM(str(path))
