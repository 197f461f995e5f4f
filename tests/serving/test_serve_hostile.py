"""`strop serve` against hostile input: a bad request gets a 4xx with a message and fails alone
(good requests in flight beside it are answered), the token policy, the weights folder, weight
loads off the event loop, process groups torn down, abort bookkeeping bounded."""

import asyncio
import contextlib
import threading
import time

import httpx
import pytest

from strop.serving.embedded import EmbeddedEngine
from strop.serving.server import create_app
from strop.types import SamplingParams

pytestmark = pytest.mark.timeout(120)

LONG = {"temperature": 1.0, "max_new_tokens": 120, "stop_token_ids": [-1]}  # a good request that takes a while


@contextlib.contextmanager
def serving(app):
    """``app`` under a real uvicorn server on 127.0.0.1 (a thread of this process); stopped on exit."""
    import uvicorn

    from strop.process import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def tiny_engine(model=None, **kw):
    from tests.tiny import make_tiny_model

    return EmbeddedEngine(model or make_tiny_model(), pad_token_id=2, default_stop_token_ids=[2], **kw)


def save_weights(folder, model=None, seed=7):
    """A whole state dict as ``folder/model.safetensors`` (what the router's WeightWriter writes)."""
    from tests.tiny import make_tiny_model

    from strop.sync.disk import WeightWriter

    path, checksum = WeightWriter(folder).write((model or make_tiny_model(seed=seed)).state_dict(), 1)
    return path, checksum


async def _in_flight_beside(url, bad: list[tuple[str, object]], good_n=4, headers=None):
    """Start ``good_n`` long /generate requests, then send each bad request while they run.
    Returns (good responses, bad responses); every request has a deadline (a hang fails)."""
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as client:
        good = [
            asyncio.ensure_future(client.post("/generate", json={"input_ids": [5 + i, 6, 7], "sampling_params": LONG}))
            for i in range(good_n)
        ]
        await asyncio.sleep(0.2)  # the good ones are decoding
        bad_out = []
        for path, body in bad:
            kw = (
                {"content": body, "headers": {"content-type": "application/json"}}
                if isinstance(body, bytes)
                else {"json": body}
            )
            bad_out.append(await asyncio.wait_for(client.post(path, **kw), 30))
        return await asyncio.wait_for(asyncio.gather(*good), 60), bad_out


def _assert_good(responses, n_tokens=LONG["max_new_tokens"]):
    for r in responses:
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == n_tokens


def _assert_4xx(responses, bad, words):
    for r, (path, body), word in zip(responses, bad, words):
        assert 400 <= r.status_code < 500, f"{path} {body!r:.80}: HTTP {r.status_code} {r.text[:200]}"
        message = r.json()["error"]["message"]
        assert word.lower() in message.lower(), f"{path} {body!r:.80}: {message!r} does not name {word!r}"


# ---- item 18: bad ids and seeds fail alone, the batch and the server go on ---------------------


def test_out_of_vocabulary_ids_and_huge_seeds_fail_alone_beside_good_requests():
    engine = tiny_engine()
    bad = [
        ("/generate", {"input_ids": [5, 49152, 7]}),  # the vocabulary is [0, 49152)
        ("/generate", {"input_ids": [5, -1, 7]}),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"sampling_seed": 2**64}}),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"sampling_seed": -(2**63) - 1}}),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"top_k": 2**70}}),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": 1e400}}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"temperature": NaN}}'),
        ("/generate", b'{"input_ids": [5, 6], "sampling_params": {"top_p": Infinity}}'),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 10**30}}),
        ("/generate", {"input_ids": [2**70]}),
        ("/v1/completions", {"prompt": [5, 99999], "max_tokens": 2}),
        ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "seed": 2**64}),
    ]
    words = [
        "vocabulary",
        "vocabulary",
        "sampling_seed",
        "sampling_seed",
        "top_k",
        "temperature",
        "temperature",
        "top_p",
        "max_new_tokens",
        "input_ids",
        "vocabulary",
        "seed",
    ]
    with serving(create_app(engine)) as url:
        good, answers = asyncio.run(_in_flight_beside(url, bad))
        _assert_good(good)
        _assert_4xx(answers, bad, words)
        top_k_beyond_vocab = httpx.post(
            url + "/generate",
            json={
                "input_ids": [5, 6],
                "sampling_params": {"top_k": 10**6, "max_new_tokens": 3, "stop_token_ids": [-1]},
            },
            timeout=30,
        )
        assert top_k_beyond_vocab.status_code == 200 and len(top_k_beyond_vocab.json()["output_ids"]) == 3


