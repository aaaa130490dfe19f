"""The one bearer-token check of the appliance's HTTP services: the proxy's client keys and
its admin API, the bootstrap sidecar's token, D's KV-params guard. Tokens are compared as
SHA-256 digests (equal lengths), against every key each time, so the time taken says
nothing about which key, or how much of one, was right."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Keys:
    """The keys one service accepts; empty (falsy) when it accepts any caller."""

    def __init__(self, keys: Iterable[str | None]) -> None:
        self._digests = [_digest(k) for k in keys if k]

    def __bool__(self) -> bool:
        return bool(self._digests)

    def admit(self, authorization: str) -> bool:
        """Whether an `Authorization` header value carries one of the keys."""
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = _digest(given.strip())
        ok = False
        for key in self._digests:
            ok |= hmac.compare_digest(digest, key)
        return ok
