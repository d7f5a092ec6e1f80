"""Tokenizer, chat template and streaming detokenization.

Reference: transformers' tokenizer for the same model (from the same GGUF, and from the folder
transformers saves), and its apply_chat_template.
"""
from __future__ import annotations

import pytest

from ember.errors import InvalidRequest, ModelLoadError, UnsupportedModel
from ember.tokenizer.answers import AnswerTokens
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf import GGUFFile
from tests.conftest import SHAKESPEARE

CORPUS = [
    "Hello, world!",
    "  leading spaces, trailing spaces   ",
    "tabs\tand\nnew\n\n\nlines\r\nwindows",
    "Unicode: café, naïve, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, עברית, العربية",
    "Emoji: 😀 🦜 👩‍👩‍👧‍👦 🇫🇷 ✨🔥 and a flag 🏳️‍🌈",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\n\tif x != None:\n\t\tpass",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "         ",
    "a" * 300,
    "mixed\u00a0nbsp\u2003em-space and zero\u200bwidth",
    "It's we'll they've I'd you're HE'S",
]


@pytest.fixture(scope="module")
def ember_tokenizer(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(GGUFFile(smollm_path).metadata)


def test_gguf_tokenizer_encodes_like_transformers(ember_tokenizer, hf_smollm_tokenizer):
    for text in CORPUS:
        assert ember_tokenizer.encode(text) == hf_smollm_tokenizer.encode(text), text


def test_gguf_tokenizer_on_shakespeare(ember_tokenizer, hf_smollm_tokenizer):
    if not SHAKESPEARE.exists():
        pytest.skip(f"{SHAKESPEARE} is absent (it ships in ember/bench/data)")
    text = SHAKESPEARE.read_text()[:20000]
    assert ember_tokenizer.encode(text) == hf_smollm_tokenizer.encode(text)


def test_hf_folder_tokenizer_encodes_like_transformers(tokenizer_files):
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_files)
    ours = Tokenizer.from_hf_folder(tokenizer_files)
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), text
    assert ours.eos_token_ids == {hf.eos_token_id}


def test_decode_round_trips(ember_tokenizer):
    for text in CORPUS:
        ids = ember_tokenizer.encode(text)
        assert ember_tokenizer.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_from_the_file(ember_tokenizer):
    assert ember_tokenizer.bos_token == "<|im_start|>"
    assert ember_tokenizer.eos_token == "<|im_end|>"
    assert ember_tokenizer.eos_token_ids == {2}
    assert ember_tokenizer.encode("<|im_end|>") == [2]
    assert ember_tokenizer.decode([2, 19556], skip_special_tokens=True) == "Hello"


def test_streaming_detokenizer_never_splits_a_character(ember_tokenizer):
    split_somewhere = False
    for text in CORPUS:
        ids = ember_tokenizer.encode(text)
        stream = ember_tokenizer.detokenizer(skip_special_tokens=False)
        pieces = [stream.push(t) for t in ids]
        assert "".join(pieces) == text
        assert all("\ufffd" not in p for p in pieces)
        split_somewhere |= any("\ufffd" in ember_tokenizer.decode([t]) for t in ids)
    assert split_somewhere, "the corpus must hold a character split across tokens"


MESSAGES = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀\n\nPlease."}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ember_tokenizer, hf_smollm_tokenizer,
                                            add_generation_prompt):
    template = ChatTemplate.of(ember_tokenizer)
    for messages in MESSAGES:
        want = hf_smollm_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert template.render(messages, add_generation_prompt) == want


def test_chat_template_is_sandboxed():
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequest):
        template.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{% set _ = messages.append(1) %}{{ messages|length }}")
    with pytest.raises(InvalidRequest):
        mutating.render([{"role": "user", "content": "x"}])


def test_chat_template_errors_are_clear():
    with pytest.raises(UnsupportedModel, match="no chat template"):
        ChatTemplate(None)
    strict = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(InvalidRequest, match="roles must alternate"):
        strict.render([{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequest, match="non-empty list"):
        strict.render([])
    with pytest.raises(InvalidRequest, match="string 'role'"):
        strict.render([{"content": "no role"}])


def test_hf_folder_without_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


def test_unsupported_gguf_vocabulary_is_a_clear_error():
    with pytest.raises(UnsupportedModel, match="'t5' is not supported.*Hugging Face folder"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5"})


def test_chat_answers_keep_the_ids_the_model_generated(ember_tokenizer):
    """A previous answer in a later prompt keeps its generated ids, even where re-encoding its
    text would split it otherwise; the text around it is encoded as usual."""
    tok = ember_tokenizer

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    generated = enc("hel") + enc("lo") + enc(" ") * 3          # not how "hello   " encodes
    text = tok.decode(generated, skip_special_tokens=False)
    assert text == "hello   " and enc(text) != generated
    answers = AnswerTokens(tok, capacity=2)
    answers.remember(text, generated + sorted(tok.eos_token_ids))  # the end-of-turn token goes
    head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    tail = "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
    prompt = head + text + tail
    ids = answers.encode(prompt, [text])
    assert ids == enc(head) + generated + enc(tail)
    assert tok.decode(ids, skip_special_tokens=False) == prompt
    # an answer the template did not render verbatim, or never remembered: plain encoding
    assert answers.encode(head + "hello" + tail, [text]) == enc(head + "hello" + tail)
    assert answers.encode(prompt, ["other"]) == enc(prompt)
    # ids that do not spell their text are not kept; the oldest answer goes past capacity
    answers.remember("something else", generated)
    assert len(answers) == 1
    answers.remember("a b", enc("a") + enc(" b"))
    answers.remember("c d", enc("c") + enc(" d"))
    assert len(answers) == 2 and answers.encode(prompt, [text]) == enc(prompt)
