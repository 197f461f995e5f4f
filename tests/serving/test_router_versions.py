"""The router's weight-version bookkeeping against controllable fake engines: each fake holds real
tensors and a version, can be stopped and restarted, and can pause inside any await where a race
lives. The invariant every test ends on: a healthy engine holds the router's weights and version."""

import asyncio

import pytest
import torch

from strop.wire.errors import EngineRequestError, EngineUnavailable, EngineVersionError, parse_weight_version
from strop.engines.router import Router
from strop.sync.broadcast import BroadcastSync
from strop.sync.delta import DeltaSync
from strop.sync.disk import DiskSync, WeightWriter
from strop.types import Completion, SamplingParams

pytestmark = pytest.mark.timeout(30)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.weight": torch.randn(5, generator=g)}


INITIAL = _weights(0)


class FakeEngine:
    """An engine that holds ``weights`` at ``version`` (what it would report), serves while ``up``,
    and pauses at ``gate[name]`` (an Event) inside the call ``name`` when one is set."""

    def __init__(self, name: str):
        self.name, self.up = name, True
        self.weights, self.version = {k: v.clone() for k, v in INITIAL.items()}, 0
        self.gate: dict[str, asyncio.Event] = {}
        self.entered: dict[str, asyncio.Event] = {}
        self.report = None  # a version to report instead of the real one (a misbehaving server)
        self.requests = 0
        self.fail_generate = False
        self.boots = 1  # how often its process started: a broadcast group dies with the process that joined it

    def __repr__(self):
        return f"Fake({self.name})"

    def restart(self):
        """Killed and started again: initial weights, version 0, no broadcast group."""
        self.up, self.weights, self.version = True, {k: v.clone() for k, v in INITIAL.items()}, 0
        self.boots += 1

    async def _maybe_pause(self, name):
        if name in self.gate:
            self.entered.setdefault(name, asyncio.Event()).set()
            await self.gate[name].wait()
        if not self.up:
            raise EngineUnavailable(f"{self.name} is down")

    async def generate(self, prompt_ids, sampling, request_id=None):
        await self._maybe_pause("generate")
        if self.fail_generate:
            raise EngineUnavailable(f"{self.name}: connection reset")
        self.requests += 1
        return Completion([7], [-0.5], "stop", self.version)

    async def health(self):
        return self.up

    async def get_weight_version(self):
        await self._maybe_pause("get_weight_version")
        return parse_weight_version(self.report if self.report is not None else self.version, self.name)

    async def load_weights(self, path, version, checksum=None, digests=None):
        await self._maybe_pause("load_weights")
        from safetensors.torch import load_file

        state = load_file(str(path / "model.safetensors"))
        if digests is None and set(state) != set(self.weights):
            raise EngineRequestError(f"{self.name}: a full load needs every tensor")
        self.weights.update(state)
        self.version = version
        return version

    async def join_group(self, *args):
        pass

    async def leave_group(self, name):
        pass

    async def abort_all(self):
        pass

    async def close(self):
        pass


