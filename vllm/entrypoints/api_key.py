"""The API-key check of the HTTP servers: `Authorization: Bearer KEY`, compared in constant
time.

The key is kept as its SHA-256 digest and the presented token is hashed the same way before
`secrets.compare_digest`: that comparison is constant-time only for inputs of equal length,
and digests always are, so the time taken says nothing about the key's length or prefix.
"""

from __future__ import annotations

import hashlib
import secrets


class ApiKeyCheck:
    """Whether an Authorization header carries the server's key."""

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("the API key must not be empty.")
        self._digest = _digest(key)

    def allows(self, authorization: str) -> bool:
        """`Bearer KEY`, the scheme in any case (RFC 7235), surrounding spaces ignored."""
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer":
            return False
        return secrets.compare_digest(_digest(token.strip()), self._digest)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()