@pytest.mark.parametrize("fast_decode", [True, False])
def test_an_engine_error_fails_only_the_request_it_concerns(monkeypatch, fast_decode):
    """An error raised while one request is admitted (here: its prefill) fails that request alone:
    the requests batched with it finish, and the engine keeps serving."""
    from strop.serving import kvdecode

    engine = tiny_engine(fast_decode=fast_decode)
    poison = [9, 9, 9]
    if fast_decode:
        real = kvdecode.LlamaDecoder.prefill

        def prefill(self, ids, lengths):
            if any(row[-3:].tolist() == poison for row in ids):
                raise RuntimeError("poisoned prompt")
            return real(self, ids, lengths)

        monkeypatch.setattr(kvdecode.LlamaDecoder, "prefill", prefill)
    else:
        real = engine.model.forward

        def forward(input_ids=None, **kw):
            if any(row[-3:].tolist() == poison for row in input_ids):
                raise RuntimeError("poisoned prompt")
            return real(input_ids=input_ids, **kw)

        monkeypatch.setattr(engine.model, "forward", forward)
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=[-1])

    async def main():
        outs = await asyncio.gather(
            *(engine.generate(p, sp) for p in ([1, 2, 3], poison, [4, 5, 6])), return_exceptions=True
        )
        again = await engine.generate([7, 8], sp)
        return outs, again

    (a, bad, b), again = asyncio.run(asyncio.wait_for(main(), 60))
    assert isinstance(bad, RuntimeError) and "poisoned" in str(bad)
    assert len(a.token_ids) == len(b.token_ids) == len(again.token_ids) == 6


def test_a_seed_beyond_64_bits_never_hangs_the_engine():
    engine = tiny_engine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=[-1])

    async def main():
        return await asyncio.gather(
            engine.generate([1, 2], sp),
            engine.generate([3, 4], SamplingParams(seed=2**64, max_new_tokens=4)),
            return_exceptions=True,
        )

    good, bad = asyncio.run(asyncio.wait_for(main(), 30))
    assert isinstance(bad, ValueError) and "seed" in str(bad)
    assert len(good.token_ids) == 4


# ---- item 19: other 500s, the token, the weights folder ----------------------------------------


def test_bad_weight_loads_and_prompts_get_4xx_with_a_message(tmp_path, tokenizer):
    weights = tmp_path / "weights"
    good, _ = save_weights(weights)
    (weights / "junk").mkdir()
    (weights / "junk" / "model.safetensors").write_text("not a safetensors file")
    (weights / "notes.txt").write_text("hello")
    outside, _ = save_weights(tmp_path / "elsewhere")
    (weights / "link").symlink_to(outside)
    engine = tiny_engine()
    bad = [
        ("/update_weights_from_disk", {"model_path": str(weights / "junk")}),
        ("/update_weights_from_disk", {"model_path": str(weights / "notes.txt")}),
        ("/update_weights_from_disk", {"model_path": str(good), "weight_version": "default"}),
        ("/update_weights_from_disk", {"model_path": str(good), "weight_version": -3}),
        ("/update_weights_from_disk", {"model_path": str(outside)}),
        ("/update_weights_from_disk", {"model_path": str(weights / ".." / "elsewhere" / "v1")}),
        ("/update_weights_from_disk", {"model_path": str(weights / "link")}),
        ("/update_weights_from_disk", {"model_path": "/etc/passwd"}),
        ("/v1/completions", {"prompt": "", "max_tokens": 2}),
        ("/v1/completions", {"prompt": [], "max_tokens": 2}),
    ]
    words = [
        "safetensors",
        "safetensors",
        "weight_version",
        "weight_version",
        "weights folder",
        "weights folder",
        "weights folder",
        "weights folder",
        "empty",
        "empty",
    ]
    with serving(create_app(engine, tokenizer=tokenizer, weights_dir=str(weights))) as url:
        good_answers, answers = asyncio.run(_in_flight_beside(url, bad))
        _assert_good(good_answers)
        _assert_4xx(answers, bad, words)
        assert engine.weight_version == 0  # nothing was loaded
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(good), "weight_version": "5"})
        assert r.status_code == 200 and r.json()["weight_version"] == 5


