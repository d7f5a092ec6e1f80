"""`ember models inspect`: the report of a GGUF file.

References: for the shipped SmolLM2-135M Q4_1 file, the parameter count from its published
shape (30 layers of width 576, 9 heads of 64 with 3 KV heads, MLP 1536, 49152 tokens, tied
embeddings) and the bytes from the block formats' sizes; for tiny files written here, what
was written into them.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from ember.cli import main
from ember.errors import ModelLoadError
from ember.weights.gguf import ARCHITECTURES
from ember.weights.inspect import format_report, inspect_gguf


def smollm_params() -> int:
    hidden, kv, mlp, layers, vocab = 576, 3 * 64, 1536, 30, 49152
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden


def test_shipped_model_report(smollm_path):
    report = inspect_gguf(smollm_path)
    assert (report.architecture, report.context_length) == ("llama", 8192)
    assert report.num_params == smollm_params()
    usage = {u.qtype: u for u in report.types}
    assert set(usage) == {"Q4_1", "Q8_0", "F32"}
    assert usage["Q4_1"].num_tensors == 30 * 7          # every linear of every layer
    assert usage["Q8_0"].num_tensors == 1               # the (tied) embedding
    assert usage["F32"].num_tensors == 30 * 2 + 1       # the norms
    for qtype, u in usage.items():
        values, size = GGML_QUANT_SIZES[Q[qtype]]
        assert u.num_bytes == u.num_params // values * size
    assert report.has_chat_template and report.linear_bits == 4
    assert report.runnable and report.reasons == () and report.notes == ()
    text = format_report(report)
    assert "134,515,008" in text and "ember can run   yes" in text


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[Q, tuple[int, int]]]) -> Path:
    """A GGUF with llama-like hyperparameters for `arch` and random tensors of given ggml
    types and shapes (rows, columns)."""
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    rng = np.random.default_rng(0)
    for name, (qtype, (rows, cols)) in tensors.items():
        if qtype == Q.F32:
            writer.add_tensor(name, rng.standard_normal((rows, cols)).astype(np.float32))
            continue
        values, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // values * size), dtype=np.uint8)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (Q.F32, (32, 256))})
    report = inspect_gguf(path)
    assert not report.runnable
    assert report.reasons == ("architecture 'gpt2' is not supported; ember runs GGUF "
                              f"architectures {', '.join(ARCHITECTURES)}",)
    assert report.num_params == 32 * 256 and report.context_length == 4096


def test_unsupported_types_and_tensors_are_named(tmp_path):
    tensors = {"token_embd.weight": (Q.Q4_K, (32, 256)),
               "blk.0.attn_q.weight": (Q.Q8_K, (256, 256)),
               "blk.0.attn_k.weight": (Q.IQ2_XXS, (256, 256)),
               "blk.0.attn_sinks.weight": (Q.Q6_K, (512, 256))}
    report = inspect_gguf(write_gguf(tmp_path / "odd.gguf", "llama", tensors))
    assert not report.runnable
    assert len(report.reasons) == 2
    assert report.reasons[0].startswith("tensor blk.0.attn_q.weight uses ggml type Q8_K, "
                                        "which ember cannot dequantize")
    assert report.reasons[1].startswith("tensor blk.0.attn_sinks.weight is not part of "
                                        "the llama layout")
    assert report.notes == ("tensor blk.0.attn_k.weight in ggml type IQ2_XXS load through the "
                            "gguf package's numpy code, about 10x slower than ember's own "
                            "kernels",)
    usage = {u.qtype: (u.num_tensors, u.num_params) for u in report.types}
    assert usage == {"Q4_K": (1, 32 * 256), "Q8_K": (1, 256 * 256), "IQ2_XXS": (1, 256 * 256),
                     "Q6_K": (1, 512 * 256)}
    assert report.linear_bits == 6 and not report.has_chat_template  # Q6_K holds the most


def test_cli_prints_the_report(smollm_path, capsys):
    report = inspect_gguf(smollm_path)
    assert main(["models", "inspect", str(smollm_path)]) == 0
    assert capsys.readouterr().out.strip() == format_report(report)
    assert main(["models", "inspect", str(smollm_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(asdict(report)))


def test_cli_refuses_what_is_not_a_gguf_file(tmp_path, capsys):
    assert main(["models", "inspect", str(tmp_path / "none.gguf")]) == 2
    assert "is not a file; pass the path of a .gguf file" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        inspect_gguf(tmp_path / "notes.txt")
