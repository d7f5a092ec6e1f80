"""The decode replica's calls to a prefill replica's server (server/kv_transfer.py): claim a
transfer, stream its blocks, release it. Every failure is a TransferFailed with the reason
the decode replica counts when it computes the prompt itself instead."""
from __future__ import annotations

from collections.abc import Iterator

import httpx


class TransferFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class PrefillClient:
    """One transfer's calls to the replica at `url`, each bounded by `timeout_s`."""

    def __init__(self, url: str, transfer_id: str, timeout_s: float,
                 authorization: str | None = None) -> None:
        self.base = f"{url.rstrip('/')}/kv_transfer/{transfer_id}"
        headers = {"authorization": authorization} if authorization else {}
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(
            timeout_s, connect=min(timeout_s, 5.0)))

    def close(self) -> None:
        self.client.close()

    def claim(self) -> dict:
        """Hold the blocks for this pull; the answer says where the shared cache is."""
        return self._json("POST", "/claim")

    def blocks(self, block_ids: list[int]) -> Iterator[bytes]:
        """The stream of the prefill replica's blocks `block_ids` (blocks.py's format)."""
        try:
            with self.client.stream("POST", self.base + "/blocks",
                                    json={"block_ids": block_ids}) as resp:
                _check(resp)
                yield from resp.iter_bytes()
        except httpx.TimeoutException as e:
            raise TransferFailed("timeout", repr(e)) from e
        except httpx.HTTPError as e:
            raise TransferFailed("transfer_failed", repr(e)) from e

    def release(self) -> None:
        """Unpin the blocks. Raises unless they were still pinned: bytes read before are
        then known to be the prompt's (an expired pin's blocks may have been reused)."""
        self._json("DELETE", "")

    def _json(self, method: str, path: str) -> dict:
        try:
            resp = self.client.request(method, self.base + path)
        except httpx.TimeoutException as e:
            raise TransferFailed("timeout", repr(e)) from e
        except httpx.HTTPError as e:
            raise TransferFailed("unreachable", repr(e)) from e
        _check(resp)
        return resp.json()


def _check(resp: httpx.Response) -> None:
    if resp.status_code == 404:
        raise TransferFailed("expired", "the prefill replica no longer holds the blocks")
    if resp.status_code != 200:
        resp.read()
        raise TransferFailed("transfer_failed", f"HTTP {resp.status_code}: {resp.text[:200]}")
