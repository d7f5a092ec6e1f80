"""Embeddings through the engine vs transformers' hidden states, pooled the same way, in fp32.

Reference: transformers' LlamaModel (the tiny random model of conftest) gives the final normed
hidden states; last-token, mean and CLS pooling of them, L2-normalised, must match ember's
vectors to cosine >= 0.9999, whatever the chunking of the prompt and whatever else the engine
runs in the same steps.
"""
from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from ember import LLM, EngineConfig, SamplingParams
from ember.engine.async_engine import AsyncEngine, Finished
from ember.engine.embed import EmbeddingOutput
from ember.errors import InvalidRequest, RequestFailed
from ember.request import PoolingParams
from tests.server.conftest import TEST_KV_GIB

PROMPTS = [list(range(5, 45)), list(range(100, 107)), [3], list(range(1000, 1033))]


def hf_pooled(model, ids: list[int], method: str, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[method]
    return F.normalize(vector[:dimensions], dim=0)


def assert_close(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got)
    assert got_t.shape == want.shape
    assert abs(float(got_t.norm()) - 1.0) < 1e-5
    assert float(got_t @ want) >= 0.9999


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    folder, _ = tiny_llama_dir
    # a budget of 16 tokens: the 40- and 33-token prompts are prefilled in chunks
    return LLM(str(folder), dtype="float32", max_num_batched_tokens=16, max_model_len=64)


@pytest.mark.parametrize("method", ["last", "mean", "cls"])
def test_pooling_matches_transformers(llm, tiny_llama_dir, method):
    _, hf = tiny_llama_dir
    outputs = llm.embed(PROMPTS, PoolingParams(method))
    assert [o.index for o in outputs] == list(range(len(PROMPTS)))
    for out, ids in zip(outputs, PROMPTS):
        assert out.num_prompt_tokens == len(ids)
        assert_close(out.embedding, hf_pooled(hf, ids, method))


def test_text_input_is_tokenized_as_a_prompt(llm, tiny_llama_dir):
    _, hf = tiny_llama_dir
    text = "The quick brown fox jumps over the lazy dog."
    (out,) = llm.embed(text)
    assert_close(out.embedding, hf_pooled(hf, llm.tokenizer.encode(text), "last"))


def test_default_pooling_of_a_decoder_is_the_last_token(llm):
    assert llm.engine.pooling == "last"


def test_dimensions_truncate_then_renormalise(llm, tiny_llama_dir):
    _, hf = tiny_llama_dir
    (full,), (cut,) = llm.embed([PROMPTS[0]]), llm.embed([PROMPTS[0]], PoolingParams(None, 16))
    assert len(cut.embedding) == 16
    assert_close(cut.embedding, hf_pooled(hf, PROMPTS[0], "last", 16))
    assert_close(cut.embedding, F.normalize(torch.tensor(full.embedding[:16]), dim=0))


def test_embeddings_share_steps_with_generation(llm, tiny_llama_dir, monkeypatch):
    """Embedding and generation requests in one engine: they are scheduled in the same steps,
    the generated tokens equal those of the prompts run alone, and the vectors equal
    transformers'; every block is free afterwards."""
    _, hf = tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    core = llm.engine
    kinds_per_step = []
    execute = core.runner.execute

    def recording_execute(plan):
        kinds_per_step.append({s.request.pooling is None for s in plan.scheduled})
        return execute(plan)
    monkeypatch.setattr(core.runner, "execute", recording_execute)
    gens = [core.add_request(f"gen-{i}", ids, params) for i, ids in enumerate(PROMPTS[:2])]
    embs = [core.add_embedding(f"emb-{i}", ids, PoolingParams("mean"))
            for i, ids in enumerate(PROMPTS)]
    while core.has_unfinished():
        core.step()
    assert sum(kinds == {True, False} for kinds in kinds_per_step) >= 2
    assert [g.output_token_ids for g in gens] == alone
    for request, ids in zip(embs, PROMPTS):
        assert request.output_token_ids == []
        assert_close(request.embedding, hf_pooled(hf, ids, "mean"))
    kv = core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_last_token_pooling_reuses_the_prefix_cache(llm, tiny_llama_dir):
    """A repeated prompt hits the cache (all but its last token) and pools the same vector."""
    _, hf = tiny_llama_dir
    ids = list(range(2000, 2040))
    first = llm.embed([ids])[0].embedding
    request = llm.engine.add_embedding("again", ids)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.num_cached_tokens >= 32
    assert_close(request.embedding, hf_pooled(hf, ids, "last"))
    assert_close(first, torch.tensor(request.embedding))


def test_mean_pooling_does_not_reuse_the_prefix_cache(llm):
    ids = list(range(3000, 3040))
    llm.embed([ids])   # cached by a last-token embedding
    request = llm.engine.add_embedding("mean", ids, PoolingParams("mean"))
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert request.num_cached_tokens == 0


@pytest.mark.parametrize("prompt, pooling, message", [
    ([], PoolingParams(), "empty"),
    (list(range(65)), PoolingParams(), "at most 64"),
    ([5, 6], PoolingParams(dimensions=65), r"\[1, 64\]"),
    ([10**6], PoolingParams(), "outside the vocabulary"),
])
def test_bad_inputs_are_refused(llm, prompt, pooling, message):
    with pytest.raises(InvalidRequest, match=message):
        llm.embed([prompt], pooling)
    assert not llm.engine.has_unfinished()


def test_an_input_of_exactly_max_model_len_is_embedded(llm, tiny_llama_dir):
    _, hf = tiny_llama_dir
    ids = list(range(64))
    (out,) = llm.embed([ids])
    assert_close(out.embedding, hf_pooled(hf, ids, "last"))


def test_embed_task_refuses_generation(tiny_llama_dir):
    folder, hf = tiny_llama_dir
    llm = LLM(str(folder), dtype="float32", task="embed", pooling="mean", max_model_len=64)
    with pytest.raises(InvalidRequest, match="embed task"):
        llm.generate([[5, 6, 7]])
    (out,) = llm.embed([PROMPTS[1]])
    assert_close(out.embedding, hf_pooled(hf, PROMPTS[1], "mean"))


@pytest.mark.parametrize("method", ["last", "mean"])
def test_default_smollm_gguf_embeddings_match_transformers(smollm_llm, hf_smollm, method):
    """The default model (SmolLM2's Q4_1 GGUF, dequantized, fp32) against transformers loading
    the same GGUF."""
    texts = ["The capital of France is Paris.", "def fib(n): return n if n < 2 else fib(n - 1)"]
    outputs = smollm_llm.embed(texts, PoolingParams(method))
    for out, text in zip(outputs, texts):
        assert_close(out.embedding, hf_pooled(hf_smollm, smollm_llm.tokenizer.encode(text),
                                              method))


def test_a_fault_pooling_one_request_fails_it_alone(llm, tiny_llama_dir, monkeypatch):
    """A fault while pooling one embedding request's rows fails that request (its inputs
    together) alone: another embedding request and a generation in the same steps finish with
    the vectors and tokens they have without the fault; every block is free afterwards."""
    folder, hf = tiny_llama_dir
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want_tokens = llm.generate([PROMPTS[3]], params)[0].outputs[0].token_ids
    engine = AsyncEngine(EngineConfig.from_options(model=str(folder), dtype="float32",
                                                   max_num_batched_tokens=16,
                                                   kv_cache_gib=TEST_KV_GIB))
    engine.start()
    asyncio.run(engine.wait_ready())
    try:
        pooler = engine.core.runner.pooler
        real_take = pooler._take

        def take(item, rows):
            if item.request.request_id.startswith("victim-"):
                raise RuntimeError("injected fault")
            return real_take(item, rows)
        monkeypatch.setattr(pooler, "_take", take)

        async def embed(request_id: str, inputs: list[list[int]]):
            vectors = [None] * len(inputs)
            try:
                async for item in engine.submit_embedding(request_id, inputs,
                                                          PoolingParams("mean")):
                    if isinstance(item, EmbeddingOutput):
                        vectors[item.index] = item.embedding
            except RequestFailed as e:
                return e
            return vectors

        async def generate() -> list[int]:
            tokens: list[int] = []
            async for item in engine.generate("gen", PROMPTS[3], params):
                if not isinstance(item, Finished):
                    tokens += item.token_ids
            return tokens

        async def main():
            return await asyncio.gather(embed("victim", PROMPTS[:2]), embed("ok", PROMPTS[1:3]),
                                        generate())
        victim, ok, tokens = asyncio.run(main())
        assert isinstance(victim, RequestFailed) and "injected fault" in victim.message
        for vector, ids in zip(ok, PROMPTS[1:3]):
            assert_close(vector, hf_pooled(hf, ids, "mean"))
        assert tokens == want_tokens
        kv = engine.core.scheduler.kv
        assert not engine.core.scheduler.requests and kv.num_free_blocks == kv.num_blocks
    finally:
        engine.shutdown()
