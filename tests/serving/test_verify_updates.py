"""engine.verify_updates, the corrupt-then-restore check (strop.sync.verify): every engine's weights are overwritten
with noise, the update runs through the run's own transport, and every tensor each engine holds must then equal
the trainer's bit for bit. On every transport strop has (in-process into the embedded engine; disk, delta and
broadcast into strop serve) the check passes, and it fails naming the engine, the transport and the first tensor
that differs when the restoration is skipped on purpose, a fault each transport's own receipt lets through."""

import asyncio

import pytest
import torch

import strop.sync.broadcast as broadcast_module
from strop.engines.health import DOWN
from strop.engines.launch import LocalServer
from strop.engines.router import Router
from strop.engines.sglang import SGLangEngine
from strop.process import free_port
from strop.serving.embedded import EmbeddedEngine
from strop.sync.base import Receipt
from strop.sync.broadcast import BroadcastSync
from strop.sync.delta import DeltaSync
from strop.sync.disk import DiskSync, WeightWriter
from strop.sync.inprocess import InProcessSync
from strop.sync.verify import VerifiedSync, _Embedded
from strop.wire.buckets import manifest_of, plan_buckets
from strop.wire.digest import tensor_digest
from strop.wire.errors import EngineReceiptError
from tests.tiny import make_tiny_model

NORM = "model.norm.weight"  # the tensor the faulty transports skip, and the one a step changes
FIRST = "model.embed_tokens.weight"  # the first tensor by name: named when every tensor differs


def trained(seed: int) -> dict[str, torch.Tensor]:
    """A trainer's weights: the tiny model's, other than the ones the engines start from (seed 0)."""
    return make_tiny_model(seed=seed).state_dict()


def stepped(state: dict) -> dict:
    """``state`` after a step that changed one tensor only (the norm; the tied lm_head stays tied)."""
    out = dict(state)
    out[NORM] = state[NORM] * 1.5
    return out


def digests(state: dict) -> dict[str, str]:
    """The digest of each tensor an engine holding ``state`` reports (tied names once)."""
    return {name: tensor_digest(state[name]) for name, _, _ in manifest_of(state)}


def bare(held: dict[str, str]) -> dict[str, str]:
    return {key.rpartition(":")[2]: d for key, d in held.items()}


# ---- the embedded engine, in process ----------------------------------------------------------------------------


def embedded(transport=None, every: bool = True) -> tuple[EmbeddedEngine, VerifiedSync]:
    engine = EmbeddedEngine(make_tiny_model(seed=0), pad_token_id=2)
    sync = VerifiedSync(transport or InProcessSync(), "in-process", every=every)
    sync.connect(engine)
    return engine, sync


class SkipsOneTensor(InProcessSync):
    """A faulty in-process transport: every tensor but the norm reaches the engine."""

    async def update(self, weights, version: int) -> Receipt:
        kept = {n: t for n, t in weights.items() if n != NORM}
        return Receipt(await self.pool.update_weights(kept, version=version, strict=False))


class NeverArrives(InProcessSync):
    """A faulty in-process transport: the engine is labelled with the version, and nothing is loaded."""

    async def update(self, weights, version: int) -> Receipt:
        self.pool.weight_version = version
        return Receipt(version)


@pytest.mark.timeout(60)
def test_in_process_the_check_passes_and_the_engine_holds_the_trainers_tensors():
    engine, sync = embedded()
    w1 = trained(5)
    w2 = stepped(w1)

    async def main():
        await sync.update(w1, 1)
        first = bare(await engine.tensor_digests())
        await sync.update(w2, 2)
        return first, bare(await engine.tensor_digests())

    first, second = asyncio.run(main())
    assert first == digests(w1) and second == digests(w2) and engine.weight_version == 2
    assert sync.seconds > 0  # (the check ran at both updates: every)
    assert engine.paused is None  # the engine decodes again after the check


@pytest.mark.timeout(60)
@pytest.mark.parametrize("faulty", [SkipsOneTensor, NeverArrives])
def test_in_process_a_skipped_restoration_fails_naming_the_engine_the_transport_and_the_tensor(faulty):
    # without the check the same fault is silent: the update returns, the engine holds stale tensors
    plain = EmbeddedEngine(make_tiny_model(seed=0), pad_token_id=2)
    transport = faulty()
    transport.connect(plain)
    w = stepped(trained(5))  # (the norm differs from the engine's: seed 0's and seed 5's are both ones)
    asyncio.run(transport.update(w, 1))
    assert plain.weight_version == 1 and bare(asyncio.run(plain.tensor_digests()))[NORM] != digests(w)[NORM]

    # checked: caught even where the skipped tensor equals what the engine held (seed 0's and 5's norm: ones),
    # which only the noise shows
    engine, sync = embedded(faulty())
    with pytest.raises(EngineReceiptError) as err:
        asyncio.run(sync.update(trained(5), 1))
    message = str(err.value)
    first = NORM if faulty is SkipsOneTensor else FIRST
    assert "the embedded engine does not hold what it was sent after the in-process update to version 1" in message
    assert f"the first {first!r}" in message and "leaves the noise in place" in message
    assert engine.paused is None  # resumed whatever failed


