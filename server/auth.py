"""Bearer-token credentials: which token opened a session is who owns it."""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from typing import Iterable

OPEN = "open"  # the owner of every session on a server without tokens
TOKENS_ENV = "MOA_TOKENS"


def load_tokens(tokens_file: str | None = None, env: str | None = None) -> tuple[str, ...]:
    """Tokens from a file (one per line, blank lines and #-comments ignored) and MOA_TOKENS (comma-separated)."""
    tokens = []
    if tokens_file:
        lines = Path(tokens_file).read_text(encoding="utf-8").splitlines()
        tokens += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    env = os.environ.get(TOKENS_ENV, "") if env is None else env
    tokens += [t.strip() for t in env.split(",") if t.strip()]
    return tuple(dict.fromkeys(tokens))


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Credentials:
    """The accepted tokens; none means an open server where every client is the same owner."""

    def __init__(self, tokens: Iterable[str] = ()):
        self._tokens = tuple(tokens)

    @property
    def open(self) -> bool:
        return not self._tokens

    def owner(self, token: str | None) -> str | None:
        """An owner id for a valid token (a hash prefix, safe to log), OPEN on an open server, else None."""
        if self.open:
            return OPEN
        if token and any(hmac.compare_digest(token.encode(), t.encode()) for t in self._tokens):
            return hashlib.sha256(token.encode()).hexdigest()[:12]
        return None
