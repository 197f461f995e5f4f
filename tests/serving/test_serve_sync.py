"""`strop serve` answers SGLang 0.5.23's weight-update routes: pause / continue (abort, retract,
in_place), the begin/end session, one update_weights_from_distributed per bucket (flattened and
lone buckets), the manifest and the checksum receipt. In the broadcast tests this process is the
trainer's rank 0 and a real server process is rank 1 (torch registers a group's name once per
process, so the two sides cannot share one)."""

import asyncio
import time
import uuid

import httpx
import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.wire.digest import state_checksum
from strop.serving.server import create_app
from strop.wire.group import close_group, make_group, send_bucket
from strop.wire.buckets import manifest_of, plan_buckets
from strop.process import free_port
from tests.tiny import make_tiny_model

SMALL_BUCKET = 16 << 10  # the tiny model's embedding (6 MiB) travels alone, the other tensors flattened
LONG = {"temperature": 0.0, "max_new_tokens": 200, "stop_token_ids": [-1]}  # greedy, runs a while


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One `strop serve` process on the tiny model for this module's broadcast tests."""
    from strop.engines.launch import LocalServer

    args = ["--threads=1", f"--weights-dir={tmp_path_factory.mktemp('weights')}"]
    srv = LocalServer(str(tiny_model_dir), free_port(), args).start()
    try:
        yield srv.wait_healthy(120)
    finally:
        srv.stop()


def unique(state: dict) -> dict:
    """The tensors a trainer sends: the state dict without aliases (the tied lm_head)."""
    return {name: state[name] for name, _, _ in manifest_of(state)}


class Trainer:
    """Rank 0 of a weight-update group with one server (rank 1), driving it as SGLangEngine does."""

    def __init__(self, client: httpx.AsyncClient):
        self.client, self.name, self.group = client, f"strop-sync-test-{uuid.uuid4().hex[:8]}", None

    async def post(self, path: str, body=None) -> httpx.Response:
        return await self.client.post(path, json=body if body is not None else {})

    async def join(self) -> None:
        port = free_port()
        own = asyncio.to_thread(make_group, "127.0.0.1", port, 0, 2, "gloo", 30, name=self.name)
        self.group, r = await asyncio.gather(
            own,
            self.post(
                "/init_weights_update_group",
                {
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": self.name,
                    "backend": "gloo",
                },
            ),
        )
        assert r.status_code == 200, r.text

    async def send(self, bucket, named: dict, version=None, last=False) -> httpx.Response:
        """One bucket: the broadcast and the server's update call at once."""
        _, r = await asyncio.gather(
            asyncio.to_thread(send_bucket, self.group, bucket, named, "cpu"),
            self.post(
                "/update_weights_from_distributed",
                {**bucket.payload(), "group_name": self.name, "flush_cache": last, "weight_version": version},
            ),
        )
        return r

    async def update(self, named: dict, version: int, mode: str = "retract") -> list[httpx.Response]:
        """pause, begin, every bucket (the version on the last), end, continue."""
        plan = plan_buckets(manifest_of(named), SMALL_BUCKET)
        assert {b.flattened for b in plan} == {True, False}  # both forms travel
        assert (await self.post("/pause_generation", {"mode": mode})).json()["status"] == "ok"
        try:
            assert (await self.post("/begin_weight_update")).status_code == 200
            out = [
                await self.send(b, named, str(version) if i == len(plan) - 1 else None, i == len(plan) - 1)
                for i, b in enumerate(plan)
            ]
            assert (await self.post("/end_weight_update")).status_code == 200
        finally:
            await self.post("/continue_generation")
        return out

    async def leave(self) -> None:
        await self.post("/destroy_weights_update_group", {"group_name": self.name})
        await asyncio.to_thread(close_group, self.group)


async def receipt(client) -> tuple[str, int]:
    out = (await client.post("/weights_checker", json={"action": "checksum"})).json()
    assert out["success"] is True
    return out["checksum"], out["weight_version"]