def test_update_weights_from_disk_is_refused_without_a_weights_folder(tmp_path):
    good, _ = save_weights(tmp_path)
    with serving(create_app(tiny_engine())) as url:
        r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(good)})
    assert r.status_code == 403 and "--weights-dir" in r.json()["error"]["message"]


def test_a_non_ascii_token_is_refused_not_a_500():
    with serving(create_app(tiny_engine(), token="s3cret")) as url:
        for sent in ("Bearer sécret".encode(), "Bearer s3crét".encode("latin-1"), b"Bearer \xff\xfe"):
            r = httpx.post(url + "/flush_cache", headers={"Authorization": sent})
            assert r.status_code == 401 and "token" in r.json()["error"]["message"], r.text
        ok = httpx.post(url + "/flush_cache", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


# ---- item 12: the token policy ------------------------------------------------------------------

GENERATION = [
    ("POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}),
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("GET", "/health_generate", None),
    ("GET", "/get_weight_version", None),
    ("GET", "/v1/models", None),
]
WEIGHTS = [
    ("POST", "/abort_request", {"rid": "x"}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weights_from_disk", {"model_path": "/nowhere"}),
    ("POST", "/destroy_weights_update_group", {"group_name": "g"}),
    (
        "POST",
        "/init_weights_update_group",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2},
    ),
    ("POST", "/pause_generation", {"mode": "abort"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/begin_weight_update", {}),
    ("POST", "/end_weight_update", {}),
    (
        "POST",
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
    ),
    ("POST", "/update_weight_version", {"new_version": "3"}),
    ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere", "scaling": 1.0}),
    ("GET", "/weights_manifest", None),
    ("POST", "/weights_checker", {"action": "checksum"}),
    ("GET", "/weights_checker", None),
]


def _status(client, method, path, body, headers=None):
    return client.request(method, path, json=body, headers=headers).status_code


@pytest.mark.parametrize("public_generate", [False, True])
def test_with_a_token_every_route_needs_it(tokenizer, public_generate):
    """--token: every route, /health included, needs it; --public-generate opens generation and /health (and
    only those)."""
    from fastapi.testclient import TestClient

    app = create_app(tiny_engine(), tokenizer=tokenizer, token="s3cret", public_generate=public_generate)
    auth = {"Authorization": "Bearer s3cret"}
    with TestClient(app) as client:
        assert _status(client, "GET", "/health", None) == (200 if public_generate else 401)
        assert _status(client, "GET", "/health", None, auth) == 200
        for method, path, body in GENERATION:
            assert _status(client, method, path, body) == (200 if public_generate else 401), path
            assert _status(client, method, path, body, auth) == 200, path
        for method, path, body in WEIGHTS:
            assert _status(client, method, path, body) == 401, path
            assert _status(client, method, path, body, {"Authorization": "Bearer s3cre"}) == 401, path


def test_without_a_token_every_route_is_open_on_loopback(tokenizer):
    from fastapi.testclient import TestClient

    from strop.serving.server import serve

    with TestClient(create_app(tiny_engine(), tokenizer=tokenizer)) as client:
        for method, path, body in GENERATION + WEIGHTS[:2]:
            assert _status(client, method, path, body) == 200, path
    with pytest.raises(ValueError, match="pass --token"):
        serve("unused", host="0.0.0.0", token=None)
    with pytest.raises(ValueError, match="--public-generate needs --token"):
        serve("unused", public_generate=True)


def test_the_serve_command_passes_its_flags(monkeypatch, tmp_path):
    import strop.serving.server as server
    from strop.cli import serve_main

    seen = {}
    monkeypatch.setattr(server, "serve", lambda *a, **kw: seen.update(kw))
    assert serve_main(["--token=t", "--public-generate", f"--weights-dir={tmp_path}"]) == 0
    assert seen["token"] == "t" and seen["public_generate"] is True and seen["weights_dir"] == str(tmp_path)


# ---- item 15: weight loads and checksums off the event loop ------------------------------------


def test_a_weight_load_leaves_the_event_loop_free(monkeypatch, tmp_path):
    """Loading and checksumming run in a thread: while each is held, /health answers. Each held step
    waits for that answer (up to 30 s); a step run on the event loop would block the answer, so its
    wait would time out and the test names it. No timing threshold: a slow machine cannot fail it."""
    import strop.serving.routes_weights as server

    path, _ = save_weights(tmp_path)
    held, answered, released = threading.Event(), threading.Event(), {}

    def holding(name, real):
        def step(*args, **kw):
            answered.clear()
            held.set()  # (the client takes it, asks /health, and then sets answered)
            released[name] = answered.wait(30)
            return real(*args, **kw)

        return step

    monkeypatch.setattr(server, "load_weights_dir", holding("load", server.load_weights_dir))
    monkeypatch.setattr(server, "state_checksum", holding("checksum", server.state_checksum))
    with serving(create_app(tiny_engine(), weights_dir=str(tmp_path))) as url:

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                load = asyncio.ensure_future(client.post("/update_weights_from_disk", json={"model_path": str(path)}))
                while not load.done():
                    if await asyncio.to_thread(held.wait, 0.05):
                        held.clear()
                        assert (await client.get("/health")).status_code == 200
                        answered.set()
                return await load

        r = asyncio.run(main())
    assert r.status_code == 200, r.text
    assert released == {"load": True, "checksum": True}, f"/health did not answer while these held: {released}"


# ---- item 14: old process groups are torn down ---------------------------------------------------


class _FakeGroup:
    def __init__(self, *args):
        self.args, self.shut = args, False

    def shutdown(self):
        self.shut = True


def test_a_new_group_tears_down_the_old_one_and_destroy_removes_it(monkeypatch, tmp_path):
    from fastapi.testclient import TestClient

    import strop.wire.group as sync

    made = []
    monkeypatch.setattr(sync, "make_group", lambda *a, **kw: made.append(_FakeGroup(*a, kw)) or made[-1])
    monkeypatch.setattr(sync, "close_group", lambda group: group.shutdown())
    body = {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]]}
    with TestClient(create_app(tiny_engine())) as client:
        assert client.post("/init_weights_update_group", json={**body, "group_name": "g1"}).status_code == 200
        assert client.post("/init_weights_update_group", json={**body, "group_name": "g2"}).status_code == 200
        assert [g.shut for g in made] == [True, False]  # a reconnect: the old group is gone
        assert made[1].args[-1] == {"name": "g2"}  # the group is built under the name the trainer gave
        assert client.post("/begin_weight_update", json={}).status_code == 200
        r = client.post("/update_weights_from_distributed", json={**update, "group_name": "g1"})
        assert r.status_code == 400 and "g1" in r.json()["error"]["message"]
        r = client.post("/destroy_weights_update_group", json={"group_name": "g2"})
        assert r.status_code == 200 and r.json()["success"] and made[1].shut
        r = client.post("/destroy_weights_update_group", json={"group_name": "g2"})  # idempotent
        assert r.status_code == 200 and r.json()["success"]
        r = client.post("/update_weights_from_distributed", json={**update, "group_name": "g2"})
        assert r.status_code == 400 and "g2" in r.json()["error"]["message"]
        assert client.post("/end_weight_update", json={}).status_code == 200


_RANK_0 = """
import sys
from strop.wire.group import make_group
group = make_group("127.0.0.1", int(sys.argv[1]), 0, 2, "gloo", 30, name=sys.argv[2])
print("joined", flush=True)
sys.stdin.read()  # held until the test closes stdin
"""


@pytest.mark.timeout(60)
def test_a_real_gloo_group_is_shut_down_by_destroy():
    """The server side of a real gloo group: destroy shuts it down (its sockets closed) without
    hanging. The trainer's rank 0 runs in a process of its own: torch registers a group's name
    once per process, as it is across a real trainer and server."""
    import subprocess
    import sys

    from fastapi.testclient import TestClient

    from strop.process import free_port

    port = free_port()
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", _RANK_0, str(port), "g"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with TestClient(create_app(tiny_engine())) as client:
            r = client.post(
                "/init_weights_update_group",
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": "g",
                },
            )
            assert r.status_code == 200, r.text
            assert rank_0.stdout.readline().strip() == "joined"
            joined = _open_files()
            r = client.post("/destroy_weights_update_group", json={"group_name": "g"})
            assert r.status_code == 200 and r.json()["success"], r.text
            deadline = time.monotonic() + 5  # gloo closes its sockets from its own I/O thread
            while _open_files() >= joined and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _open_files() < joined  # the server's side closed its connections
    finally:
        rank_0.stdin.close()
        rank_0.wait(30)


def _open_files() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


# ---- item 16: abort bookkeeping stays bounded -----------------------------------------------------


def test_aborted_ids_of_requests_no_longer_queued_or_running_are_dropped(monkeypatch):
    import strop.serving.embedded as embedded

    engine = tiny_engine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=[-1])
    now = [1000.0]
    monkeypatch.setattr(embedded.time, "monotonic", lambda: now[0])

    async def main():
        await engine.generate([1, 2], sp, request_id="done")
        await engine.abort("done")  # finished: nothing to end
        for i in range(20_000):  # never seen (perhaps not arrived yet): remembered for a while, within a cap
            await engine.abort(f"ghost-{i}")
        capped = len(engine._aborted_ids)
        now[0] += embedded.EARLY_ABORT_S + 1
        early = await engine.generate([1, 2], sp, request_id="late")  # arrives after its abort: ends at once
        await engine.abort("late")
        await engine.abort("another")
        return capped, early

    capped, early = asyncio.run(main())
    assert capped <= embedded.EARLY_ABORT_MAX
    assert early.finish_reason == "length"  # the abort of "late" was forgotten before it arrived
    assert set(engine._aborted_ids) <= {"late", "another"}
    now[0] += embedded.EARLY_ABORT_S + 1
    asyncio.run(engine.abort("x"))
    assert set(engine._aborted_ids) == {"x"}


