"""Shared-secret HMAC challenge/response for store connections (pure functions).

Theory of operation: the token never crosses the wire. The server opens every connection with
a random nonce; the client answers with its own nonce and HMAC-SHA256(token, "client" || server
nonce || client nonce); the server checks it in constant time and answers with
HMAC-SHA256(token, "server" || client nonce || server nonce), so the client also knows it
reached a server that holds the token (not an impostor on the port). Fresh nonces on both sides
make a recorded exchange useless for a later connection. Domain labels keep the two proofs
distinct, so neither can be reflected as the other.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

__all__ = ["NONCE_BYTES", "client_proof", "new_nonce", "server_proof", "token_bytes", "verify"]

NONCE_BYTES: Final[int] = 32
_CLIENT: Final[bytes] = b"m2n-async store v1 client\x00"
_SERVER: Final[bytes] = b"m2n-async store v1 server\x00"


def token_bytes(token: str | bytes | None) -> bytes:
    """The HMAC key for ``token`` (``str`` is UTF-8; ``None`` is the empty key, never valid)."""
    if token is None:
        return b""
    if isinstance(token, str):
        return token.encode()
    if isinstance(token, bytes | bytearray | memoryview):
        return bytes(token)
    raise TypeError(f"token must be str or bytes, got {type(token).__name__}")


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def client_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, _CLIENT + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, _SERVER + client_nonce + server_nonce, hashlib.sha256).digest()


def verify(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
