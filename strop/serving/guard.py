"""strop's token guard: the only address of a vLLM or SGLang server that strop launches.

Neither engine's own API key closes all of its routes: vLLM's guards only paths under ``/v1``, so
its dev-mode routes (``/collective_rpc``, which joins a weight-update group and loads weights,
``/pause``, ``/resume``, ``/reset_prefix_cache``, ...) stay open; SGLang's leaves ``/health*``,
``/metrics`` and every OPTIONS request open. So the engine listens where only the run's own user
reaches it (vLLM: a Unix socket in a 0700 folder; SGLang: 127.0.0.1, its own key kept on the rest)
and this guard listens on the address strop advertises. It answers every method on every path
with 401 unless the request carries ``Authorization: Bearer <token>`` (compared in constant
time), refuses WebSocket upgrades (strop uses none), and forwards what passes as it comes:

- the request body is read whole first (at most ``max_body_bytes``, else 413): the engine parses
  a whole JSON body before acting anyway, and reading it here keeps one reader of the client's
  connection, which then watches for the client leaving;
- the response streams back chunk by chunk as the engine writes it (server-sent events too);
- a client that leaves ends the guard's connection to the engine at once, before or during the
  response: vLLM and SGLang abort a request whose connection closed, which strop's abort relies on.

It runs in the process that supervises the engine (:func:`strop.serving.supervisor.supervise_group`),
so it lives and dies with it.
"""

from __future__ import annotations

import logging
import asyncio
import json
import socket

import httpx
from strop.wire.auth import bearer_token_matches

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # the largest request strop sends is a prompt or a bucket's tensor list: far below
CONNECT_TIMEOUT_S = 30.0
# hop-by-hop headers (RFC 9110 7.6.1) are the guard's own on each side; content-length is recomputed for the
# body as forwarded; expect: 100-continue was answered here
_NOT_FORWARDED = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"content-length",
    b"expect",
}


def token_matches(headers: list[tuple[bytes, bytes]], token: str) -> bool:
    """``Authorization: Bearer <token>`` among ASGI ``headers`` (the first such header)."""
    for name, value in headers:
        if name.lower() == b"authorization":
            return bearer_token_matches(value.decode("latin-1"), token)
    return False


class TokenGuard:
    """An ASGI application: every request needs the token; those that carry it go to ``upstream``
    (``unix:/path/to/socket`` or ``host:port``)."""

    def __init__(self, token: str, upstream: str, max_body_bytes: int = MAX_BODY_BYTES):
        if not token:
            raise ValueError("the token guard needs a token (the run's engine token)")
        self.token, self.upstream, self.max_body_bytes = token, upstream, max_body_bytes
        self._transport = None
        # (a Unix socket's requests still name a host: the client's own Host header is forwarded)
        self.base_url = httpx.URL("http://engine" if upstream.startswith("unix:") else f"http://{upstream}")

    def transport(self):
        if self._transport is None:  # made in the serving event loop, kept for its life
            uds = self.upstream.removeprefix("unix:") if self.upstream.startswith("unix:") else None
            self._transport = httpx.AsyncHTTPTransport(
                uds=uds, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
            )
        return self._transport

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] != "http":  # a WebSocket closed before it is accepted: the client gets HTTP 403
            await send({"type": "websocket.close", "code": 1008})
        elif not token_matches(scope["headers"], self.token):
            await _answer(
                send,
                401,
                f"{scope['path']} needs the engine's token: 'Authorization: Bearer <token>'",
                [(b"www-authenticate", b"Bearer")],
            )
        else:
            body = await self._body(scope, receive, send)
            if body is not None:
                await self._forward(scope, body, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._transport is not None:
                    await self._transport.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _body(self, scope, receive, send) -> bytes | None:
        """The whole request body; None once the client has left or been answered 413."""
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _answer(
                send,
                413,
                f"a request body of {int(declared)} bytes is over the engine guard's limit of "
                f"{self.max_body_bytes} bytes",
            )
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _answer(send, 413, f"a request body over the engine guard's limit of {self.max_body_bytes} bytes")
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _forward(self, scope, body: bytes, receive, send) -> None:
        """The engine's answer, streamed; the client leaving cancels the exchange, which closes the engine
        connection (an exchange cut short never goes back to the pool)."""
        exchange = asyncio.ensure_future(self._exchange(scope, body, send))
        left = asyncio.ensure_future(_client_left(receive))
        try:
            await asyncio.wait({exchange, left}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (exchange, left):
                task.cancel()
            await asyncio.gather(exchange, left, return_exceptions=True)
        if not exchange.cancelled() and exchange.exception() is not None:
            raise exchange.exception()

    async def _exchange(self, scope, body: bytes, send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in _NOT_FORWARDED]
        if (b"connection", b"close") in [(k.lower(), v.lower()) for k, v in scope["headers"]]:
            # one connection per request for this client (vLLM closes its end after an RPC that raised), so here too
            headers.append((b"connection", b"close"))
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        request = httpx.Request(
            scope["method"],
            self.base_url.copy_with(raw_path=target),
            headers=headers,
            content=body,
            extensions={"timeout": {"connect": CONNECT_TIMEOUT_S, "read": None, "write": None, "pool": None}},
        )
        try:
            response = await self.transport().handle_async_request(request)
        except httpx.TransportError as exc:
            await _answer(
                send, 502, f"the engine behind the guard ({self.upstream}) did not answer: {type(exc).__name__}: {exc}"
            )
            return
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k, v) for k, v in response.headers.raw if k.lower() not in _NOT_FORWARDED - {b"content-length"}
                    ],
                }
            )
            async for chunk in response.stream:  # as the engine writes it: no buffering here
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.stream.aclose()


async def _client_left(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _answer(send, status: int, message: str, headers: list[tuple[bytes, bytes]] = ()) -> None:
    """strop serve's error shape (OpenAI's: the openai SDK reads ``error.message``)."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "internal_error",
                "code": status,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


def bind(host: str, port: int) -> socket.socket:
    """The guard's listening socket on ``host:port`` (bound before the engine starts: a taken port fails at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted engine takes its port back at once
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"the engine guard cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(2048)
    return sock


def serve(sock: socket.socket, token: str, upstream: str, max_body_bytes: int = MAX_BODY_BYTES) -> None:
    """Serve the guard on ``sock`` until the process ends (blocking; run it in a thread: uvicorn installs no
    signal handlers there, so the supervisor's own stay in force)."""
    import uvicorn

    config = uvicorn.Config(
        TokenGuard(token, upstream, max_body_bytes),
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        lifespan="on",
        timeout_keep_alive=60,
    )
    uvicorn.Server(config).run(sockets=[sock])
    log.warning("strop: the engine guard stopped")
