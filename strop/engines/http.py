"""The HTTP side every engine client shares: one pooled async connection per engine, a timeout per request,
retries with exponential backoff on connection failures and 5xx answers.

An error that retries do not cure raises :class:`EngineUnavailable` (the router then re-issues the
request elsewhere); a 4xx answer is the request's fault and raises :class:`EngineRefusedError` at once.
The clients: :class:`strop.engines.sglang.SGLangEngine` (SGLang and ``strop serve``) and
:class:`strop.engines.vllm.VLLMEngine`.
"""

from __future__ import annotations

import asyncio

from strop.wire.errors import EngineRefusedError, EngineRequestError, EngineUnavailable


class HTTPEngine:
    """A server at ``url``: its pooled connection and the one way a request goes out (:meth:`_call`)."""

    def __init__(
        self, url: str, *, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.25, token: str | None = None
    ):
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = None

    def _http(self):
        import httpx

        if self._client is None:  # created in the running event loop, kept for the run's life
            self._client = httpx.AsyncClient(
                headers=self.headers,
                timeout=self.timeout_s,
                limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
            )
        return self._client

    async def _call(self, method: str, path: str, *, json=None, timeout: float | None = None, retries=None) -> dict:
        import httpx

        retries = self.retries if retries is None else retries
        last = None
        for attempt in range(retries + 1):
            try:
                r = await self._http().request(
                    method, self.url + path, json=json, timeout=timeout if timeout is not None else self.timeout_s
                )
            except (httpx.TransportError, OSError) as exc:  # refused, reset, timed out
                last = f"{type(exc).__name__}: {exc}"
            else:
                if r.status_code < 400:
                    if not r.content.strip():  # SGLang's /health and /abort_request answer 200 with no body
                        return {}
                    try:
                        return r.json()
                    except ValueError:
                        raise EngineRequestError(
                            f"{self.url}{path}: HTTP {r.status_code} with a body that is not JSON: {r.text[:200]!r}"
                        ) from None
                if r.status_code < 500:
                    raise EngineRefusedError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            if attempt < retries:
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise EngineUnavailable(f"{self.url}{path} failed after {retries + 1} attempts: {last}")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class EngineUnreachable(ValueError):
    """A server the user named (engine.urls) answers nothing at all: refused at start, before any model loads."""


def check_reachable(urls: list[str], deadline_s: float = 3.0, interval_s: float = 0.25) -> None:
    """Raise :class:`EngineUnreachable` naming the first of ``urls`` that gives no HTTP answer at all (connection
    refused, no such host, timeout) within ``deadline_s``. Any HTTP answer counts, an error status included: a
    server that is up but starting, or wants a token, is the router's to handle."""
    import time

    import httpx

    for url in urls:
        end, last = time.monotonic() + deadline_s, None
        while True:
            try:
                httpx.get(url.rstrip("/") + "/health", timeout=min(2.0, deadline_s))
                break
            except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
                raise EngineUnreachable(f"engine.urls: {url!r} is not an http(s) URL ({exc})") from None
            except (httpx.TransportError, OSError) as exc:  # refused, no such host, timed out
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() + interval_s > end:
                raise EngineUnreachable(
                    f"engine.urls: no server answers at {url} ({last}; tried for {deadline_s:.0f}s); start it "
                    "first (e.g. strop serve --port N), or let the run start its own with engine.launch=N"
                )
            time.sleep(interval_s)
