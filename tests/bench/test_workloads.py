"""Workloads are seeded and prompts hit their token targets (reference: SmolLM2's tokenizer
read from its GGUF, the same one the server uses)."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from ember.bench.workloads import (LengthDist, PromptMaker, chat_sessions, default_corpus,
                                   from_jsonl, local_tokenizer, mixed, multi_tenant,
                                   shared_prefix, synthetic)


@pytest.fixture(scope="module")
def tokenizer(smollm_path):
    return local_tokenizer(str(smollm_path))


def maker(tokenizer, seed: int = 0) -> PromptMaker:
    encode, decode = tokenizer
    return PromptMaker(default_corpus(), encode, decode, random.Random(seed))


def test_prompts_tokenize_to_the_target_within_two(tokenizer):
    encode, _ = tokenizer
    m = maker(tokenizer)
    for target in [1, 5, 32, 100, 257, 600, 1024, 3000]:
        for _ in range(3):
            assert abs(len(encode(m.make(target))) - target) <= 2, target


def test_same_seed_same_requests_other_seed_other_requests(tokenizer):
    def build(seed):
        rng = random.Random(seed)
        return synthetic(maker(tokenizer, seed), 12, LengthDist.parse("uniform:20,80"),
                         LengthDist.parse("normal:30,5"), rng, chat=False)
    a, b, c = build(1), build(1), build(2)
    assert [(r.prompt, r.max_tokens) for r in a] == [(r.prompt, r.max_tokens) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_distributions():
    rng = random.Random(0)
    assert LengthDist.parse("fixed:7").sample(rng) == 7
    assert LengthDist.parse("64").sample(rng) == 64
    uniform = [LengthDist.parse("uniform:100,400").sample(rng) for _ in range(2000)]
    assert min(uniform) >= 100 and max(uniform) <= 400
    assert sum(uniform) / len(uniform) == pytest.approx(250, rel=0.03)
    normal = [LengthDist.parse("normal:200,20").sample(rng) for _ in range(2000)]
    assert sum(normal) / len(normal) == pytest.approx(200, rel=0.02)
    lognormal = sorted(LengthDist.parse("lognormal:100,0.5").sample(rng) for _ in range(2001))
    assert lognormal[1000] == pytest.approx(100, rel=0.06)   # the median is the first number
    assert min(LengthDist.parse("normal:1,50").sample(rng) for _ in range(200)) >= 1
    with pytest.raises(ValueError, match="uniform takes 2"):
        LengthDist.parse("uniform:5")
    with pytest.raises(ValueError, match="use one of"):
        LengthDist.parse("zipf:1")


def test_shared_prefix_groups_share_exactly_their_prefix(tokenizer):
    rng = random.Random(0)
    reqs = shared_prefix(maker(tokenizer), groups=3, per_group=4, prefix_len=100, suffix_len=10,
                         output_len=LengthDist.parse("fixed:8"), rng=rng, chat=False)
    assert len(reqs) == 12
    heads = Counter(r.prompt[:200] for r in reqs)
    assert sorted(heads.values()) == [4, 4, 4]
    assert len({r.prompt for r in reqs}) == 12


def test_multi_tenant_requests_share_their_tenants_system_prompt(tokenizer):
    encode, _ = tokenizer
    reqs = multi_tenant(maker(tokenizer), tenants=5, num=60, prefix_len=80, suffix_len=10,
                        output_len=LengthDist.parse("fixed:8"), rng=random.Random(0), chat=True)
    systems = Counter(r.messages[0]["content"] for r in reqs)
    assert len(reqs) == 60 and len(systems) == 5  # every tenant drawn, at random
    assert max(systems.values()) != min(systems.values())
    assert all(abs(len(encode(s)) - 80) <= 2 for s in systems)
    assert len({r.messages[1]["content"] for r in reqs}) == 60


def test_chat_sessions_and_jsonl(tokenizer, tmp_path):
    rng = random.Random(0)
    sessions = chat_sessions(maker(tokenizer), sessions=2, turns=3,
                             user_len=LengthDist.parse("fixed:20"),
                             output_len=LengthDist.parse("fixed:8"), rng=rng)
    assert [len(s.user_turns) for s in sessions] == [2, 2]
    assert sessions[0].messages[0]["role"] == "user"
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "max_tokens": 5}) + "\n\n" +
                    json.dumps({"messages": [{"role": "user", "content": "yo"}]}) + "\n")
    reqs = from_jsonl(path, LengthDist.parse("fixed:9"), rng, chat=False)
    assert (reqs[0].prompt, reqs[0].max_tokens) == ("hi", 5)
    assert reqs[1].messages[0]["content"] == "yo" and reqs[1].max_tokens == 9


def test_mixed_streams_at_once_then_long_prompts_on_a_schedule(tokenizer):
    encode, _ = tokenizer

    def build(seed):
        return mixed(maker(tokenizer, seed), 16, LengthDist.parse("fixed:40"), 256, 3, 600,
                     2.0, 8, random.Random(seed), chat=True)
    a = build(5)
    assert [(r.kind, r.at_s, r.max_tokens) for r in a] == \
        [("stream", 0.0, 256)] * 16 + [("long", 2.0, 8), ("long", 4.0, 8), ("long", 6.0, 8)]
    assert all(abs(len(encode(r.messages[0]["content"])) - r.target_prompt_tokens) <= 2
               for r in a)
    assert [r.messages for r in a] == [r.messages for r in build(5)]
    assert [r.messages for r in a] != [r.messages for r in build(6)]
