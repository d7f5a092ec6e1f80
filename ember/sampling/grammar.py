"""Constrained decoding: a constraint -> a compiled grammar -> a per-step token bitmask.

The grammar engine is xgrammar (benchmarks/grammar_engines.py compares it with llguidance:
both compile typical schemas in about a millisecond; xgrammar fills a 49k-token mask in ~3 µs
a step against ~18 µs, and its structural tags express "free text until a tool call starts,
then the call's JSON schema" directly). Compiled grammars are cached by their source (the
last 256), so a repeated schema costs nothing. Compiles run in two dedicated threads under a
time limit: a schema that compiles for longer is refused, and a runaway compile can hold at
most those threads, never the server's. A request's matcher advances with each token it samples; the
mask is applied as one masked_fill before the sampler sees the logits.

Kinds of constraint:
  json_schema   a JSON Schema (the keywords ember can enforce; any other is refused, naming it)
  json_object   any JSON object
  regex         a regular expression the whole output must match
  grammar       an EBNF / GBNF grammar (root rule `root`)
  lark          a Lark grammar
  choice        one of a list of strings
  structural_tag  xgrammar's structural tag JSON (tool calls use it)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch

from ember.constraint import Constraint
from ember.errors import InvalidRequest, Overloaded
from ember.tokenizer.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar as xgr

_ENGINE_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

JSON_KINDS = ("json_schema", "json_object")
TAG_OPEN, TAG_CLOSE = b"<tool_call>", b"</tool_call>"
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 256         # compiled grammars kept
COMPILE_WORKERS = 2      # threads that compile (xgrammar cannot be interrupted mid-compile)
MAX_PENDING = 64         # distinct compiles running or queued before new ones get a 429

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedCompiler(Generic[K, V]):
    """Runs `compile_fn` in a few dedicated threads with a time limit, keeping the last
    `cache_size` results (least recently used out first). Callers asking for a key already
    compiling share that compile. A compile past its time limit keeps its thread until it
    ends (a thread cannot be stopped), but the caller gets its answer at the limit.
    """

    def __init__(self, compile_fn: Callable[[K], V], timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = CACHE_SIZE, max_workers: int = COMPILE_WORKERS,
                 max_pending: int = MAX_PENDING) -> None:
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.max_pending = max_pending
        self._fn = compile_fn
        self._lock = threading.Lock()
        self._cache: OrderedDict[K, V] = OrderedDict()
        self._pending: dict[K, concurrent.futures.Future] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers, thread_name_prefix="ember-compile")

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: K) -> bool:
        return key in self._cache

    def compile(self, key: K, what: str = "grammar") -> V:
        """Blocking: the result, or InvalidRequest once the time limit has passed."""
        try:
            return self._submit(key, what).result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow(what) from None

    async def compile_async(self, key: K, what: str = "grammar") -> V:
        """As compile(), without blocking the event loop meanwhile."""
        future = asyncio.wrap_future(self._submit(key, what))
        try:  # shield: a caller that gives up must not cancel a compile others share
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(what) from None

    def submit(self, fn: Callable[[], object]) -> concurrent.futures.Future:
        """Run other work (such as a one-time set-up) in the compile threads."""
        return self._executor.submit(fn)

    def _submit(self, key: K, what: str) -> concurrent.futures.Future:
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                done: concurrent.futures.Future = concurrent.futures.Future()
                done.set_result(self._cache[key])
                return done
            if key in self._pending:
                return self._pending[key]
            if len(self._pending) >= self.max_pending:
                raise Overloaded(f"{len(self._pending)} grammars are compiling already; "
                                 "retry later")
            future = self._executor.submit(self._run, key)
            self._pending[key] = future
            return future

    def _run(self, key: K) -> V:
        try:
            value = self._fn(key)
            with self._lock:
                self._cache[key] = value
                self._cache.move_to_end(key)
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            return value
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def _too_slow(self, what: str) -> InvalidRequest:
        return InvalidRequest(f"the {what} took longer than {self.timeout_s:g} s to compile; "
                              "simplify it (fewer or smaller alternatives, shorter length or "
                              "repeat bounds)", param="response_format")


@dataclass(frozen=True)
class Compiled:
    """A compiled constraint and what the matcher needs beside it."""

    grammar: xgr.CompiledGrammar
    kind: str
    control_words: torch.Tensor   # [mask words] int32: bits of tokens with bytes < 0x20
    token_bytes: list[bytes]


class Grammars:
    """Compiles constraints for one tokenizer (thread-safe; results are cached).

    The grammar engine and its view of the vocabulary are built on the first constraint:
    xgrammar imports transformers and triton (~50 MB resident, ~0.5 s), which a server that
    never sees a constrained request does not need.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int,
                 timeout_s: float = COMPILE_TIMEOUT_S, cache_size: int = CACHE_SIZE) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._token_bytes: list[bytes] = []
        self._control_words = torch.empty(0, dtype=torch.int32)
        self.compiled: BoundedCompiler[Constraint, Compiled] = BoundedCompiler(
            self._compile_now, timeout_s, cache_size)

    def compile(self, constraint: Constraint) -> Compiled:
        """Blocking; InvalidRequest if the constraint is bad or compiles for too long."""
        self._ready()  # (the one-time set-up is not part of any request's time limit)
        return self.compiled.compile(constraint, _describe(constraint))

    async def compile_async(self, constraint: Constraint) -> Compiled:
        """As compile(), in the compile threads: the event loop and the engine go on."""
        if self._compiler is None:
            await asyncio.wrap_future(self.compiled.submit(self._ready))
        return await self.compiled.compile_async(constraint, _describe(constraint))

    def _compile_now(self, constraint: Constraint) -> Compiled:
        return Compiled(self._compile(self._ready(), constraint), constraint.kind,
                        self._control_words, self._token_bytes)

    def _ready(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self._tokenizer
                vocab = [tok.backend.id_to_token(i) or "" for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL,
                                         vocab_size=self.vocab_size,
                                         stop_token_ids=sorted(tok.eos_token_ids))
                self._token_bytes = [tok.token_bytes(i) for i in range(tok.vocab_size)]
                self._control_words = _token_words(
                    [i for i, b in enumerate(self._token_bytes) if any(c < 0x20 for c in b)
                     and i not in tok.eos_token_ids], self.vocab_size)
                # (no cache of its own: `compiled` is the one cache, and it is bounded)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    @staticmethod
    def _compile(c: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
        spec = constraint.spec
        try:
            if constraint.kind == "json_schema":
                return c.compile_json_schema(spec, any_whitespace=False)
            if constraint.kind == "json_object":  # OpenAI's json_object: an object, any keys
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                             strict_mode=False)
            if constraint.kind == "regex":
                return c.compile_regex(spec)
            if constraint.kind == "grammar":
                return c.compile_grammar(spec)
            if constraint.kind == "lark":
                return c.compile_lark(spec)
            if constraint.kind == "choice":
                pattern = "|".join(re.escape(choice) for choice in json.loads(spec))
                return c.compile_regex(pattern)
            return c.compile_structural_tag(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _ENGINE_NOISE.sub("", str(e)).strip().splitlines()[0]
            raise InvalidRequest(f"the {constraint.kind.replace('_', ' ')} cannot be used: "
                                 f"{message}", param="response_format") from None


def _describe(constraint: Constraint) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar",
            "structural_tag": "tool call grammar"}.get(constraint.kind, constraint.kind)


def _token_words(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """A bitmask row (xgrammar's layout: bit i of word i // 32) with `token_ids` set."""
    words = torch.zeros(-(-vocab_size // 32), dtype=torch.int64)
    for i in token_ids:
        words[i // 32] |= 1 << (i % 32)
    return words.to(torch.int32)  # wraps bit 31 to the sign bit, as int32 bitmasks hold it


class Matcher:
    """One request's position in its grammar.

    Inside JSON (all of a json constraint, or a tool call between its tags) no token with a
    raw control character is allowed, whatever the grammar engine says: JSON needs them
    escaped, and xgrammar lets some through in length-bounded strings.
    """

    def __init__(self, compiled: Compiled) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled.grammar)
        self._compiled = compiled
        self._always_json = compiled.kind in JSON_KINDS
        self._in_call = False
        self._recent = b""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._always_json or self._in_call:
            bitmask[row] &= ~self._compiled.control_words

    def accept(self, token_id: int) -> bool:
        if self._compiled.kind == "structural_tag":
            self._track_calls(self._compiled.token_bytes[token_id]
                              if token_id < len(self._compiled.token_bytes) else b"")
        return self._matcher.accept_token(token_id)

    def _track_calls(self, new: bytes) -> None:
        recent = self._recent + new
        opened, closed = recent.rfind(TAG_OPEN), recent.rfind(TAG_CLOSE)
        if opened > closed and opened >= 0:
            self._in_call = True
        elif closed >= 0:
            self._in_call = False
        self._recent = recent[-len(TAG_CLOSE):]


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    import xgrammar as xgr

    return xgr.allocate_token_bitmask(batch, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Ban (set to -inf) every token the rows' grammars do not allow. In place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
