"""What travels between a prefill replica, the gateway and a decode replica (plain data, no
torch: the server reads and writes it).

A prefill replica answers a request sent with `{"do_remote_decode": true}` with transfer
parameters: which blocks of its KV cache hold the prompt (pinned until pulled, released, or
`expires_at`), their chained keys, and the first token it sampled. The gateway passes them on
unchanged as the decode replica's `kv_transfer_params`; the decode replica checks them
against its own prompt and cache and pulls the blocks it lacks (connector.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

# why a decode replica computed a prompt itself instead of pulling it (a metrics label)
FALLBACK_REASONS = ("incompatible", "prompt_mismatch", "expired", "unreachable",
                    "transfer_failed", "timeout")


class TransferFailed(Exception):
    """A pull that did not load; `reason` is one of FALLBACK_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class KVFormat:
    """What a block's bytes mean: two replicas move blocks only when these agree."""

    model: str
    dtype: str             # the cache's: int8 (with float16 scales), bfloat16, float32...
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Export:
    """A prompt's blocks pinned on the prefill replica for another to pull."""

    transfer_id: str
    replica_id: str
    block_ids: tuple[int, ...]
    block_keys: tuple[int, ...]  # prompt_block_keys of the prompt (kv/prefix_cache.py)
    num_tokens: int              # prompt tokens whose KV the blocks hold
    first_token_id: int
    num_cached_tokens: int       # of the prompt, what the prefill replica's cache held
    expires_at: float            # unix time: released then unless pulled or released first
    kv_format: KVFormat


@dataclass(frozen=True)
class RemotePrefill:
    """A decode replica's request: the prompt was computed on the replica at `url`, whose
    server takes `authorization` (the credentials the request reached this one with)."""

    export: Export
    url: str
    authorization: str | None = None


def export_params(export: Export, url: str) -> dict:
    """The prefill answer's `kv_transfer_params` (JSON), which the gateway passes on."""
    params = asdict(export)
    return {"do_remote_prefill": True, "remote_url": url.rstrip("/"),
            "remote_replica_id": params.pop("replica_id"),
            "remote_block_ids": list(params.pop("block_ids")),
            "block_keys": list(params.pop("block_keys")), **params}


def remote_prefill(params: dict, authorization: str | None = None) -> RemotePrefill:
    """export_params' inverse (the fields checked already: server/protocol.py)."""
    fmt = params["kv_format"]
    export = Export(params["transfer_id"], params["remote_replica_id"],
                    tuple(params["remote_block_ids"]), tuple(params["block_keys"]),
                    params["num_tokens"], params["first_token_id"],
                    params["num_cached_tokens"], params["expires_at"],
                    KVFormat(**fmt) if isinstance(fmt, dict) else fmt)
    return RemotePrefill(export, params["remote_url"], authorization)