@pytest.mark.timeout(120)
def test_a_broadcast_session_leaves_the_senders_weights_and_version_and_holds_generation(server):
    """A full update in flattened and lone buckets: afterwards the server's checksum is the
    sender's and /model_info reports the version; a /generate sent while paused is answered
    only after /continue_generation, on the new weights."""
    new = unique(make_tiny_model(seed=3).state_dict())

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            held = (await client.get("/weights_manifest")).json()
            assert list(zip(held["names"], held["dtypes"], map(tuple, held["shapes"]))) == manifest_of(new)
            before, _ = await receipt(client)
            assert before != state_checksum(new)  # the server holds other weights
            trainer = Trainer(client)
            await trainer.join()
            plan = plan_buckets(manifest_of(new), SMALL_BUCKET)
            assert (await trainer.post("/pause_generation", {"mode": "retract"})).status_code == 200
            assert (await trainer.post("/begin_weight_update")).status_code == 200
            waiting = asyncio.ensure_future(
                client.post(
                    "/generate",
                    json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "stop_token_ids": [-1]}},
                )
            )
            answered = []
            waiting.add_done_callback(lambda _: answered.append(time.monotonic()))
            outs = [
                await trainer.send(b, new, "3" if i == len(plan) - 1 else None, i == len(plan) - 1)
                for i, b in enumerate(plan)
            ]
            assert (await client.get("/health")).json()["paused"] == "retract"  # /health answers while paused
            assert (await trainer.post("/end_weight_update")).status_code == 200
            await asyncio.sleep(0.5)
            assert not waiting.done(), "a request decoded while generation was paused"
            resumed = time.monotonic()
            assert (await trainer.post("/continue_generation")).json()["status"] == "ok"
            out = (await asyncio.wait_for(waiting, 30)).json()
            info = (await client.get("/model_info")).json()
            checksum, version = await receipt(client)
            await trainer.leave()
            return outs, out, answered[0] - resumed, info, checksum, version

    outs, out, after_continue, info, checksum, version = asyncio.run(main())
    for r in outs:
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert [r.json().get("weight_version") for r in outs] == [None] * (len(outs) - 1) + [3]
    assert checksum == state_checksum(new) and version == 3 and info["weight_version"] == 3
    assert after_continue > 0 and len(out["output_ids"]) == 4 and out["meta_info"]["weight_version"] == 3


@pytest.mark.timeout(120)
def test_a_corrupted_update_makes_the_checksum_differ(server):
    """The receipt can fail: the server's checksum is that of the bytes that arrived, so weights
    that differ from the reference by one value give another checksum."""
    reference = unique(make_tiny_model(seed=4).state_dict())
    sent = {name: t.clone() for name, t in reference.items()}
    sent["model.norm.weight"][0] += 1.0  # one value corrupted on the way

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            trainer = Trainer(client)
            await trainer.join()
            await trainer.update(sent, 4)
            held = await receipt(client)
            await trainer.leave()
            return held

    checksum, version = asyncio.run(main())
    assert version == 4
    assert checksum != state_checksum(reference)
    assert checksum == state_checksum(sent)  # (what did arrive is exactly what was sent)


