"""Constrained decoding: a constraint -> a compiled grammar -> a per-step token bitmask.

The grammar engine is xgrammar (docs/benchmarks.md compares it with llguidance on this CPU:
both compile typical schemas in about a millisecond; xgrammar fills a 49k-token mask in ~3 µs
a step against ~18 µs, and its structural tags express "free text until a tool call starts,
then the call's JSON schema" directly). Compiled grammars are cached by their source, so a
repeated schema costs nothing. A request's matcher advances with each token it samples; the
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

import json
import re

import torch
import xgrammar as xgr

from ember.constraint import Constraint
from ember.errors import InvalidRequest
from ember.tokenizer.tokenizer import Tokenizer

_ENGINE_NOISE = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (Check failed: \(.*?\) is false: )?")

class Grammars:
    """Compiles constraints for one tokenizer (thread-safe; results are cached)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        vocab = [tokenizer.backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                 stop_token_ids=sorted(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        c, spec = self._compiler, constraint.spec
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


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)


def new_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(batch, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Ban (set to -inf) every token the rows' grammars do not allow. In place."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
