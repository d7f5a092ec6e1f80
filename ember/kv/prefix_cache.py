"""Chained block hashes: a block's key covers its own tokens and, through its parent's key,
every token before it, so equal keys mean equal prefixes.

    key(block i) = H(key(block i-1), token ids of block i, salt if i == 0)

H is BLAKE2b cut to 64 bits: stable across processes and machines, so a router can compare
keys from many replicas. A salt (per tenant, per LoRA adapter) changes every key of a prompt,
so salted requests share nothing with anyone who does not know the salt.
"""
from __future__ import annotations

import hashlib
from array import array


def block_key(parent: int | None, token_ids: list[int], salt: str | None = None) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else parent.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if salt is not None:
        h.update(b"salt:" + salt.encode("utf-8"))
    return int.from_bytes(h.digest(), "little")


def extend_keys(keys: list[int], token_ids: list[int], block_size: int,
                salt: str | None = None) -> list[int]:
    """Append the keys of every full block of `token_ids` not yet in `keys` (in place)."""
    for i in range(len(keys), len(token_ids) // block_size):
        parent = keys[i - 1] if i else None
        keys.append(block_key(parent, token_ids[i * block_size:(i + 1) * block_size],
                              salt if i == 0 else None))
    return keys


def adapter_salt(digest: str, cache_salt: str | None) -> str:
    """The salt of a request run with a LoRA adapter: its KV is the adapter's own. `digest`
    is of the adapter's files (lora/adapter.py), so every replica that loaded the same files
    salts alike and a router can reproduce it."""
    return f"lora:{digest}" + ("" if cache_salt is None else f"\n{cache_salt}")


def prompt_block_keys(token_ids: list[int], block_size: int, salt: str | None = None
                      ) -> list[int]:
    """The key of every block of `token_ids`, a partly filled last one keyed over the tokens
    it holds (as a finished request's tail is cached): two replicas that agree on these hold
    the same tokens in the same blocks."""
    keys = extend_keys([], token_ids, block_size, salt)
    tail = token_ids[len(keys) * block_size:]
    if tail:
        keys.append(block_key(keys[-1] if keys else None, tail, None if keys else salt))
    return keys
