"""Multi-turn chat keeps each earlier answer in the token ids the model generated.

One text has many tokenizations, and a model need not generate the one the tokenizer would
pick: re-encoding a previous answer can split it differently, and then the prompt no longer
matches the KV the prefix cache holds for that answer, so everything after the first
difference is recomputed (and the model reads its own words in a form it never wrote). The
server remembers each answer's ids by its text, a bounded LRU, and when a later prompt
renders that answer again it encodes the text around it as usual and splices the ids in.

Only answers whose ids decode to exactly their text are remembered, and a rendered prompt
that does not contain an answer verbatim (a template that trims or rewrites it) is encoded
the ordinary way: the result is always a tokenization of the same text.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict

from ember.tokenizer.tokenizer import Tokenizer


class AnswerTokens:
    def __init__(self, tokenizer: Tokenizer, capacity: int = 1024) -> None:
        self.tokenizer = tokenizer
        self.capacity = capacity
        self._ids: OrderedDict[str, array] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def remember(self, text: str, token_ids: list[int]) -> None:
        """Keep the ids of a finished answer (a trailing end-of-turn token is dropped: the
        template writes its own)."""
        ids = list(token_ids)
        while ids and ids[-1] in self.tokenizer.eos_token_ids:
            ids.pop()
        if not text or self.tokenizer.decode(ids, skip_special_tokens=False) != text:
            return
        self._ids[text] = array("i", ids)
        self._ids.move_to_end(text)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def encode(self, text: str, answers: list[str]) -> list[int]:
        """Token ids of a rendered prompt; `answers` are the assistant contents it renders,
        in order. Remembered ones keep their ids; the text between is encoded as usual."""
        ids: list[int] = []
        pos = 0
        for answer in answers:
            kept = self._ids.get(answer)
            start = text.find(answer, pos) if kept is not None else -1
            if start < 0:
                continue
            self._ids.move_to_end(answer)
            ids += self.tokenizer.encode(text[pos:start], add_special_tokens=False)
            ids += kept
            pos = start + len(answer)
        return ids + self.tokenizer.encode(text[pos:], add_special_tokens=False)