@pytest.mark.timeout(120)
def test_a_bucket_that_does_not_match_the_model_is_refused_before_any_byte_moves(server):
    """A wrong shape, dtype or name: 400 at once naming the tensor, the broadcast never joined
    (the trainer sends nothing, and the next good bucket still pairs with the next broadcast)."""
    new = unique(make_tiny_model(seed=5).state_dict())
    norm = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "load_format": None}
    bad = [
        ({**norm, "shapes": [[33]]}, "shape"),
        ({**norm, "dtypes": ["bfloat16"]}, "bfloat16"),
        ({**norm, "names": ["model.nonesuch.weight"]}, "nonesuch"),
        ({**norm, "names": ["a", "b"], "dtypes": ["float32"] * 2, "shapes": [[1], [1]]}, "flattened_bucket"),
        ({**norm, "weight_version": "v7"}, "v7"),
        ({**norm, "selector": "draft"}, "draft"),
    ]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            trainer = Trainer(client)
            await trainer.join()
            await trainer.post("/pause_generation", {"mode": "in_place"})
            await trainer.post("/begin_weight_update")
            refused = []
            for body, word in bad:
                t = time.monotonic()
                r = await trainer.post("/update_weights_from_distributed", {**body, "group_name": trainer.name})
                refused.append((r, word, time.monotonic() - t))
            plan = plan_buckets(manifest_of(new), SMALL_BUCKET)
            good = [await trainer.send(b, new, "5" if i == len(plan) - 1 else None) for i, b in enumerate(plan)]
            await trainer.post("/end_weight_update")
            await trainer.post("/continue_generation")
            held = await receipt(client)
            await trainer.leave()
            return refused, good, held

    refused, good, (checksum, version) = asyncio.run(main())
    for r, word, seconds in refused:
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
        assert seconds < 2, f"refusing took {seconds:.1f} s"
    assert "nothing was received" in refused[0][0].json()["error"]["message"]
    assert all(r.status_code == 200 for r in good) and checksum == state_checksum(new) and version == 5


_RANK_0 = """
import sys
from strop.wire.group import make_group
group = make_group("127.0.0.1", int(sys.argv[1]), 0, 2, "gloo", 30, name=sys.argv[2])
print("joined", flush=True)
sys.stdin.read()  # held until killed
"""


