"""The gateway's block keys for a prompt are the replica's: reference = the model's own
tokenizer and chat template over the whole prompt, hashed with ember's block hash."""
from __future__ import annotations

from ember.kv.prefix_cache import extend_keys
from ember.router.prompts import PromptKeys, load_tokenizer
from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import SHAKESPEARE


def reference_keys(keys: PromptKeys, body: ChatCompletionRequest, salt: str | None) -> list[int]:
    text = keys.template.render([m.as_template_message(i) for i, m in enumerate(body.messages)],
                                body.add_generation_prompt)
    return extend_keys([], keys.tokenizer.encode(text, add_special_tokens=False), 16, salt)


def test_cached_history_gives_the_whole_prompts_keys(smollm_path):
    keys = PromptKeys(load_tokenizer(str(smollm_path)), (), 64, "x-session-id")
    system = SHAKESPEARE.read_text()[:3000]
    for question in ("What is said here?", "Who speaks first", "  and then?\n"):
        body = ChatCompletionRequest(messages=[{"role": "system", "content": system},
                                               {"role": "user", "content": question}])
        for salt in (None, "tenant-a"):
            body.cache_salt = salt
            got = keys.route_keys(body, None, {16}, {}, True).block_keys[16]
            assert got == reference_keys(keys, body, salt)
    assert len(keys.heads) == 2  # one history, per salt: tokenized once each
    one = ChatCompletionRequest(messages=[{"role": "user", "content": "hi " * 50}])
    assert keys.route_keys(one, None, {16}, {}, True).block_keys[16] == \
        reference_keys(keys, one, None)
    text = CompletionRequest(prompt=system)
    assert keys.route_keys(text, None, {16}, {}, True).block_keys[16] == \
        extend_keys([], keys.tokenizer.encode(system), 16)