@pytest.mark.timeout(60)
def test_in_process_a_pause_the_rollout_holds_stays_its_own():
    engine, sync = embedded()

    async def main():
        await engine.pause("keep")  # (rollout.partial=keep pauses the engine around the update itself)
        await sync.update(trained(5), 1)
        return engine.paused

    assert asyncio.run(main()) == "keep" and engine.weight_version == 1


@pytest.mark.timeout(60)
def test_in_process_noise_that_does_not_land_fails_the_check_before_the_update(monkeypatch):
    async def nothing(self, noise, weights, loaded):
        return None

    monkeypatch.setattr(_Embedded, "corrupt", nothing)
    engine, sync = embedded()
    with pytest.raises(EngineReceiptError, match="the noise did not reach it") as err:
        asyncio.run(sync.update(trained(5), 1))
    assert "after the noise sent before the in-process update to version 1" in str(err.value)
    assert engine.weight_version == 0  # the update never ran


@pytest.mark.timeout(60)
def test_the_noise_differs_from_the_trainers_weights_in_every_tensor_and_is_reproducible():
    from strop.sync.verify import Noise, noise_seed

    w = trained(5)
    seeds = {n: noise_seed(1, 2, tensor_digest(t)) for n, t in w.items()}
    noise, again = Noise(w, seeds), Noise(w, dict(seeds))
    assert all(not torch.equal(noise[n], w[n]) for n in w)
    assert all(torch.equal(noise[n], again[n]) for n in w)
    assert torch.equal(noise["lm_head.weight"], noise[FIRST])  # tied names get the same noise


@pytest.mark.timeout(60)
def test_an_engine_sharing_the_trainers_tensors_is_refused_and_they_are_left_alone():
    model = make_tiny_model(seed=0)
    engine = EmbeddedEngine(model, pad_token_id=2, shared=True)
    sync = VerifiedSync(InProcessSync(), "in-process")
    sync.connect(engine)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="engine.share_weights"):
        asyncio.run(sync.update(model.state_dict(), 1))
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


# ---- strop serve: disk, delta and broadcast --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One `strop serve` process on the tiny model (seed 0's weights) for this module's transports."""
    weights = tmp_path_factory.mktemp("weights")
    srv = LocalServer(str(tiny_model_dir), free_port(), ["--threads=1", f"--weights-dir={weights}"]).start()
    try:
        srv.wait_healthy(120)
        yield srv, weights
    finally:
        srv.stop()


def served(server, form: str, every: bool = True) -> tuple[Router, VerifiedSync, WeightWriter]:
    """A router over the server, its transport ``form`` wrapped in the check."""
    srv, weights = server
    writer = WeightWriter(weights / form)
    transport = {
        "disk": lambda: DiskSync(writer),
        "delta": lambda: DeltaSync(writer),
        "broadcast": lambda: BroadcastSync(bucket_bytes=1 << 20, timeout_s=30),
    }[form]()
    sync = VerifiedSync(transport, form, every=every, writer=writer)
    engine = SGLangEngine(srv.url, require_checksum=True, timeout_s=60)
    return Router([engine], sync=sync, print_events=False), sync, writer


async def finish(router: Router) -> None:
    await router.sync.close()  # (broadcast: both sides leave the group)
    await router.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["disk", "delta", "broadcast"])
def test_strop_serve_the_check_passes_on_each_transport_and_the_server_holds_the_trainers_tensors(server, form):
    router, sync, writer = served(server, form)
    w1 = trained(11)
    w2 = stepped(w1)

    async def main():
        try:
            await router.update_weights(w1, version=1)
            first = bare(await router.engines[0].tensor_digests())
            await router.update_weights(w2, version=2)
            return first, bare(await router.engines[0].tensor_digests()), (router.bytes_sent, router.bytes_full)
        finally:
            await finish(router)

    first, second, (sent, full) = asyncio.run(main())
    assert first == digests(w1) and second == digests(w2)
    assert router.healthy == [True] and router.engines[0].weight_version == 2
    if form == "delta":  # after the noise the delta form sends every tensor, not just the changed norm
        assert sent == full > 0
    assert not list(writer.dir.glob("*-noise"))  # the noise file is gone once loaded


