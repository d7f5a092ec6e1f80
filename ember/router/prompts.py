"""A request's routing keys: the chained block keys a replica would give its prompt.

The gateway tokenizes and templates the prompt as `ember serve` does (the model's own
tokenizer and chat template, torch-free), then hashes it with ember's own `extend_keys`, salted
as the replica salts it (by tenant, and by the digest of the LoRA adapter a request names).
A difference (tools written into the prompt, earlier answers' token ids) only costs a cache
miss, never a wrong answer: routing is a guess the replica checks.
"""
from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from ember.config import ApiKey
from ember.errors import ConfigError
from ember.kv.prefix_cache import adapter_salt, extend_keys
from ember.router.fleet import RouteKeys
from ember.router.kv_index import text_keys
from ember.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from ember.server.tenants import tenant_salt, tenant_salts
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf_metadata import read_gguf_metadata
from ember.weights.paths import default_model_path

Body = CompletionRequest | ChatCompletionRequest | EmbeddingRequest
MAX_HEADS = 1024


def load_tokenizer(model: str | None) -> Tokenizer | None:
    """The model's tokenizer, or None when the gateway cannot read the model's files (it
    then routes on text alone)."""
    try:
        path = default_model_path() if model is None else Path(model).expanduser()
    except ConfigError:  # no default model here: the replicas may run anything
        return None
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        path = ggufs[0] if len(ggufs) == 1 else path
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf_metadata(read_gguf_metadata(path))
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    return None


class PromptKeys:
    def __init__(self, tokenizer: Tokenizer | None, keys: tuple[ApiKey, ...],
                 text_chunk_chars: int, session_header: str) -> None:
        self.tokenizer = tokenizer
        # a model without a chat template (a base model) is asked plain prompts only
        self.template = ChatTemplate.of(tokenizer) \
            if tokenizer is not None and tokenizer.chat_template else None
        self.salts = tenant_salts(keys)
        self.text_chunk_chars = text_chunk_chars
        self.session_header = session_header
        # a chat's rendered history -> its token ids and block keys (LRU)
        self.heads: OrderedDict[tuple[str, int, str | None], tuple[list[int], list[int]]] = \
            OrderedDict()

    def route_keys(self, body: Body, tenant: ApiKey | None, block_sizes: set[int],
                   headers: Mapping[str, str], want_keys: bool, want_text: bool = True,
                   adapter: str | None = None) -> RouteKeys:
        """The request's keys: block keys per block size, and the text tree's chunk keys if
        `want_text` (a replica without KV events is routed on text). `adapter` is the digest
        of the LoRA adapter the request names, if any: the replica salts its blocks by it."""
        session_key = headers.get(self.session_header) or body.user
        if not want_keys:
            return RouteKeys({}, [], session_key)
        salt = body.cache_salt
        if tenant is not None:
            salt = tenant_salt(self.salts[tenant.tenant], salt)
        if adapter is not None:
            salt = adapter_salt(adapter, salt)
        cached = isinstance(body, EmbeddingRequest) or body.prefix_cache
        block_keys: dict[int, list[int]] = {}
        chat = isinstance(body, ChatCompletionRequest)
        if self.tokenizer is not None and block_sizes and cached and \
                (self.template is not None or not chat):
            for size in block_sizes:
                block_keys[size] = self.block_keys(body, size, salt)
        chunks = text_keys((salt or "") + "\x00" + prompt_text(body), self.text_chunk_chars) \
            if cached and want_text else []
        return RouteKeys(block_keys, chunks, session_key)

    def block_keys(self, body: Body, block_size: int, salt: str | None) -> list[int]:
        """The prompt's block keys. For a chat, the conversation before its last message
        (a tenant's system prompt, a session's history) is tokenized and hashed once and
        remembered: encoding a long prompt costs milliseconds, more than routing may."""
        if not isinstance(body, ChatCompletionRequest):
            first = first_prompt(body)
            ids = first if isinstance(first, list) else self.tokenizer.encode(first)
            return extend_keys([], ids, block_size, salt)
        messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
        full = self.template.render(messages, body.add_generation_prompt)
        head = self.template.render(messages[:-1], False) if len(messages) > 1 else ""
        if not head or not full.startswith(head):
            return extend_keys([], self.tokenizer.encode(full, add_special_tokens=False),
                               block_size, salt)
        head_ids, head_keys = self._head(head, block_size, salt)
        ids = head_ids + self.tokenizer.encode(full[len(head):], add_special_tokens=False)
        return extend_keys(list(head_keys), ids, block_size, salt)

    def num_tokens(self, body: CompletionRequest | ChatCompletionRequest) -> int:
        """The prompt's length in tokens, as the replica counts it; without the tokenizer (or
        a chat template) estimated from its text at 4 characters a token."""
        chat = isinstance(body, ChatCompletionRequest)
        if self.tokenizer is None or (chat and self.template is None):
            return len(prompt_text(body)) // 4
        if not chat:
            first = first_prompt(body)
            return len(first) if isinstance(first, list) else len(self.tokenizer.encode(first))
        messages = [m.as_template_message(i) for i, m in enumerate(body.messages)]
        return len(self.tokenizer.encode(self.template.render(messages,
                                                              body.add_generation_prompt),
                                         add_special_tokens=False))

    def _head(self, text: str, block_size: int, salt: str | None
              ) -> tuple[list[int], list[int]]:
        key = (text, block_size, salt)
        found = self.heads.get(key)
        if found is None:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            found = (ids, extend_keys([], ids, block_size, salt))
            self.heads[key] = found
            if len(self.heads) > MAX_HEADS:
                self.heads.popitem(last=False)
        else:
            self.heads.move_to_end(key)
        return found


def prompt_text(body: Body) -> str:
    """The request's prompt as plain text (chat: each message's role and text)."""
    if isinstance(body, ChatCompletionRequest):
        return "".join(f"<{m.role}>{m.as_template_message(i)['content']}"
                       for i, m in enumerate(body.messages))
    first = first_prompt(body)
    return first if isinstance(first, str) else " ".join(map(str, first))


def first_prompt(body: CompletionRequest | EmbeddingRequest) -> str | list[int]:
    """The first prompt (or input to embed): the one a request is routed by."""
    if isinstance(body, EmbeddingRequest):
        return body.inputs(sys.maxsize)[0]   # (their number is checked where it is parsed)
    return body.prompt_list()[0]
