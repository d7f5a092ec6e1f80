"""The n-gram proposer (prompt lookup): text that repeats its context is guessed from it.

Match the last n tokens of the sequence (n at most `max_n`, at least `min_n`) against the rest
of it and propose the tokens that followed the match; the longest match wins, then the newest:

    ... a b c d e ... a b c | ?      suffix "a b c" found earlier -> propose "d e ..."

Pure Python over token ids: no model, no torch. The candidates are the earlier places of the
last token, found with list.index (a C loop), so a step costs microseconds.
"""
from __future__ import annotations

# how far back a match is looked for: the search is linear in it and runs every step
MAX_LOOKBACK = 4096


def propose_ngram(token_ids: list[int], num_tokens: int, max_n: int, min_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the best earlier match of a suffix of
    `token_ids` at least `min_n` and at most `max_n` tokens long; [] if none recurs."""
    total = len(token_ids)
    if total < min_n + 1:
        return []
    last = token_ids[-1]
    best_len, best_end = 0, -1
    i = max(0, total - MAX_LOOKBACK)
    while True:
        try:
            i = token_ids.index(last, i, total - 1)
        except ValueError:
            break
        n = _match_length(token_ids, i, max_n)
        if n >= best_len:   # the newest of the longest
            best_len, best_end = n, i
        i += 1
    if best_len < min_n:
        return []
    return token_ids[best_end + 1:best_end + 1 + num_tokens]


def _match_length(token_ids: list[int], end: int, max_n: int) -> int:
    """How many tokens ending at `end` equal the sequence's last ones (at most max_n)."""
    total = len(token_ids)
    n = 1
    while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[total - 1 - n]:
        n += 1
    return n