def test_a_request_aborted_before_it_arrives_ends_as_an_abort_and_is_forgotten():
    engine = tiny_engine()

    async def main():
        await engine.abort("early")
        out = await engine.generate([1, 2], SamplingParams(max_new_tokens=50, stop_token_ids=[-1]), request_id="early")
        return out

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and len(out.token_ids) <= 1 and "early" not in engine._aborted_ids


# ---- acceptance: a mixed load over every route -----------------------------------------------------


def test_a_mixed_load_over_every_route_answers_the_good_and_refuses_the_bad(tmp_path, tokenizer):
    """Good requests for every route in flight while bad ones arrive (wrong types, out-of-range
    and huge values, garbage or non-UTF-8 JSON, missing fields, a wrong token, paths outside the
    weights folder): every good one answered, every bad one a 4xx with a message, none a 500."""
    weights = tmp_path / "weights"
    good_path, _ = save_weights(weights)
    (weights / "junk.safetensors").write_bytes(b"\x00" * 64)
    auth = {"Authorization": "Bearer s3cret"}
    engine = tiny_engine(max_batch_size=8)
    gen = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    bad = [  # (method, path, JSON body or raw bytes, headers)
        ("POST", "/generate", {"input_ids": "five"}, auth),
        ("POST", "/generate", {}, auth),
        ("POST", "/generate", b'{"input_ids": [1,', auth),
        ("POST", "/generate", b'\xff\xfe{"input_ids": [1]}', auth),
        ("POST", "/generate", b"[1, 2]", auth),
        ("POST", "/generate", b"null", auth),
        ("POST", "/generate", b"", auth),
        ("POST", "/generate", {"input_ids": [5, -7]}, auth),
        ("POST", "/generate", {"input_ids": [10**40]}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"max_new_tokens": -1}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"max_new_tokens": 10**12}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"top_k": -5}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"temperature": -1}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"top_p": 0}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"stop_token_ids": "2"}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"stop": [""]}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": {"n": 10**6}}, auth),
        ("POST", "/generate", {**gen, "sampling_params": [{}, {}]}, auth),
        ("POST", "/generate", {**gen, "stream": True}, auth),
        ("POST", "/generate", gen, {"Authorization": "Bearer wrong"}),
        ("POST", "/generate", gen, {}),
        ("GET", "/generate", None, auth),
        ("POST", "/v1/completions", {"max_tokens": 2}, auth),
        ("POST", "/v1/completions", {"prompt": {"a": 1}, "max_tokens": 2}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "max_tokens": 0}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "n": 10**6}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "temperature": "hot"}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "seed": -1}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "logprobs": 21}, auth),
        ("POST", "/v1/completions", {"prompt": [5], "suffix": "x"}, auth),
        (
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            auth,
        ),
        ("POST", "/v1/chat/completions", {"messages": []}, auth),
        ("POST", "/v1/chat/completions", {"messages": "hi"}, auth),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, auth),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, auth),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(weights / ".." / ".." / "etc")}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": "../../../../etc/passwd"}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(weights / "junk.safetensors")}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(good_path), "weight_version": "x"}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(good_path), "digests": ["a"]}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(good_path), "digests": {"x": "0"}}, auth),
        ("POST", "/update_weights_from_disk", {}, auth),
        ("POST", "/update_weights_from_disk", {"model_path": str(good_path)}, {}),
        ("POST", "/abort_request", {"rid": 5}, auth),
        ("POST", "/abort_request", {"rid": "x", "what": 1}, auth),
        ("POST", "/abort_request", {"rid": "x"}, {"Authorization": "Bearer s3crét".encode()}),
        ("POST", "/flush_cache", None, {"Authorization": "Basic s3cret"}),
        ("POST", "/init_weights_update_group", {**group, "world_size": 1}, auth),
        ("POST", "/init_weights_update_group", {**group, "rank_offset": 5}, auth),
        ("POST", "/init_weights_update_group", {**group, "master_port": 70000}, auth),
        ("POST", "/init_weights_update_group", {**group, "backend": "mpi"}, auth),
        ("POST", "/init_weights_update_group", {"master_port": 1}, auth),
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1]]},
            auth,
        ),
        ("POST", "/update_weights_from_distributed", {"names": [], "dtypes": [], "shapes": []}, auth),
        ("POST", "/destroy_weights_update_group", {"group_name": ""}, auth),
        ("POST", "/destroy_weights_update_group", {"group_name": 5}, auth),
        ("POST", "/pause_generation", {"mode": "later"}, auth),
        ("POST", "/end_weight_update", {}, auth),
        ("POST", "/begin_weight_update", {"selector": "draft"}, auth),
        ("POST", "/update_weight_version", {"new_version": "v2"}, auth),
        ("POST", "/weights_checker", {"action": "snapshot"}, auth),
        ("GET", "/weights_manifest", None, {}),
        ("GET", "/get_weight_version", None, {}),
        ("GET", "/health_generate", None, {}),
        ("GET", "/v1/models", None, {}),
        ("GET", "/no/such/route", None, auth),
    ]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    good = (
        [  # (method, path, body, check of the JSON answer)
            (
                "POST",
                "/generate",
                {"input_ids": [5 + i, 6], "sampling_params": LONG},
                lambda out: len(out["output_ids"]) == LONG["max_new_tokens"],
            )
            for i in range(3)
        ]
        + [
            (
                "POST",
                "/generate",
                {"text": "Hello", "sampling_params": {"max_new_tokens": 40, "stop_token_ids": [-1]}},
                lambda out: len(out["output_ids"]) == 40,
            ),
            (
                "POST",
                "/v1/completions",
                {"prompt": "Hi", "max_tokens": 30, "n": 2},
                lambda out: [len(c["token_ids"]) for c in out["choices"]] == [30, 30],
            ),
            ("POST", "/v1/chat/completions", {**chat, "logprobs": True}, lambda out: out["choices"][0]["logprobs"]),
            (
                "POST",
                "/v1/completions",
                {"prompt": "Hi there", "max_tokens": 0, "echo": True, "logprobs": 3},
                lambda out: (
                    out["choices"][0]["logprobs"]["token_logprobs"][0] is None
                    and all(len(top) in (3, 4) for top in out["choices"][0]["logprobs"]["top_logprobs"][1:])
                ),
            ),  # (+ the token)
            (
                "POST",
                "/v1/chat/completions",
                {**chat, "logprobs": True, "top_logprobs": 2},
                lambda out: all(len(t["top_logprobs"]) == 2 for t in out["choices"][0]["logprobs"]["content"]),
            ),
            (
                "POST",
                "/update_weights_from_disk",
                {"model_path": str(good_path), "weight_version": 1},
                lambda out: out["weight_version"] == 1,
            ),
            ("GET", "/get_weight_version", None, lambda out: "weight_version" in out),
            ("GET", "/health_generate", None, lambda out: out["tokens"] == 1),
            ("GET", "/v1/models", None, lambda out: out["data"]),
            ("POST", "/abort_request", {"rid": "nobody"}, lambda out: out["success"]),
            ("POST", "/flush_cache", None, lambda out: out["success"]),
            ("POST", "/destroy_weights_update_group", {"group_name": "none"}, lambda out: out["success"]),
            ("GET", "/weights_manifest", None, lambda out: len(out["names"]) == len(out["shapes"]) > 0),
            ("POST", "/weights_checker", {"action": "checksum"}, lambda out: len(out["checksum"]) == 32),
        ]
    )

    async def send(client, method, path, body, headers):
        kw = (
            {"content": body, "headers": {**headers, "content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body, "headers": headers}
        )
        return await asyncio.wait_for(client.request(method, path, **kw), 60)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            goods = [asyncio.ensure_future(send(client, m, p, b, auth)) for m, p, b, _ in good]
            await asyncio.sleep(0.1)
            bads = await asyncio.gather(*(send(client, *case) for case in bad))
            return await asyncio.gather(*goods), bads

    app = create_app(engine, tokenizer=tokenizer, token="s3cret", weights_dir=str(weights))
    with serving(app) as url:
        goods, bads = asyncio.run(main(url))
        after = httpx.post(url + "/generate", json=gen, headers=auth, timeout=30)
    for (method, path, body, check), r in zip(good, goods):
        assert r.status_code == 200 and check(r.json()), f"good {method} {path} {body!r:.80}: {r.text[:300]}"
    for (method, path, body, _), r in zip(bad, bads):
        assert 400 <= r.status_code < 500, f"bad {method} {path} {body!r:.80}: HTTP {r.status_code} {r.text[:300]}"
        assert r.json()["error"]["message"], f"bad {method} {path}: no message"
    assert after.status_code == 200 and engine.weight_version == 1


def test_a_top_p_that_rounds_to_zero_samples_the_most_likely_token():
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams
    from tests.tiny import make_tiny_model

    engine = EmbeddedEngine(make_tiny_model(seed=1), pad_token_id=0)
    tiny = engine.generate_batch(
        [[5, 6, 7]], SamplingParams(temperature=1.0, top_p=1e-50, max_new_tokens=3, stop_token_ids=[-1])
    )[0]
    greedy = engine.generate_batch([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=3, stop_token_ids=[-1]))[
        0
    ]
    assert tiny.token_ids == greedy.token_ids  # only the top token survives the nucleus


def test_a_load_format_strop_serve_cannot_read_is_refused_not_ignored(tmp_path):
    from fastapi.testclient import TestClient

    with TestClient(create_app(tiny_engine(), weights_dir=str(tmp_path))) as client:
        r = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path), "load_format": "gguf"})
    assert r.status_code == 422 and "load_format" in r.text