@pytest.mark.timeout(120)
def test_a_broadcast_whose_trainer_dies_fails_with_the_cause_and_the_session_can_end(server):
    """The trainer's process dies while the server waits in a broadcast: the update answers 500
    naming the broadcast (it does not wait for the group's timeout), the version is unchanged,
    end_weight_update closes the session and generation goes on."""
    import subprocess
    import sys

    new = unique(make_tiny_model(seed=6).state_dict())
    bucket = plan_buckets(manifest_of(new), SMALL_BUCKET)[-1]
    name, port = f"strop-sync-test-{uuid.uuid4().hex[:8]}", free_port()
    rank_0 = subprocess.Popen(
        [sys.executable, "-c", _RANK_0, str(port), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            _, before = await receipt(client)
            r = await client.post(
                "/init_weights_update_group",
                json={
                    "master_address": "127.0.0.1",
                    "master_port": port,
                    "rank_offset": 1,
                    "world_size": 2,
                    "group_name": name,
                },
            )
            assert r.status_code == 200, r.text
            assert (await asyncio.to_thread(rank_0.stdout.readline)).strip() == "joined"
            await client.post("/pause_generation", json={"mode": "abort"})
            await client.post("/begin_weight_update", json={})
            update = asyncio.ensure_future(
                client.post(
                    "/update_weights_from_distributed",
                    json={**bucket.payload(), "group_name": name, "weight_version": 9},
                )
            )
            await asyncio.sleep(0.5)  # the server waits in the broadcast
            rank_0.kill()
            t = time.monotonic()
            r = await asyncio.wait_for(update, 25)
            seconds = time.monotonic() - t
            ended = await client.post("/end_weight_update", json={})
            await client.post("/continue_generation", json={})
            gen = await client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
            await client.post("/destroy_weights_update_group", json={"group_name": name})
            return before, r, seconds, ended, gen, await receipt(client)

    try:
        before, r, seconds, ended, gen, (_, after) = asyncio.run(main())
    finally:
        rank_0.kill()
        rank_0.wait(30)
    assert r.status_code == 500 and "broadcast" in r.json()["error"]["message"], r.text
    assert seconds < 10, f"the failed broadcast answered after {seconds:.1f} s"
    assert after == before and ended.status_code == 200 and gen.status_code == 200


# ---- in-process: pause modes and the session's bookkeeping (no broadcast needed) ----------------


def tiny_engine(**kw) -> EmbeddedEngine:
    return EmbeddedEngine(make_tiny_model(), pad_token_id=2, default_stop_token_ids=[2], **kw)


def asgi(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://strop", timeout=60)


async def until_running(engine: EmbeddedEngine) -> None:
    """Wait until a batch is decoding (the engine holds the model)."""
    deadline = time.monotonic() + 10
    while not engine._busy.locked():
        assert time.monotonic() < deadline, "no batch started"
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)  # a few steps in


@pytest.mark.timeout(60)
def test_pause_abort_ends_running_and_queued_requests_and_new_ones_wait_for_continue():
    engine = tiny_engine()

    async def main():
        async with asgi(create_app(engine)) as client:
            running = asyncio.ensure_future(
                client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": LONG})
            )
            await until_running(engine)
            paused = await client.post("/pause_generation", json={})  # mode abort by default
            aborted = (await asyncio.wait_for(running, 10)).json()
            late = asyncio.ensure_future(
                client.post(
                    "/generate",
                    json={"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 3, "stop_token_ids": [-1]}},
                )
            )
            await asyncio.sleep(0.3)
            health = (await client.get("/health")).json()
            waited = not late.done()
            await client.post("/continue_generation", json={"torch_empty_cache": True})
            return paused.json(), aborted, health, waited, (await asyncio.wait_for(late, 10)).json()

    paused, aborted, health, waited, late = asyncio.run(main())
    assert paused["status"] == "ok" and "abort" in paused["message"]
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < LONG["max_new_tokens"]  # ended early, its tokens kept
    assert health["paused"] == "abort" and waited, "a request sent while paused did not wait"
    assert late["meta_info"]["finish_reason"]["type"] == "length" and len(late["output_ids"]) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_retracted_or_held_request_resumes_after_continue_as_if_never_paused(mode):
    """Seeded sampling paused mid-way and continued (weights unchanged) gives the tokens of a run
    never paused: retract prefills the prompt plus the tokens so far again (the row's generator
    carried over), in_place keeps the batch and its cache."""
    engine = tiny_engine()
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {**LONG, "temperature": 1.0, "sampling_seed": 11},
        "return_logprob": True,
    }

    async def main():
        async with asgi(create_app(engine)) as client:
            plain = (await client.post("/generate", json=body)).json()
            running = asyncio.ensure_future(client.post("/generate", json=body))
            await until_running(engine)
            await client.post("/pause_generation", json={"mode": mode})
            await asyncio.sleep(0.3)
            stopped = not running.done() and not engine._busy.locked()
            await client.post("/continue_generation", json={})
            return plain, stopped, (await asyncio.wait_for(running, 20)).json()

    plain, stopped, resumed = asyncio.run(main())
    assert stopped, f"{mode}: the request kept decoding (or ended) while paused"
    assert resumed["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == LONG["max_new_tokens"]
    assert len(set(plain["output_ids"])) > 5  # varied tokens: a row that lost its place would show
    lp = torch.tensor([e[0] for e in resumed["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(
        lp, torch.tensor([e[0] for e in plain["meta_info"]["output_token_logprobs"]]), rtol=0, atol=1e-4
    )


@pytest.mark.timeout(60)
def test_update_calls_out_of_a_session_are_refused_and_a_session_holds_every_batch(monkeypatch):
    """update_weights_from_distributed outside begin/end: SGLang's 400; a second begin, an end
    without begin: 400; while a session is open (not paused) a request waits for its end; a new
    group ends a session its previous trainer left open."""
    import strop.wire.group as sync

    monkeypatch.setattr(sync, "make_group", lambda *a, **kw: object())
    monkeypatch.setattr(sync, "close_group", lambda group: None)
    engine = tiny_engine()
    update = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "g"}
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"}

    async def main():
        async with asgi(create_app(engine)) as client:
            out = {
                "outside": await client.post("/update_weights_from_distributed", json=update),
                "end_first": await client.post("/end_weight_update", json={}),
                "begin": await client.post("/begin_weight_update", json={"selector": "all"}),
                "again": await client.post("/begin_weight_update", json={}),
            }
            gen = asyncio.ensure_future(
                client.post("/generate", json={"input_ids": [5], "sampling_params": {"max_new_tokens": 2}})
            )
            await asyncio.sleep(0.3)
            out["held"] = not gen.done()
            out["end"] = await client.post("/end_weight_update", json={})
            out["gen"] = await asyncio.wait_for(gen, 10)
            await client.post("/begin_weight_update", json={})
            out["init"] = await client.post("/init_weights_update_group", json=group)  # the old trainer is gone
            out["begin_after_init"] = await client.post("/begin_weight_update", json={})
            await client.post("/end_weight_update", json={})
            return out

    out = asyncio.run(main())
    message = out["outside"].json()["error"]["message"]
    assert (
        out["outside"].status_code == 400
        and "must run between begin_weight_update() and end_weight_update()" in message
    ), message
    assert out["end_first"].status_code == 400 and "no weight update is open" in out["end_first"].text
    assert out["begin"].status_code == 200 and out["again"].status_code == 400 and "already open" in out["again"].text
    assert out["held"], "a request decoded inside a weight-update session"
    assert out["end"].status_code == 200 and out["gen"].status_code == 200
    assert out["init"].status_code == 200 and out["begin_after_init"].status_code == 200


@pytest.mark.timeout(60)
def test_the_manifest_checker_and_version_label_describe_the_model():
    engine = tiny_engine()
    named = engine.model.state_dict()

    async def main():
        async with asgi(create_app(engine, token="s3cret")) as client:
            auth = {"Authorization": "Bearer s3cret"}
            return (
                await client.get("/weights_manifest", headers=auth),
                await client.get("/weights_checker", headers=auth),
                await client.post("/weights_checker", json={"action": "snapshot"}, headers=auth),
                await client.post("/update_weight_version", json={"new_version": "12"}, headers=auth),
                await client.post("/weights_checker", json={"action": "checksum"}, headers=auth),
                await client.post("/weights_checker", json={"action": "checksum"}),
            )

    manifest, checked, snapshot, relabel, after, no_token = asyncio.run(main())
    out = manifest.json()
    assert "lm_head.weight" in named and "lm_head.weight" not in out["names"]  # the tied alias is dropped
    assert list(zip(out["names"], out["dtypes"], map(tuple, out["shapes"]))) == manifest_of(named)
    assert checked.json() == {"success": True, "checksum": state_checksum(unique(named)), "weight_version": 0}
    assert snapshot.status_code == 400 and "'checksum'" in snapshot.json()["error"]["message"]
    assert relabel.json() == {"success": True, "new_version": "12"} and engine.weight_version == 12
    assert after.json()["checksum"] == checked.json()["checksum"]  # a relabel leaves the weights alone
    assert no_token.status_code == 401


@pytest.mark.timeout(120)
def test_the_sglang_client_scores_a_probe_on_strop_serve_as_the_trainer_does(start_server):
    from strop.engines.sglang import SGLangEngine
    from strop.serving.probe import reference_logprobs
    from tests.tiny import make_tiny_model

    engine = SGLangEngine(start_server().url)
    ids = [5, 9, 200, 17, 4000, 3]

    async def main():
        scored = await engine.score(ids)
        alone = await engine.score([5])  # (one token: nothing before it to score it by)
        await engine.close()
        return scored, alone

    scored, alone = asyncio.run(main())
    assert alone == []
    want = reference_logprobs(make_tiny_model(), ids)  # the server runs the tiny model's initial weights
    assert len(scored) == len(ids) - 1 and max(abs(a - b) for a, b in zip(scored, want)) < 1e-5
    other = reference_logprobs(make_tiny_model(seed=1), ids)
    assert max(abs(a - b) for a, b in zip(scored, other)) > 1e-3  # other weights score otherwise: the probe can fail
