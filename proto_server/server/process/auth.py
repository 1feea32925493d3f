"""Who a request is: the owner of its API key (keys are tenants), and the salt that keeps one
tenant's cached prefixes on the engine apart from another's."""

from __future__ import annotations

import base64
import hmac
from collections.abc import Sequence

from proto_server.server.store import ANONYMOUS, owner_id


class Tenants:
    """`api_keys`: the keys a request may present (none: auth is off, every request is
    `ANONYMOUS`); `secret`: what the cache salts are drawn from, so that with a kept secret a
    tenant's salt is the same in every worker and after a restart (its prefix stays warm),
    and no tenant can guess another's."""

    def __init__(self, api_keys: Sequence[str], secret: bytes) -> None:
        self._keys = tuple(api_keys)
        self._salt_key = hmac.digest(secret, b"proto-server engine cache salt", "sha256")

    def owner(self, authorization: str | None) -> str | None:
        """Who sends a request with this `Authorization` header: the owner id of its key,
        `ANONYMOUS` with auth off, or None if it is refused."""
        if not self._keys:
            return ANONYMOUS
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None  # an empty token never matches, whatever the keys
        matches = [key for key in self._keys if hmac.compare_digest(token.encode(), key.encode())]
        return owner_id(matches[0]) if matches else None

    def cache_salt(self, owner: str) -> str | None:
        """The salt of `owner`'s sessions on the engine, so tenants share no cached prefix;
        None without auth (one tenant: every session shares)."""
        if owner == ANONYMOUS:
            return None
        digest = hmac.digest(self._salt_key, owner.encode(), "sha256")
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()  # 43 characters
