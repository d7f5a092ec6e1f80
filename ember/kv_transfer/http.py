"""The decode replica's calls to a prefill replica's server (server/kv_transfer.py): claim a
transfer, stream its blocks, release it. Every failure is a TransferFailed with the reason
the decode replica counts when it computes the prompt itself instead. (Imported by decode
replicas only: an ordinary server never loads httpx.)"""
from __future__ import annotations

from collections.abc import Iterator

import httpx

from ember.kv_transfer.params import TransferFailed


def make_http_client(timeout_s: float) -> httpx.Client:
    """One client for all of a replica's pulls: its connections are kept and reused (making
    a client costs tens of ms, its TLS setup; a connection, a round trip)."""
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)))


class PrefillClient:
    """One transfer's calls to the replica at `url`, over `client`."""

    def __init__(self, client: httpx.Client, url: str, transfer_id: str,
                 authorization: str | None = None) -> None:
        self.client = client
        self.base = f"{url.rstrip('/')}/kv_transfer/{transfer_id}"
        self.headers = {"authorization": authorization} if authorization else {}

    def claim(self) -> dict:
        """Hold the blocks for this pull; the answer says where the shared cache is."""
        return self._json("POST", "/claim")

    def blocks(self, block_ids: list[int]) -> Iterator[bytes]:
        """The stream of the prefill replica's blocks `block_ids` (blocks.py's format)."""
        try:
            with self.client.stream("POST", self.base + "/blocks", headers=self.headers,
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
            resp = self.client.request(method, self.base + path, headers=self.headers)
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
