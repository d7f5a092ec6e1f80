"""Seeded, reproducible workloads: what to send, never how fast.

Prompts are cut from a text corpus so that they tokenize to the requested length (within ±2
tokens) under the model's tokenizer, read from the model's files or asked of the server's
/tokenize. The same seed gives the same requests.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ember.tokenizer.tokenizer import Tokenizer

Encode = Callable[[str], list[int]]
Decode = Callable[[list[int]], str]
DISTRIBUTIONS = ("fixed", "uniform", "normal", "lognormal")


@dataclass(frozen=True)
class LengthDist:
    """fixed:N | uniform:LOW,HIGH | normal:MEAN,STD | lognormal:MEDIAN,SIGMA (tokens, >= 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> "LengthDist":
        kind, _, args = text.partition(":")
        if kind not in DISTRIBUTIONS:
            if kind.isdigit():
                return cls("fixed", float(kind))
            raise ValueError(f"length distribution {text!r}: use one of "
                             f"{', '.join(d + ':...' for d in DISTRIBUTIONS)} or a number")
        values = [float(v) for v in args.split(",") if v]
        need = 1 if kind == "fixed" else 2
        if len(values) != need:
            raise ValueError(f"{kind} takes {need} number(s), as in "
                             f"{'fixed:32' if need == 1 else kind + ':100,400'}")
        return cls(kind, *values)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.uniform(self.a, self.b)
        elif self.kind == "normal":
            value = rng.gauss(self.a, self.b)
        else:
            value = self.a * math.exp(rng.gauss(0.0, self.b))
        return max(1, round(value))


@dataclass
class BenchRequest:
    index: int
    max_tokens: int
    prompt: str | None = None                       # /v1/completions
    messages: list[dict[str, Any]] | None = None    # /v1/chat/completions
    target_prompt_tokens: int | None = None
    session: int | None = None                      # chat sessions: turns run in order
    turn: int | None = None
    user_turns: list[str] = field(default_factory=list)  # later turns of a session
    inputs: list[str] | None = None                 # /v1/embeddings: the texts to embed
    at_s: float | None = None      # sent this long after the run began (a fixed schedule)
    kind: str | None = None        # its part in a mixed workload, reported apart


def default_corpus() -> str:
    return resources.files("ember.bench").joinpath("data/corpus.txt").read_text()


class PromptMaker:
    """Cuts text out of a corpus that tokenizes to a requested number of tokens."""

    def __init__(self, corpus: str, encode: Encode, decode: Decode, rng: random.Random) -> None:
        self.encode, self.decode, self.rng = encode, decode, rng
        self.ids = encode(corpus)
        if len(self.ids) < 64:
            raise ValueError("the corpus is too short to cut prompts from (under 64 tokens)")

    def _window(self, num_tokens: int) -> list[int]:
        ids = self.ids
        while len(ids) < num_tokens + 8:
            ids = ids + self.ids
        start = self.rng.randrange(0, len(ids) - num_tokens - 4)
        return ids[start:start + num_tokens]

    def make(self, num_tokens: int) -> str:
        """Text of num_tokens ± 2 tokens (re-tokenizing decoded text can merge or split)."""
        window = self._window(num_tokens)
        text = self.decode(window)
        for _ in range(6):
            got = len(self.encode(text))
            if abs(got - num_tokens) <= 2:
                return text
            if got > num_tokens:
                window = window[:len(window) - (got - num_tokens)]
            else:
                window = window + self._window(num_tokens - got)
            text = self.decode(window)
        return text


def synthetic(maker: PromptMaker, num: int, input_len: LengthDist, output_len: LengthDist,
              rng: random.Random, chat: bool) -> list[BenchRequest]:
    requests = []
    for i in range(num):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        text = maker.make(n_in)
        requests.append(_request(i, text, n_out, n_in, chat))
    return requests


def shared_prefix(maker: PromptMaker, groups: int, per_group: int, prefix_len: int,
                  suffix_len: int, output_len: LengthDist, rng: random.Random,
                  chat: bool) -> list[BenchRequest]:
    """G groups x R requests; a group shares a P-token prefix, each adds S unique tokens."""
    prefixes = [maker.make(prefix_len) for _ in range(groups)]
    texts = [prefixes[g] + maker.make(suffix_len) for g in range(groups)
             for _ in range(per_group)]
    rng.shuffle(texts)
    return [_request(i, t, output_len.sample(rng), prefix_len + suffix_len, chat)
            for i, t in enumerate(texts)]


GROUNDED = "Repeat the following text exactly, word for word.\n\n{text}\n\nThe text again:\n\n"


def grounded(maker: PromptMaker, num: int, input_len: LengthDist, output_len: LengthDist,
             rng: random.Random, chat: bool) -> list[BenchRequest]:
    """An input-grounded task: repeat a passage of `input_len` tokens. The answer is mostly
    the prompt's own text, as in editing, quoting or extracting: what prompt-lookup
    speculative decoding guesses well."""
    requests = []
    for i in range(num):
        n_in, n_out = input_len.sample(rng), output_len.sample(rng)
        requests.append(_request(i, GROUNDED.format(text=maker.make(n_in)), n_out, None, chat))
    return requests


def multi_tenant(maker: PromptMaker, tenants: int, num: int, prefix_len: int, suffix_len: int,
                 output_len: LengthDist, rng: random.Random, chat: bool) -> list[BenchRequest]:
    """N requests, each from a tenant drawn at random among T; a tenant's requests share its
    own P-token system prompt and add an S-token question (a fleet's cache-aware routing
    test: more tenants than one replica's cache holds)."""
    systems = [maker.make(prefix_len) for _ in range(tenants)]
    requests = []
    for i in range(num):
        system, question = systems[rng.randrange(tenants)], maker.make(suffix_len)
        max_tokens = output_len.sample(rng)
        if chat:
            requests.append(BenchRequest(i, max_tokens, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}],
                target_prompt_tokens=prefix_len + suffix_len))
        else:
            requests.append(_request(i, system + question, max_tokens, prefix_len + suffix_len,
                                     False))
    return requests


