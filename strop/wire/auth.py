"""The token check every strop server and the engine guard share."""

from __future__ import annotations

import hmac

GUARD_TOKEN_ENV = "STROP_GUARD_TOKEN"  # the guard's token, from the launcher (strop.engines.launch) to the engine's
# supervisor (strop.serving.supervisor), which starts the guard


def bearer_token_matches(header: str, token: str) -> bool:
    """``Bearer <token>``, compared in constant time on bytes (a header may hold any byte). strop serve, the
    agent proxy and this guard all check their tokens with it."""
    scheme, _, sent = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(sent.strip().encode("latin-1"), token.encode())