class FakeBroadcast(BroadcastSync):
    """BroadcastSync with a fake send: copies the weights into the members, pausing at ``gate`` first. As the real
    one, it keeps a group per engine until ``drop``: a group joined by an engine's earlier process fails."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered, self.members = None, asyncio.Event(), []
        self.links: dict = {}  # engine -> the boot of its process that joined the group

    async def drop(self, engine):
        self.links.pop(engine, None)

    async def send(self, engines, named, version):
        """Per engine, the version it then holds, or the error that took it out of the update (an engine
        that is down fails alone: the others complete the update)."""
        self.members.append([e.name for e in engines])
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        results = []
        for e in engines:
            if not e.up:
                results.append(EngineUnavailable(f"{e.name} is down"))
                continue
            if self.links.setdefault(e, e.boots) != e.boots:
                results.append(EngineRequestError(f"{e.name}: no such group (joined by an earlier process)"))
                continue
            e.weights = {k: v.clone() for k, v in named.items()}
            e.version = version
            results.append(e.version)
        size = sum(t.numel() * t.element_size() for t in named.values())
        return size * sum(not isinstance(r, BaseException) for r in results), results


def assert_healthy_engines_hold_the_routers_weights(router, weights):
    for i, engine in enumerate(router.engines):
        if router.healthy[i]:
            assert engine.version == router.weight_version, (engine, engine.version, router.weight_version)
            for name, t in weights.items():
                assert torch.equal(engine.weights[name], t), (engine, name)


async def _until(predicate, timeout=10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# ---- item 1: broadcast sync, an engine returning during the broadcast ---------------------------------
def test_an_engine_returning_during_a_broadcast_is_not_admitted_with_weights_it_never_received():
    a, b = FakeEngine("a"), FakeEngine("b")
    broadcast = FakeBroadcast()
    router = Router([a, b], sync=broadcast)

    async def main():
        for v in range(1, 4):
            await router.update_weights(_weights(v), version=v)
        b.up = False
        router.mark_down(1, "killed")
        b.restart()  # back at version 0, before the router noticed
        broadcast.gate, broadcast.entered = asyncio.Event(), asyncio.Event()
        update = asyncio.ensure_future(router.update_weights(_weights(4), version=4))
        await broadcast.entered.wait()  # the broadcast to [a] is in flight
        probe = asyncio.ensure_future(router.check_health())  # the health loop sees b answer again
        await asyncio.sleep(0.05)
        broadcast.gate.set()
        await asyncio.gather(update, probe)

    asyncio.run(main())
    assert router.weight_version == 4
    assert_healthy_engines_hold_the_routers_weights(router, _weights(4))
    assert not router.healthy[1] and 1 in router.rejoining  # it gets the weights at the next update

    async def next_update():
        broadcast.gate = None
        await router.update_weights(_weights(5), version=5)

    asyncio.run(next_update())
    assert router.healthy == [True, True] and broadcast.members[-1] == ["a", "b"]
    assert_healthy_engines_hold_the_routers_weights(router, _weights(5))


# ---- item 2: disk sync, the health loop loading the new file under the old version -------------------
@pytest.mark.parametrize("old_version", [0, 4])
def test_an_engine_readmitted_during_a_disk_update_holds_the_new_version(tmp_path, old_version):
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)))

    async def main():
        if old_version:
            await router.update_weights(_weights(old_version), version=old_version)
        b.up = False
        router.mark_down(1, "killed")
        b.restart()
        a.gate["load_weights"] = asyncio.Event()
        update = asyncio.ensure_future(router.update_weights(_weights(old_version + 1), version=old_version + 1))
        await _until(lambda: "load_weights" in a.entered)  # the file is written, a is loading it
        probe = asyncio.ensure_future(router.check_health())
        await asyncio.sleep(0.05)
        a.gate.pop("load_weights").set()
        await asyncio.gather(update, probe)
        await router.check_health()  # the next probe after the update re-admits b with the new weights

    asyncio.run(main())
    assert router.weight_version == old_version + 1
    assert router.healthy == [True, True]
    assert_healthy_engines_hold_the_routers_weights(router, _weights(old_version + 1))


# ---- item 4: versions strop cannot read -----------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [(3, 3), ("12", 12), ("default", 0)])
def test_weight_versions_are_read_in_one_place(value, expected):
    assert parse_weight_version(value, "http://e") == expected


@pytest.mark.parametrize("value", ["step-42", None, 1.5, -1, True, "", "٣"])
def test_an_unreadable_weight_version_is_an_engine_error_naming_the_engine(value):
    with pytest.raises(EngineVersionError, match="http://e"):
        parse_weight_version(value, "http://e")


def test_an_unreadable_version_does_not_kill_the_health_loop(tmp_path):
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)), health_interval_s=0.02)

    async def main():
        await router.update_weights(_weights(1), version=1)
        router.mark_down(1, "killed")
        b.restart()
        b.report = "step-42"  # SGLang's labels are strings
        await router.generate([1, 2], SamplingParams(max_new_tokens=1))  # starts the health loop
        await asyncio.sleep(0.2)  # several probes read the bad version
        assert not router.healthy[1] and not router._health_task.done()
        b.report = None
        await _until(lambda: router.healthy[1])
        await router.close()

    asyncio.run(main())
    assert_healthy_engines_hold_the_routers_weights(router, _weights(1))
    assert any("step-42" in e for e in router.events)


# ---- item 7: an engine restarted behind the router's back ------------------------------------------------
@pytest.mark.parametrize("sync", ["disk", "delta", "broadcast"])
def test_an_engine_restarted_between_updates_is_reloaded_before_it_serves_again(tmp_path, sync):
    """Under delta and broadcast sync the restarted engine must get every tensor, not only the changed ones."""
    a, b = FakeEngine("a"), FakeEngine("b")
    transport = {"broadcast": FakeBroadcast, "delta": DeltaSync, "disk": DiskSync}[sync]
    router = Router([a, b], sync=transport() if sync == "broadcast" else transport(WeightWriter(tmp_path)))
    later = dict(_weights(2), **{"b.weight": _weights(1)["b.weight"]})  # only a.weight changes in version 2

    async def main():
        await router.update_weights(_weights(1), version=1)
        b.restart()  # no request failed: only the version probe can tell
        await router.check_health()
        assert not router.healthy[1]
        await router.check_health()  # alive again: reloaded now (disk) or rejoining (delta, broadcast)
        await router.update_weights(later, version=2)
        await router.check_health()

    asyncio.run(main())
    assert router.healthy == [True, True]
    assert_healthy_engines_hold_the_routers_weights(router, later)


def test_an_engine_that_reports_another_version_after_a_load_is_not_healthy(tmp_path):
    a, b = FakeEngine("a"), FakeEngine("b")

    async def lying_load(path, version, checksum=None, digests=None):
        return 0  # claims success but holds its initial weights

    b.load_weights = lying_load
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)))
    asyncio.run(router.update_weights(_weights(1), version=1))
    assert router.healthy == [True, False]
    assert any("reports weight version 0" in e for e in router.events)


def test_no_probe_readmits_an_engine_while_an_update_is_in_flight(tmp_path):
    """The lock: a re-admission waits for the running update, then sees its version."""
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)))

    async def main():
        await router.update_weights(_weights(1), version=1)
        router.mark_down(1, "killed")
        a.gate["load_weights"] = asyncio.Event()
        update = asyncio.ensure_future(router.update_weights(_weights(2), version=2))
        await _until(lambda: "load_weights" in a.entered)
        probe = asyncio.ensure_future(router.check_health())
        await asyncio.sleep(0.05)
        waiting = not probe.done() and not router.healthy[1]
        a.gate.pop("load_weights").set()
        await asyncio.gather(update, probe)
        return waiting

    assert asyncio.run(main())
    assert router.healthy == [True, True] and b.version == 2
    assert_healthy_engines_hold_the_routers_weights(router, _weights(2))


# ---- item 17: least outstanding requests -----------------------------------------------------------------
def test_requests_go_to_the_engine_with_the_fewest_in_flight():
    engines = [FakeEngine(n) for n in "abc"]
    for e in engines:
        e.gate["generate"] = asyncio.Event()
    router = Router(engines)

    async def main():
        sp = SamplingParams(max_new_tokens=1)
        tasks = [asyncio.ensure_future(router.generate([1], sp)) for _ in range(5)]
        await asyncio.sleep(0.05)
        spread = list(router.outstanding)
        engines[0].gate["generate"].set()  # a finishes its two: it has the fewest again
        await asyncio.sleep(0.05)
        nxt = asyncio.ensure_future(router.generate([1], sp))
        await asyncio.sleep(0.05)
        for e in engines:
            e.gate["generate"].set()
        await asyncio.gather(*tasks, nxt)
        await router.close()
        return spread

    spread = asyncio.run(main())
    assert spread == [2, 2, 1]  # 5 requests over 3 engines, ties to the first
    assert [e.requests for e in engines] == [3, 2, 1]


# ---- item 23: failovers and engine events reach the step's metrics ----------------------------------------
def test_failovers_and_engine_events_are_counted_per_step(tmp_path, capsys):
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([b, a], sync=DiskSync(WeightWriter(tmp_path)))

    async def main():
        sp = SamplingParams(max_new_tokens=1)
        b.fail_generate = True
        outs = [await router.generate([1], sp) for _ in range(3)]  # the first goes to b and fails over to a
        first = router.take_counts()
        b.fail_generate = False
        await router.check_health()
        second = router.take_counts()
        await router.close()
        return outs, first, second

    outs, first, second = asyncio.run(main())
    assert all(o.finish_reason == "stop" for o in outs)
    assert first == {"engine_failovers": 1, "engine_down": 1, "engine_readmitted": 0, "engines_healthy": 1}
    assert second == {"engine_failovers": 0, "engine_down": 0, "engine_readmitted": 1, "engines_healthy": 2}
    printed = capsys.readouterr().out
    assert "down Fake(b)" in printed and "re-admitted Fake(b)" in printed


def test_affinity_keys_are_bounded():
    from strop.engines.router import MAX_STICKY_KEYS

    router = Router([FakeEngine("a"), FakeEngine("b")], affinity=True)

    async def main():
        for k in range(MAX_STICKY_KEYS + 50):
            await router.generate([1], SamplingParams(max_new_tokens=1), affinity=f"sample-{k}")
        await router.close()

    asyncio.run(main())
    assert len(router._sticky) == MAX_STICKY_KEYS and "sample-0" not in router._sticky


# ---- items 4-6 at the client: SGLang 0.5.23's routes and answers -------------------------------------------
class _SGLangServer:
    """SGLang 0.5.23's answers: the label on /model_info ("default" at start), no /get_weight_version, an
    update answer without version or checksum, generate answers carrying meta_info.weight_version."""

    def __init__(self):
        self.label, self.meta = "default", {}

    def __call__(self, request):
        import json

        import httpx

        path = request.url.path
        if path == "/model_info":
            return httpx.Response(200, json={"model_path": "m", "weight_version": self.label})
        if path == "/update_weights_from_disk":
            self.label = json.loads(request.content)["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        if path == "/generate":
            meta = {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[-0.5, 7, None]], **self.meta}
            return httpx.Response(200, json={"text": "", "output_ids": [7], "meta_info": meta})
        return httpx.Response(404, json={"detail": "Not Found"})


def _sglang(require_checksum=False):
    import httpx

    from strop.engines.sglang import SGLangEngine

    server = _SGLangServer()
    engine = SGLangEngine("http://sglang.test", retries=0, **({"require_checksum": True} if require_checksum else {}))
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return server, engine


def test_the_sglang_client_reads_versions_where_sglang_reports_them(tmp_path):
    server, engine = _sglang()

    async def main():
        first = await engine.get_weight_version()
        loaded = await engine.load_weights(tmp_path, 2, checksum="abc")  # SGLang answers no checksum: not required
        server.meta = {
            "weight_version": "2",
            "weight_versions": [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}],
        }
        spanned = await engine.generate([1], SamplingParams(max_new_tokens=1))
        server.meta = {}
        with pytest.raises(EngineRequestError, match="sglang.test.*weight version None"):
            await engine.generate([1], SamplingParams(max_new_tokens=1))
        return first, loaded, spanned

    first, loaded, spanned = asyncio.run(main())
    assert (first, loaded) == (0, 2)
    assert spanned.weight_version == 1  # a request that spanned an update counts as its oldest tokens


def test_a_strop_server_must_prove_receipt_with_the_checksum(tmp_path):
    server, engine = _sglang(require_checksum=True)  # kind strop: strop serve reports the checksum
    with pytest.raises(EngineRequestError, match="arrived with checksum None, the trainer's is abc"):
        asyncio.run(engine.load_weights(tmp_path, 2, checksum="abc"))


def test_a_request_issued_during_a_load_waits_and_is_served_by_the_new_weights(tmp_path):
    # (before issue 22 such a request went out during the load; one failing on the loading engine then
    # marked it down mid-load. Now no request goes out while weights change: the case cannot arise)
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)))

    async def main():
        await router.generate([1], SamplingParams(max_new_tokens=1))  # the router has started
        a.gate["load_weights"] = asyncio.Event()
        update = asyncio.ensure_future(router.update_weights(_weights(1), version=1))
        await _until(lambda: "load_weights" in a.entered)
        request = asyncio.ensure_future(router.generate([1], SamplingParams(max_new_tokens=1)))
        await asyncio.sleep(0.05)
        served_during = a.requests + b.requests
        a.gate.pop("load_weights").set()
        await update
        return served_during, await request

    served_during, out = asyncio.run(main())
    assert served_during == 1 and out.weight_version == 1  # (the one before the update)
    assert router.healthy == [True, True] and router.counts["failover"] == 0
    assert_healthy_engines_hold_the_routers_weights(router, _weights(1))


def test_an_engine_holding_another_runs_weights_starts_down_and_is_loaded_at_the_first_update(tmp_path):
    a, b = FakeEngine("a"), FakeEngine("b")
    b.version, b.weights = 7, _weights(7)  # a server reused from an earlier run
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)))

    async def main():
        out = await router.generate([1], SamplingParams(max_new_tokens=1))
        started = list(router.healthy)
        await router.update_weights(_weights(1), version=1)
        await router.check_health()
        return out, started

    out, started = asyncio.run(main())
    assert started == [True, False] and out.weight_version == 0 and b.requests == 0
    assert router.healthy == [True, True]
    assert_healthy_engines_hold_the_routers_weights(router, _weights(1))


def test_a_restart_between_delta_updates_without_a_probe_still_sends_every_tensor(tmp_path):
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DeltaSync(WeightWriter(tmp_path)))
    later = dict(_weights(2), **{"b.weight": _weights(1)["b.weight"]})  # b.weight unchanged in version 2

    async def main():
        await router.update_weights(_weights(1), version=1)
        b.restart()  # no probe runs before the next update
        await router.update_weights(later, version=2)

    asyncio.run(main())
    assert router.healthy == [True, True]
    assert_healthy_engines_hold_the_routers_weights(router, later)


def test_a_member_whose_broadcast_failed_does_not_serve_half_new_weights_and_the_others_do():
    from strop.wire.errors import EngineReceiptError

    a, b, c = FakeEngine("a"), FakeEngine("b"), FakeEngine("c")

    class Failing(FakeBroadcast):
        async def send(self, engines, named, version):
            sent, results = await super().send(engines, named, version)
            engines[0].weights["a.weight"] = _weights(9)["a.weight"]  # a: the first bucket landed, then it broke
            results[0] = EngineUnavailable("gloo: connection reset")
            results[2] = EngineReceiptError("c: checksum differs")  # c took the bytes but holds something else
            return sent, results

    router = Router([a, b, c], sync=Failing())

    async def main():
        with pytest.raises(EngineReceiptError, match="c: checksum differs"):  # the step fails naming c
            await router.update_weights(_weights(1), version=1)

    asyncio.run(main())
    assert router.healthy == [False, True, False] and router.rejoining == {0, 2}
    assert router.weight_version == 1 and b.version == 1  # b completed the update


def test_sglangs_empty_answers_are_not_errors_and_garbage_is_an_engine_error():
    import httpx

    from strop.engines.sglang import SGLangEngine

    def answer(request):
        if request.url.path == "/health":
            return httpx.Response(200)  # SGLang: 200, no body
        return httpx.Response(200, text="<html>proxy</html>")

    engine = SGLangEngine("http://sglang.test", retries=0)
    engine._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))

    async def main():
        with pytest.raises(EngineRequestError, match="not JSON"):
            await engine.get_weight_version()
        return await engine.health()

    assert asyncio.run(main()) is True


def test_the_weight_writer_hands_out_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path, _ = WeightWriter("runs/x/weights").write(_weights(1), 1)
    assert path.is_absolute() and path == tmp_path / "runs/x/weights/v1"


# ---- issue 22: requests drain before an update; the probe ----------------------------------------------
@pytest.mark.parametrize("form", ["disk", "broadcast"])
def test_requests_in_flight_finish_on_the_old_weights_and_new_ones_wait_for_the_new(tmp_path, form):
    a = FakeEngine("a")
    writer = WeightWriter(tmp_path / "w")
    router = Router([a], sync=FakeBroadcast() if form == "broadcast" else DiskSync(writer))
    a.gate["generate"] = asyncio.Event()
    weights = _weights(1)

    async def main():
        first = asyncio.ensure_future(router.generate([1], SamplingParams()))
        await _until(lambda: "generate" in a.entered)  # a request is in flight at version 0
        update = asyncio.ensure_future(router.update_weights(weights, version=1))
        await asyncio.sleep(0.05)
        assert not update.done() and a.version == 0  # the update waits for it
        second = asyncio.ensure_future(router.generate([2], SamplingParams()))
        await asyncio.sleep(0.05)
        assert a.requests == 0  # and a new request waits for the update
        a.gate["generate"].set()
        done_first = await first
        await update
        return done_first, await second

    first, second = asyncio.run(main())
    assert (first.weight_version, second.weight_version) == (0, 1)
    assert_healthy_engines_hold_the_routers_weights(router, weights)


class ScoringEngine(FakeEngine):
    """A fake that scores with a real model holding its own weights."""

    def __init__(self, name, model):
        super().__init__(name)
        self.model = model

    async def score(self, ids):
        from strop.serving.probe import reference_logprobs

        return reference_logprobs(self.model, ids)


def test_the_probe_names_an_engine_that_computes_with_other_weights():
    from strop.serving.probe import reference_logprobs
    from strop.wire.errors import EngineReceiptError
    from tests.tiny import make_tiny_model

    trainer = make_tiny_model(seed=1)
    same, stale = ScoringEngine("same", make_tiny_model(seed=1)), ScoringEngine("stale", make_tiny_model(seed=1))
    with torch.no_grad():  # the stale engine missed one update: its norm still has the old values
        trainer.model.norm.weight.mul_(1.5)
        same.model.model.norm.weight.mul_(1.5)
    ids = [3, 5, 7, 11, 2, 9]
    reference = reference_logprobs(trainer, ids)
    router = Router([same, stale], sync=DiskSync(WeightWriter("/tmp/unused")))

    async def main():
        ok = await Router([same], sync=DiskSync(router.sync.writer)).probe(ids, reference, 1e-3)
        with pytest.raises(
            EngineReceiptError,
            match=r"Fake\(stale\) at weight version 0: its logprobs of the probe "
            r"differ from the trainer's by .* > engine.sync_probe_tolerance",
        ):
            await router.probe(ids, reference, 1e-3)
        return ok

    assert asyncio.run(main()) < 1e-6  # same weights: the same logprobs


# ---- a version probe and a request that race a weight update -----------------------------------------------
@pytest.mark.parametrize("answer", ["old version", "error"])
def test_a_version_probe_spanning_a_weight_update_does_not_mark_the_updated_engine_down(tmp_path, answer):
    """The health loop asks a for its version; a answers 0 (or the call fails), but the answer arrives only
    after an update loaded version 1 into a. That answer describes a before the update: a stays healthy."""
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router([a, b], sync=DiskSync(WeightWriter(tmp_path)), health_interval_s=3600)
    asked, answer_arrives = asyncio.Event(), asyncio.Event()
    real_probe = a.get_weight_version

    async def slow_probe():
        seen = a.version  # what a holds when the question reaches it (before the update)
        a.get_weight_version = real_probe  # only the first probe is slow
        asked.set()
        await answer_arrives.wait()
        if answer == "error":
            raise EngineUnavailable("a: read timed out")
        return seen

    a.get_weight_version = slow_probe

    async def main():
        probe = asyncio.ensure_future(router.check_health())
        await asyncio.wait_for(asked.wait(), 10)
        await router.update_weights(_weights(1), version=1)  # a and b load version 1 meanwhile
        assert router.healthy == [True, True] and a.version == 1
        answer_arrives.set()
        await asyncio.wait_for(probe, 10)
        after_probe = list(router.healthy)
        await router.check_health()  # the next probe asks again and sees version 1: still healthy
        return after_probe

    assert asyncio.run(main()) == [True, True], list(router.events)
    assert router.healthy == [True, True] and router.counts["down"] == 0, list(router.events)
    assert_healthy_engines_hold_the_routers_weights(router, _weights(1))


@pytest.mark.parametrize("sync", ["disk", "delta"])
def test_an_engine_whose_request_fails_during_its_load_stays_down_until_the_health_loop_readmits_it(tmp_path, sync):
    """A request still running on a when the drain gives up fails while a loads the new weights: a goes down,
    and the load that then succeeds does not bring it back; the next health check does (a answers and holds
    the router's version), and the request was served by b."""
    a, b = FakeEngine("a"), FakeEngine("b")
    router = Router(
        [a, b],
        sync=(DeltaSync if sync == "delta" else DiskSync)(WeightWriter(tmp_path)),
        drain_timeout_s=0.0,
        health_interval_s=3600,
    )
    a.gate["generate"], a.gate["load_weights"] = asyncio.Event(), asyncio.Event()

    async def main():
        request = asyncio.ensure_future(router.generate([1], SamplingParams(max_new_tokens=1)))
        await asyncio.wait_for(a.entered.setdefault("generate", asyncio.Event()).wait(), 10)  # in flight on a
        update = asyncio.ensure_future(router.update_weights(_weights(1), version=1))
        await asyncio.wait_for(a.entered.setdefault("load_weights", asyncio.Event()).wait(), 10)  # a is loading
        a.fail_generate = True
        a.gate.pop("generate").set()  # the request fails on a mid-load
        await _until(lambda: router.state[0] == "down")
        a.gate.pop("load_weights").set()  # a's load succeeds: version 1
        await asyncio.wait_for(update, 10)
        after_load = list(router.healthy)
        out = await asyncio.wait_for(request, 10)  # re-issued to b once the update ended
        a.fail_generate = False
        await router.check_health()
        await router.close()
        return after_load, out

    after_load, out = asyncio.run(main())
    assert a.version == 1 and after_load == [False, True]
    assert out.finish_reason == "stop" and out.weight_version == 1 and (a.requests, b.requests) == (0, 1)
    assert router.healthy == [True, True] and router.counts["failover"] == 1
    assert any(
        e.startswith("re-admitted Fake(a) at weight version 1 (reports the current weights; was down)")
        for e in router.events
    ), list(router.events)
    assert_healthy_engines_hold_the_routers_weights(router, _weights(1))
