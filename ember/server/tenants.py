"""Tenants: which key a bearer token names, and each tenant's cache salt. A salt is a digest
of the tenant's keys, so the same keys file gives every replica, and any router in front of
them, the same salts, and nobody without the keys can work them out. Plain Python: the router
imports it."""
from __future__ import annotations

import hashlib
import hmac

from ember.config import ApiKey
from ember.server.errors import Unauthorized


def tenant_salts(keys: tuple[ApiKey, ...]) -> dict[str, str]:
    """Each tenant's cache salt: a digest of its keys. Every replica reading the same file
    salts alike (routers match prefixes across replicas), and no one without the tenant's keys
    can work it out, so the block hashes /kv/events publishes cannot be probed by tenant name
    (which /metrics shows)."""
    by_tenant: dict[str, list[str]] = {}
    for key in keys:
        by_tenant.setdefault(key.tenant, []).append(key.key)
    return {tenant: hashlib.sha256("\n".join(["ember tenant salt", *sorted(secrets)])
                                   .encode()).hexdigest()
            for tenant, secrets in by_tenant.items()}


def tenant_salt(secret: str, cache_salt: str | None) -> str:
    """A salt no other tenant can send: the tenant's secret is hex of a fixed length, so it
    ends where the request's own salt begins."""
    return secret if cache_salt is None else f"{secret}\n{cache_salt}"


def match_key(authorization: str, keys: tuple[ApiKey, ...]) -> ApiKey:
    """The key an `Authorization` header names. Every key is compared, each in constant
    time, so the time taken does not tell which key came close."""
    scheme, _, token = authorization.partition(" ")
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.key.encode()):
            found = key
    if scheme.lower() != "bearer" or found is None:
        raise Unauthorized("missing or wrong API key; send 'Authorization: Bearer <key>'")
    return found
