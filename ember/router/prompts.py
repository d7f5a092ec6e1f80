"""A request's routing keys: the chained block keys a replica would give its prompt.

The gateway tokenizes and templates the prompt as `ember serve` does (the model's own
tokenizer and chat template, torch-free), then hashes it with ember's own `extend_keys`, salted
as the replica salts it. A difference (tools written into the prompt, earlier answers' token
ids) only costs a cache miss, never a wrong answer: routing is a guess the replica checks.
"""
from __future__ import annotations

from pathlib import Path

from ember.config import ApiKey
from ember.kv.prefix_cache import extend_keys
from ember.router.fleet import RouteKeys
from ember.router.kv_index import text_keys
from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from ember.server.tenants import tenant_salt, tenant_salts
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.tokenizer import Tokenizer
from ember.weights.gguf_metadata import read_gguf_metadata
from ember.weights.paths import default_model_path

Body = CompletionRequest | ChatCompletionRequest


def load_tokenizer(model: str | None) -> Tokenizer | None:
    """The model's tokenizer, or None when the gateway cannot read the model's files (it
    then routes on text alone)."""
    path = default_model_path() if model is None else Path(model).expanduser()
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
        self.template = ChatTemplate(tokenizer.chat_template, tokenizer.bos_token,
                                     tokenizer.eos_token) if tokenizer is not None else None
        self.salts = tenant_salts(keys)
        self.text_chunk_chars = text_chunk_chars
        self.session_header = session_header

    def route_keys(self, body: Body, tenant: ApiKey | None, block_sizes: set[int],
                   headers: dict[str, str], want_keys: bool) -> RouteKeys:
        session_key = headers.get(self.session_header) or body.user
        if not want_keys:
            return RouteKeys({}, [], session_key)
        text = prompt_text(body)
        salt = body.cache_salt
        if tenant is not None:
            salt = tenant_salt(self.salts[tenant.tenant], salt)
        block_keys: dict[int, list[int]] = {}
        if self.tokenizer is not None and block_sizes and body.prefix_cache:
            ids = self.token_ids(body, text)
            for size in block_sizes:
                block_keys[size] = extend_keys([], ids, size, salt)
        chunks = text_keys((salt or "") + "\x00" + text, self.text_chunk_chars) \
            if body.prefix_cache else []
        return RouteKeys(block_keys, chunks, session_key)

    def token_ids(self, body: Body, text: str) -> list[int]:
        if isinstance(body, ChatCompletionRequest):
            rendered = self.template.render(
                [m.as_template_message(i) for i, m in enumerate(body.messages)],
                body.add_generation_prompt)
            return self.tokenizer.encode(rendered, add_special_tokens=False)
        first = body.prompt_list()[0]
        return first if isinstance(first, list) else self.tokenizer.encode(first)


def prompt_text(body: Body) -> str:
    """The request's prompt as plain text (chat: each message's role and text)."""
    if isinstance(body, ChatCompletionRequest):
        return "".join(f"<{m.role}>{m.as_template_message(i)['content']}"
                       for i, m in enumerate(body.messages))
    first = body.prompt_list()[0]
    return first if isinstance(first, str) else " ".join(map(str, first))
