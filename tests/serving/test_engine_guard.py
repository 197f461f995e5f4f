"""strop's token guard (strop.serving.guard) in front of a stand-in engine (tests/serving/guard_upstream.py),
started as strop starts a guarded vLLM or SGLang server: a LocalServer with ``upstream``, whose supervisor runs
the guard. The real engine behind it: tests/serving/test_vllm_guard.py."""

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest

from strop.process import free_port
from strop.serving.guard import TokenGuard
from strop.engines.launch import LocalServer

TOKEN = "guard-token-5be1"
UPSTREAM = Path(__file__).with_name("guard_upstream.py")
AUTH = {"Authorization": f"Bearer {TOKEN}"}
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
PATHS = (
    "/",
    "/health",
    "/collective_rpc",
    "/pause",
    "/v1/models",
    "/v1/completions",
    "/metrics",
    "/_log",
    "//v1/models",
    "/V1/models",
    "/v1%2Fmodels",
    "/a/../collective_rpc",
    "/reset_prefix_cache?x=1",
)
WRONG = (
    {},
    {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer x"},
    {"Authorization": f"Bearer {TOKEN}x"},
    {"Authorization": f"Bearer {TOKEN[:-1]}"},
    {"Authorization": "Bearer"},
    {"X-Api-Key": TOKEN},
    {"Authorization": f"Bearer  {TOKEN[1:]}"},
)


@pytest.fixture(params=["unix", "tcp"])
def guarded(request, tmp_path):
    """The stand-in engine on a Unix socket (as vLLM is) or on 127.0.0.1 (as SGLang is), the guard on
    127.0.0.1; ``go()`` lets the engine start. Stopped after the test."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    upstream = f"unix:{private / 'engine.sock'}" if request.param == "unix" else f"127.0.0.1:{free_port()}"
    go = tmp_path / "go"
    server = LocalServer(
        "",
        free_port(),
        env={"GO_FILE": str(go)},
        command=[sys.executable, str(UPSTREAM), upstream],
        upstream=upstream,
        token=TOKEN,
        private_dir=private,
    ).start()
    server.go = lambda: go.touch() or server.wait_healthy(60)
    yield server
    server.stop()
    assert not private.exists()  # the private folder goes with the server


def received(server) -> list[dict]:
    return httpx.get(server.url + "/_log", headers=AUTH, timeout=10).json()


@pytest.mark.timeout(120)
def test_no_request_without_the_token_reaches_the_engine(guarded):
    """Every method on every path (the engine's own spellings of a path too) with no token, a wrong one or the
    wrong scheme: 401 with a message naming the path, and the engine never sees the request."""
    guarded.go()
    before = received(guarded)
    with httpx.Client(base_url=guarded.url, timeout=10) as client:
        for i, (method, path) in enumerate((m, p) for m in METHODS for p in PATHS):
            headers = WRONG[i % len(WRONG)]  # (each wrong header on about ten method-path pairs)
            r = client.request(method, path, headers=headers, content=b'{"method": "strop_info"}')
            assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            if method != "HEAD":
                assert r.json()["error"]["message"].endswith(
                    "needs the engine's token: 'Authorization: Bearer <token>'"
                ), r.text
    assert received(guarded) == before


@pytest.mark.timeout(120)
def test_a_request_with_the_token_passes_as_sent(guarded):
    """Method, raw path, query, headers (the token included, hop-by-hop ones not) and body reach the engine;
    its status, headers and body come back."""
    guarded.go()
    body = json.dumps({"prompt": [1, 2, 3], "text": "é\u2028"}).encode()
    for scheme in ("Bearer", "bearer"):
        r = httpx.patch(
            guarded.url + "/v1%2Fx/y?a=1&b=%20",
            content=body,
            timeout=10,
            headers={"Authorization": f"{scheme} {TOKEN}", "X-Custom": "kept", "Keep-Alive": "timeout=5"},
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert (got["method"], got["path"], got["query"], got["body"].encode()) == (
            "PATCH",
            "/v1%2Fx/y",
            "a=1&b=%20",
            body,
        )
        headers = dict(got["headers"])
        assert headers["authorization"] == f"{scheme} {TOKEN}" and headers["x-custom"] == "kept"
        assert "keep-alive" not in headers and headers["content-length"] == str(len(body))
    r = httpx.post(guarded.url + "/status/418", headers=AUTH, timeout=10)
    assert (r.status_code, r.headers["x-upstream"], r.json()) == (418, "yes", {"status": True})


@pytest.mark.timeout(120)
def test_a_stream_passes_through_as_the_engine_writes_it(guarded):
    """The first event reaches the client while the engine still holds the second: nothing is buffered."""
    guarded.go()
    with httpx.Client(timeout=httpx.Timeout(10, read=5)) as client:
        with client.stream("GET", guarded.url + "/stream", headers=AUTH) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            chunks = r.iter_raw()
            assert next(chunks) == b"data: 1\n\n"  # (a buffering guard waits here for the whole answer: timeout)
            assert httpx.post(guarded.url + "/_release", headers=AUTH, timeout=10).status_code == 200
            assert b"".join(chunks) == b"data: 2\n\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["/hold", "/hold_stream"])
def test_a_client_that_leaves_closes_the_engine_connection(guarded, path):
    """The engine sees the connection close within a second of the client leaving, before its answer started
    and in the middle of a stream: vLLM aborts such a request, which strop's abort relies on."""
    guarded.go()
    with pytest.raises(httpx.ReadTimeout):
        with httpx.Client(timeout=httpx.Timeout(10, read=1)) as client:
            with client.stream("POST", guarded.url + path, headers=AUTH, content=b"{}") as r:
                r.read()
    left = time.monotonic()
    while {"event": f"{path[1:]}: gone"} not in received(guarded):
        assert time.monotonic() - left < 5, f"the engine never saw the client of {path} leave"
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_an_engine_that_is_not_there_or_breaks_off(guarded):
    """Before the engine listens: 502 naming it (and the health check waits on); an answer the engine breaks
    off reaches the client broken off, never as a whole one."""
    deadline = time.monotonic() + 30
    while True:  # until the guard listens (the engine waits for go())
        try:
            r = httpx.get(guarded.url + "/health", headers=AUTH, timeout=10)
            break
        except httpx.ConnectError:
            assert time.monotonic() < deadline, "the guard never listened"
            time.sleep(0.05)
    assert r.status_code == 502 and "did not answer" in r.json()["error"]["message"], r.text
    assert guarded.upstream in r.json()["error"]["message"]
    assert httpx.get(guarded.url + "/health", timeout=10).status_code == 401  # the token first, even then
    guarded.go()
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(guarded.url + "/drop", headers=AUTH, timeout=10)
    assert httpx.get(guarded.url + "/health", headers=AUTH, timeout=10).status_code == 200  # serving on


@pytest.mark.timeout(60)
def test_the_guard_ends_with_the_engine(guarded):
    guarded.go()
    assert httpx.get(guarded.url + "/health", headers=AUTH, timeout=10).status_code == 200
    engine = [
        p
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _ppid(p) == guarded.proc.pid and str(UPSTREAM).encode() in (p / "cmdline").read_bytes()
    ]
    assert len(engine) == 1
    import os
    import signal

    os.kill(int(engine[0].name), signal.SIGKILL)
    guarded.proc.wait(timeout=20)
    with pytest.raises(httpx.ConnectError):
        httpx.get(guarded.url + "/health", headers=AUTH, timeout=5)


def _ppid(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError):
        return -1


def _call(guard: TokenGuard, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> list[dict]:
    """What ``guard`` sends back for one request whose body arrives in ``chunks``."""
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent = []

    async def receive():
        if not messages:  # the client stays
            await asyncio.Event().wait()
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "headers": headers,
    }
    asyncio.run(guard(scope, receive, send))
    return sent


def test_a_body_over_the_limit_is_refused_before_it_reaches_the_engine():
    """413 for a body over ``max_body_bytes``, declared or sent in chunks; the engine (an address where nothing
    listens: a forwarded request would get 502) is never asked."""
    guard = TokenGuard(TOKEN, f"127.0.0.1:{free_port()}", max_body_bytes=10)
    auth = [(b"authorization", f"Bearer {TOKEN}".encode())]
    for chunks, headers in (([b"x" * 11], auth + [(b"content-length", b"11")]), ([b"x" * 6, b"x" * 5], auth)):
        sent = _call(guard, chunks, headers)
        assert sent[0]["status"] == 413 and b"over the engine guard's limit of 10 bytes" in sent[1]["body"]
    assert _call(guard, [b"x" * 6, b"x" * 4], auth)[0]["status"] == 502  # at the limit: forwarded
    assert _call(guard, [b"x" * 11], [])[0]["status"] == 401  # the token is checked first


def test_a_guard_needs_a_token():
    for token in ("", None):
        with pytest.raises(ValueError, match="the token guard needs a token"):
            TokenGuard(token, "127.0.0.1:1")
    with pytest.raises(ValueError, match=r"a guarded server \(upstream='unix:/x'\) needs a token"):
        LocalServer("", 1, command=["true"], upstream="unix:/x").start()


def test_a_websocket_is_closed_before_it_is_accepted_token_or_not():
    """strop uses no WebSocket: an upgrade is closed (policy violation) whatever it carries, and the engine
    is never asked."""
    guard = TokenGuard(TOKEN, "127.0.0.1:9")  # (nothing listens there: a forwarded request would fail)

    async def upgrade(headers):
        sent = []

        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            sent.append(message)

        await guard(
            {"type": "websocket", "path": "/v1/realtime", "headers": headers, "query_string": b""}, receive, send
        )
        return sent

    for headers in ([], [(b"authorization", f"Bearer {TOKEN}".encode())]):
        assert asyncio.run(upgrade(headers)) == [{"type": "websocket.close", "code": 1008}]


def test_a_vllm_socket_path_longer_than_a_unix_socket_takes_is_refused(tmp_path, monkeypatch):
    """vLLM's socket lives in a private folder under the temporary directory: a path over the 107 bytes
    a Unix socket address holds is refused naming it (and TMPDIR), and the folder made for it is removed."""
    import tempfile

    from strop.engines.launch import engine_server

    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with pytest.raises(ValueError, match=r"over the 107 bytes a Unix socket takes: set TMPDIR"):
        engine_server("vllm", ["vllm"], "MODEL", "127.0.0.1", 1, TOKEN)
    assert list(deep.iterdir()) == []
    monkeypatch.setattr(tempfile, "tempdir", None)
    server = engine_server("vllm", ["vllm"], "MODEL", "127.0.0.1", 1, TOKEN)  # a short one is taken (not started)
    try:
        assert server.upstream.startswith("unix:") and server.private_dir.stat().st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(server.private_dir)