def chat_sessions(maker: PromptMaker, sessions: int, turns: int, user_len: LengthDist,
                  output_len: LengthDist, rng: random.Random) -> list[BenchRequest]:
    """S conversations of T turns; each turn's history holds the server's real replies."""
    requests = []
    for s in range(sessions):
        user_turns = [maker.make(user_len.sample(rng)) for _ in range(turns)]
        requests.append(BenchRequest(
            index=s, max_tokens=output_len.sample(rng),
            messages=[{"role": "user", "content": user_turns[0]}], session=s, turn=0,
            user_turns=user_turns[1:]))
    return requests


def mixed(maker: PromptMaker, streams: int, stream_len: LengthDist, stream_output: int,
          long_prompts: int, long_len: int, long_every_s: float, long_output: int,
          rng: random.Random, chat: bool) -> list[BenchRequest]:
    """Chat streams decoding while long prompts arrive, the mix where computing a prompt
    delays tokens already streaming: `streams` requests of `stream_output` tokens sent at
    once, then a prompt of `long_len` tokens every `long_every_s` seconds (`long_prompts` of
    them, `long_output` tokens each). Reported apart as kinds "stream" and "long"."""
    requests = []
    for i in range(streams):
        n_in = stream_len.sample(rng)
        requests.append(replace(_request(i, maker.make(n_in), stream_output, n_in, chat),
                                at_s=0.0, kind="stream"))
    for j in range(long_prompts):
        requests.append(replace(_request(streams + j, maker.make(long_len), long_output,
                                         long_len, chat),
                                at_s=long_every_s * (j + 1), kind="long"))
    return requests


def embedding_batches(maker: PromptMaker, num: int, inputs_per_request: int,
                      input_len: LengthDist, rng: random.Random) -> list[BenchRequest]:
    """N /v1/embeddings requests of K texts each, every text's length drawn from input_len."""
    return [BenchRequest(index=i, max_tokens=0, inputs=[
        maker.make(input_len.sample(rng)) for _ in range(inputs_per_request)])
        for i in range(num)]


def from_jsonl(path: Path, output_len: LengthDist, rng: random.Random,
               chat: bool) -> list[BenchRequest]:
    """Lines of {"prompt": ...} or {"messages": [...]}, optionally with "max_tokens"."""
    requests = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        row = json.loads(line)
        max_tokens = int(row.get("max_tokens") or output_len.sample(rng))
        if "messages" in row:
            requests.append(BenchRequest(len(requests), max_tokens, messages=row["messages"]))
        elif "prompt" in row:
            requests.append(_request(len(requests), row["prompt"], max_tokens, None, chat))
        else:
            raise ValueError(f"{path}:{i + 1} has neither 'prompt' nor 'messages'")
    return requests


def _request(index: int, text: str, max_tokens: int, target: int | None,
             chat: bool) -> BenchRequest:
    if chat:
        return BenchRequest(index, max_tokens, messages=[{"role": "user", "content": text}],
                            target_prompt_tokens=target)
    return BenchRequest(index, max_tokens, prompt=text, target_prompt_tokens=target)


def local_tokenizer(path: str) -> tuple[Encode, Decode]:
    """encode/decode from a model's files (a .gguf, or a folder with tokenizer.json)."""
    from ember.tokenizer.tokenizer import Tokenizer
    p = Path(path)
    if p.is_dir():
        tokenizer = Tokenizer.from_hf_folder(p)
    else:
        from ember.weights.gguf_metadata import read_gguf_metadata
        tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(p))
    return tokenizer_codec(tokenizer)


def tokenizer_codec(tokenizer: "Tokenizer") -> tuple[Encode, Decode]:
    """encode/decode as workloads size prompts: no special tokens added, none skipped."""
    return (lambda t: tokenizer.encode(t, add_special_tokens=False),
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False))


def server_tokenizer(base_url: str, model: str | None, headers: dict[str, str]
                     ) -> tuple[Encode, Decode]:
    """encode/decode through the server's /tokenize and /detokenize (ember, vLLM)."""
    import httpx
    root = base_url.rstrip("/").removesuffix("/v1")
    client = httpx.Client(timeout=60, headers=headers)

    def encode(text: str) -> list[int]:
        r = client.post(root + "/tokenize", json={"prompt": text, "model": model,
                                                  "add_special_tokens": False})
        r.raise_for_status()
        return r.json()["tokens"]

    def decode(ids: list[int]) -> str:
        r = client.post(root + "/detokenize", json={"tokens": ids, "model": model})
        r.raise_for_status()
        return r.json()["prompt"]
    return encode, decode