@pytest.mark.timeout(120)
def test_strop_serve_disk_an_update_that_never_arrives_fails_naming_the_server(server, monkeypatch):
    async def relabel(self, i):  # the server is labelled with the version; nothing is loaded (verl #7495)
        engine = self.pool.engines[i]
        await engine._call("POST", "/update_weight_version", json={"new_version": str(self.latest[2])})
        self.pool.move(i, "healthy", "loaded the current weights", await engine.get_weight_version())

    monkeypatch.setattr(DiskSync, "load", relabel)
    router, sync, _ = served(server, "disk")
    with pytest.raises(EngineReceiptError) as err:
        asyncio.run(_update_then_finish(router, trained(12), 3))
    message = str(err.value)
    assert f"SGLangEngine({server[0].url}) does not hold what it was sent after the disk update to version 3" in message
    assert f"the first {FIRST!r}" in message
    assert router.state == [DOWN] and not sync.holds_current(0)  # it never serves the noise


@pytest.mark.timeout(120)
def test_strop_serve_delta_that_ignored_the_noise_would_leave_it_and_the_check_fails(server, monkeypatch):
    async def kept_its_record(self, i):  # a delta form that still believes the server holds what it sent
        return None

    monkeypatch.setattr(DeltaSync, "overwritten", kept_its_record)
    router, sync, _ = served(server, "delta")
    w1 = trained(13)

    async def main():
        await router.update_weights(w1, version=4)  # the first delta sends everything anyway: it passes
        await router.update_weights(stepped(w1), version=5)  # then only the norm: the noise stays elsewhere

    with pytest.raises(EngineReceiptError) as err:
        asyncio.run(_then_finish(router, main()))
    message = str(err.value)
    assert (
        f"SGLangEngine({server[0].url}) does not hold what it was sent after the delta update to version 5" in message
    )
    assert f"19 of 20 tensors differ, the first {FIRST!r}" in message  # the norm alone went


@pytest.mark.timeout(120)
def test_strop_serve_broadcast_that_skips_a_tensor_passes_its_own_receipt_and_fails_the_check(server, monkeypatch):
    def without_norm(manifest, bucket_bytes):  # a plan that leaves one tensor out: both digests agree
        return plan_buckets([m for m in manifest if m[0] != NORM], bucket_bytes)

    monkeypatch.setattr(broadcast_module, "plan_buckets", without_norm)
    w = trained(14)
    plain = Router(
        [SGLangEngine(server[0].url, require_checksum=True)], sync=BroadcastSync(timeout_s=30), print_events=False
    )

    async def unchecked():  # without the check: the update and its receipt pass, the norm is stale
        await plain.update_weights(w, version=6)
        return bare(await plain.engines[0].tensor_digests())

    held = asyncio.run(_then_finish(plain, unchecked()))
    assert plain.healthy == [True] and held[NORM] != digests(w)[NORM] and held[FIRST] == digests(w)[FIRST]

    router, sync, _ = served(server, "broadcast")
    with pytest.raises(EngineReceiptError) as err:
        asyncio.run(_update_then_finish(router, w, 7))
    message = str(err.value)
    assert (
        f"SGLangEngine({server[0].url}) does not hold what it was sent after the broadcast update to version 7"
        in message
    )
    assert f"1 of 20 tensors differ, the first {NORM!r}" in message


async def _then_finish(router: Router, work):
    try:
        return await work
    finally:
        await finish(router)


async def _update_then_finish(router: Router, weights: dict, version: int):
    return await _then_finish(router, router.update_weights(weights, version=version))


# ---- a run ----------------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_run_checks_its_first_update_and_a_skipped_tensor_fails_its_step(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    def config(name: str):
        return build_config(
            overrides=tiny_overrides(tiny_model_dir, tmp_path / name, engine={"verify_updates": "first"})
        )

    summary = train(config("good"))
    out = capsys.readouterr().out
    assert summary["status"] == "completed"
    assert out.count("restored bit for bit by the in-process update") == 1  # the first update only
    assert "strop: engine.verify_updates=first: before the first weight update" in out

    monkeypatch.setattr(InProcessSync, "update", SkipsOneTensor.update)
    with pytest.raises(EngineReceiptError, match=rf"the embedded engine does not hold .* the first {NORM!r}"):
        train(config("skipped"))