def test_a_body_over_the_limit_gets_413_on_every_route_and_a_long_rid_is_refused():
    """Every route reads at most ``max_body_bytes`` of a body (sized or chunked), answering 413 with
    a short message that repeats none of it; a request id is echoed back, so a long one is refused."""
    engine = tiny_engine()
    with serving(create_app(engine)) as url:  # the default limit, and a 5 MB rid under it
        r = httpx.post(
            url + "/generate",
            json={"input_ids": [5, 6], "rid": "r" * (5 << 20), "sampling_params": {"max_new_tokens": 2}},
            timeout=30,
        )
        assert r.status_code == 422 and "rid" in r.json()["error"]["message"] and len(r.content) < 500
        r = httpx.post(url + "/abort_request", json={"rid": "r" * 513}, timeout=30)
        assert r.status_code == 422 and "rid" in r.json()["error"]["message"]
        from strop.serving.openai import MAX_BODY_BYTES

        over = b'{"input_ids": [5, 6], "rid": "' + b"z" * MAX_BODY_BYTES + b'"}'
        r = httpx.post(url + "/generate", content=over, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 413 and b"zzz" not in r.content
    with serving(create_app(engine, max_body_bytes=1 << 20)) as url:
        huge = b'{"input_ids": [5, 6], "rid": "' + b"x" * (2 << 20) + b'"}'
        for path in ("/generate", "/v1/completions", "/abort_request", "/update_weights_from_disk"):
            r = httpx.post(url + path, content=huge, headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 413 and "body" in r.json()["error"]["message"], (path, r.text[:200])
            assert len(r.content) < 200 and b"xxx" not in r.content

        def chunks():  # no Content-Length: read until the limit, then refused
            yield b'{"input_ids": [5, 6], "rid": "'
            for _ in range(32):
                yield b"y" * (64 << 10)
            yield b'"}'

        r = httpx.post(url + "/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 413 and b"yyy" not in r.content
        r = httpx.post(
            url + "/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}, timeout=30
        )
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 2  # and it keeps serving


def test_a_stream_whose_client_goes_away_is_aborted_in_the_engine():
    """A streamed request ends in the engine (finish 'abort', fewer tokens than asked) once its client
    has gone, instead of decoding to the end for nobody."""
    engine = tiny_engine()
    ended = []
    generate, advance = engine.generate, engine._advance

    async def recorded(*args, **kw):
        ended.append(await generate(*args, **kw))
        return ended[-1]

    def slowed(*args):  # ~10 ms a step: the 200-token answer is still decoding when the client leaves
        time.sleep(0.01)
        return advance(*args)

    engine.generate, engine._advance = recorded, slowed
    with serving(create_app(engine)) as url:
        with httpx.stream(
            "POST", url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 200, "stream": True}, timeout=30
        ) as r:
            assert r.status_code == 200
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
        deadline = time.monotonic() + 20
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    assert ended and ended[0].finish_reason == "abort" and len(ended[0].token_ids) < 200, ended
