"""Weight sync by broadcast: the bucket plan, memory within one bucket, a real server receiving."""

import asyncio
import random

import pytest
import torch

from strop.wire.buckets import Bucket, first_mismatch, manifest_of, plan_buckets
from strop.sync.broadcast import BroadcastSync
from strop.parallel.launch import run_on_ranks
from tests.tiny import make_tiny_model

MiB = 1 << 20


@pytest.mark.parametrize("seed", range(6))
def test_buckets_carry_every_tensor_once_in_order_within_the_budget(seed):
    rng = random.Random(seed)
    manifest = [
        (
            f"t{i}",
            rng.choice(["float32", "bfloat16", "int64"]),
            tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3))),
        )
        for i in range(rng.randint(1, 14))
    ]
    budget = rng.choice([64, 256, 4096])
    buckets = plan_buckets(manifest, budget)
    carried = [(n, d, s) for b in buckets for n, d, s in zip(b.names, b.dtypes, b.shapes)]
    assert carried == manifest  # every tensor once, whole, in the trainer's order
    for b in buckets:
        size = sum(
            torch.Size(s).numel() * torch.empty((), dtype=getattr(torch, d)).element_size()
            for d, s in zip(b.dtypes, b.shapes)
        )
        assert b.nbytes == size
        if b.flattened:
            assert size <= budget
            at = 0
            for d, s in zip(b.dtypes, b.shapes):  # each tensor aligned to its element size (SGLang's view(dtype))
                item = torch.empty((), dtype=getattr(torch, d)).element_size()
                assert at % item == 0
                at += torch.Size(s).numel() * item
        else:  # only a tensor larger than the budget travels alone, as itself
            assert len(b.names) == 1 and size > budget
    for a, b in zip(buckets, buckets[1:]):  # a bucket closes only when the next tensor would overflow or misalign
        if a.flattened and b.flattened:
            first = b.nbytes if len(b.names) == 1 else Bucket(b.names[:1], b.dtypes[:1], b.shapes[:1], True).nbytes
            item = torch.empty((), dtype=getattr(torch, b.dtypes[0])).element_size()
            assert a.nbytes + first > budget or a.nbytes % item


def test_a_tensor_is_never_placed_at_an_offset_its_dtype_cannot_view():
    # 3 bf16 elements end at byte 6: an fp32 tensor after them would start unaligned (SGLang refuses it)
    buckets = plan_buckets([("a", "bfloat16", (3,)), ("b", "float32", (2,)), ("c", "float32", (1,))], 1000)
    assert [b.names for b in buckets] == [("a",), ("b", "c")]


@pytest.mark.parametrize(
    "fields, why",
    [
        ((["a", "b"], ["float32"], [[2], [2]], "flattened_bucket"), "one length"),
        ((["a"], ["float33"], [[2]], "flattened_bucket"), "unknown dtype 'float33'"),
        ((["a"], ["float32"], [[-2]], None), "non-negative"),
        ((["a", "b"], ["float32"] * 2, [[2], [2]], None), "carries one tensor"),
        ((["a"], ["float32"], [[2]], "direct"), "load_format 'direct'"),
        (([], [], [], None), "non-empty"),
    ],
)
def test_a_malformed_update_request_is_refused_naming_the_field(fields, why):
    with pytest.raises(ValueError, match=why):
        Bucket.from_payload(*fields)


def test_the_first_manifest_difference_is_named():
    ours = [("embed", "float32", (10, 4)), ("norm", "float32", (4,))]
    assert first_mismatch(ours, list(ours), "E") is None
    assert "E has no tensor 'norm'" in first_mismatch(ours, ours[:1], "E")
    assert "'embed': the trainer's shape is [10, 4], E's is [10, 5]" in first_mismatch(
        ours, [("embed", "float32", (10, 5)), ours[1]], "E"
    )
    assert "the trainer sends float32, E holds bfloat16 (set engine.sync_dtype='bfloat16'" in first_mismatch(
        ours, [ours[0], ("norm", "bfloat16", (4,))], "E"
    )
    assert "E holds 'extra', which the trainer does not send" in first_mismatch(
        ours, ours + [("extra", "float32", (1,))], "E"
    )
    # the first difference in the trainer's order is the one named
    assert "'embed'" in first_mismatch(ours, [("embed", "float32", (1,)), ("norm", "float32", (5,))], "E")


def test_manifest_skips_tied_weights():
    w = torch.zeros(4, 2)
    assert [m[0] for m in manifest_of({"embed": w, "head": w, "norm": torch.ones(2)})] == ["embed", "norm"]


SHAPES = [(3 * MiB // 4,), (1000,), (8 * MiB // 4,), (1 * MiB // 4, 2), (5 * MiB // 4,)]  # 8 MiB > the 2 MiB bucket


def _transfer(rank, world, port, bucket):
    import ctypes
    import resource

    # every large buffer a fresh mapping, returned when freed (set here: the environment variable
    # is read by glibc at start-up, before the launcher could set it in this process)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD

    from strop.wire.digest import StreamDigest
    from strop.wire.group import make_group, receive_bucket, send_bucket

    group = make_group("127.0.0.1", port, rank, 2, "gloo", 60, name="strop-test")
    torch.manual_seed(0)
    named = {f"t{i}": (torch.randn(s) if rank == 0 else torch.zeros(s)) for i, s in enumerate(SHAPES)}
    for t in named.values():
        t.add_(0)  # touch every page before the baseline
    warm = {"w": torch.zeros(bucket // 4)}  # warm the gloo path (its one-time buffers) with one bucket
    for b in plan_buckets(manifest_of(warm), bucket):
        send_bucket(group, b, warm, "cpu") if rank == 0 else receive_bucket(group, b, "cpu")
    digest = StreamDigest()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for b in plan_buckets(manifest_of(named), bucket):
        if rank == 0:
            send_bucket(group, b, named, "cpu", digest)
        else:  # the engine's copy out of the bucket (a lone tensor lands in place)
            for name, t in receive_bucket(group, b, "cpu", into=named, digest=digest):
                if t.data_ptr() != named[name].data_ptr():
                    named[name].copy_(t)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return after - before, {k: float(v.double().sum()) for k, v in named.items()}, digest.hexdigest()


@pytest.mark.timeout(120)
def test_broadcast_moves_every_weight_with_one_bucket_of_extra_memory():
    from strop.process import free_port

    bucket = 2 * MiB
    (extra0, sums0, digest0), (extra1, sums1, digest1) = run_on_ranks(_transfer, 2, free_port(), bucket, timeout=100)
    assert sums0 == sums1 and digest0 == digest1  # the receiver holds exactly the sender's weights
    largest = max(torch.Size(s).numel() * 4 for s in SHAPES)
    for extra in (extra0, extra1):  # the 8 MiB tensor went without a copy on either side
        assert extra <= bucket + 1.5 * MiB, (extra / MiB, "MiB")  # + 1.5 MiB for allocator and gloo bookkeeping
    assert bucket + 1.5 * MiB < largest  # the bound is below the largest tensor


@pytest.mark.timeout(240)
def test_a_server_receives_broadcast_weights(start_server):
    from strop.engines.sglang import SGLangEngine
    from tests.tiny import make_tiny_model

    server = start_server()
    engine = SGLangEngine(server.url)
    sync = BroadcastSync(bucket_bytes=256 * 1024)
    state = make_tiny_model(seed=11).state_dict()

    async def main():
        sent, reported = await sync.send([engine], state, version=4)
        version = await engine.get_weight_version()
        await engine.close()
        return sent, reported, version

    sent, reported, version = asyncio.run(main())
    assert version == 4 and reported == [4]
    unique = {n: t for n, t in state.items() if n != "lm_head.weight"}  # tied to the embedding
    assert sent == sum(t.numel() * 4 for t in unique.values())
    # the server now generates with exactly these weights: same greedy logprobs as a local model
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    local = make_tiny_model(seed=11)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[-1])
    want = EmbeddedEngine(local, pad_token_id=0).generate_batch([[5, 6, 7]], greedy)[0]
    got = asyncio.run(SGLangEngine(server.url).generate([5, 6, 7], greedy))
    assert got.token_ids == want.token_ids and got.weight_version == 4
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5


@pytest.mark.timeout(240)
def test_delta_sync_sends_only_changed_tensors_and_checks_them(start_server, tmp_path):
    from strop.serving.embedded import EmbeddedEngine
    from strop.wire.errors import EngineRequestError
    from strop.engines.sglang import SGLangEngine
    from strop.sync.delta import DeltaSync
    from strop.sync.disk import WeightWriter
    from strop.engines.router import Router
    from strop.types import SamplingParams
    from tests.tiny import make_tiny_model

    server = start_server()
    writer = WeightWriter(tmp_path / "w")
    router = Router([SGLangEngine(server.url, writer=writer)], sync=DeltaSync(writer))
    model = make_tiny_model(seed=5)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4, stop_token_ids=[-1])

    async def main():
        await router.update_weights(model.state_dict(), version=1)
        first = (router.bytes_sent, router.bytes_full)
        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)  # one tensor changes
        await router.update_weights(model.state_dict(), version=2)
        second = (router.bytes_sent, router.bytes_full)
        got = await router.generate([5, 6, 7], greedy)
        # a corrupted file is refused: its digest does not match what the trainer announced
        path, _ = writer.write({"model.norm.weight": torch.zeros(32)}, 3, tag="-bad")
        with pytest.raises(EngineRequestError, match="checksum"):
            await router.engines[0].load_weights(path, 3, digests={"model.norm.weight": "0" * 32})
        await router.close()
        return first, second, got

    first, second, got = asyncio.run(main())
    assert first[0] == first[1]  # the first sync sends everything
    assert second == (32 * 4, first[1])  # then only the 32 floats of the changed norm
    want = EmbeddedEngine(model, pad_token_id=0).generate_batch([[5, 6, 7]], greedy)[0]
    assert got.token_ids == want.token_ids and got.weight_version == 2
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < 1e-5


async def holds(engine) -> tuple[int, str]:
    """The version a strop serve reports and the checksum of the tensors it holds (its /weights_checker)."""
    out = await engine._call("POST", "/weights_checker", json={"action": "checksum"})
    return await engine.get_weight_version(), out["checksum"]


@pytest.mark.timeout(120)
def test_an_engine_that_leaves_the_set_has_its_group_torn_down_on_both_sides(start_server, monkeypatch):
    import strop.sync.broadcast as sync_module
    from strop.engines.sglang import SGLangEngine
    from strop.wire.digest import state_checksum

    closed, left = [], []
    close = sync_module.close_group
    monkeypatch.setattr(sync_module, "close_group", lambda g: (closed.append(g), close(g)))
    a, b = (SGLangEngine(start_server().url, require_checksum=True) for _ in range(2))
    for e in (a, b):
        leave = e.leave_group
        e.leave_group = lambda name, e=e, leave=leave: (left.append((e, name)), leave(name))[1]
    sync = BroadcastSync(bucket_bytes=1 << 16, timeout_s=30)
    state = make_tiny_model(seed=3).state_dict()

    async def main():
        first = await sync.send([a, b], state, version=1)
        links = dict(sync.links)
        second = await sync.send([a], state, version=2)  # b left the set
        return first, second, links, await holds(a)

    first, second, links, receipt = asyncio.run(main())
    assert left == [(b, links[b].name)] and closed == [links[b].group]  # b's group, on both sides
    assert sync.links == {a: links[a]}  # a keeps its own
    assert first[1] == [1, 1] and second[1] == [2]
    assert receipt == (2, state_checksum({n: t for n, t in state.items() if n != "lm_head.weight"}))


@pytest.mark.timeout(300)
def test_an_engine_killed_mid_broadcast_is_dropped_the_others_complete_and_it_rejoins_after_a_full_update(start_server):
    import time

    from strop.engines.sglang import SGLangEngine
    from strop.wire.digest import state_checksum
    from strop.engines.health import DOWN, HEALTHY, REJOINING
    from strop.engines.router import Router
    from tests.tiny import make_tiny_model

    servers = [start_server() for _ in range(3)]
    engines = [SGLangEngine(s.url, require_checksum=True, timeout_s=60) for s in servers]
    router = Router(engines, sync=BroadcastSync(bucket_bytes=64 * 1024, timeout_s=20), print_events=False)
    victim, calls = engines[1], []
    receive = victim.receive_bucket

    async def dying(bucket, group_name, version, last):
        calls.append(version)
        if calls.count(1) == 3:  # version 1's third bucket: its server dies before taking it
            servers[1].kill()
        return await receive(bucket, group_name, version, last)

    victim.receive_bucket = dying
    w1, w2 = make_tiny_model(seed=21).state_dict(), make_tiny_model(seed=22).state_dict()
    want = {v: state_checksum({n: t for n, t in w.items() if n != "lm_head.weight"}) for v, w in ((1, w1), (2, w2))}

    async def receipts():
        return [await holds(e) if router.state[i] == HEALTHY else None for i, e in enumerate(engines)]

    async def main():
        t0 = time.monotonic()
        await router.update_weights(w1, version=1)
        first = (time.monotonic() - t0, list(router.state), await receipts())
        start_server(servers[1].port)  # the dead engine comes back (initial weights, version 0)
        await router.check_health()
        back = list(router.state)
        await router.update_weights(w2, version=2)
        return first, back, list(router.state), await receipts()

    (seconds, after_first, first_receipts), back, after_second, second_receipts = asyncio.run(main())
    assert after_first == [HEALTHY, DOWN, HEALTHY] and seconds < 20  # no wait outlived the group's timeout
    assert [r for r in first_receipts if r] == [(1, want[1])] * 2  # the others completed version 1
    assert back == [HEALTHY, REJOINING, HEALTHY]  # it answers again, but gets the weights before serving
    assert after_second == [HEALTHY] * 3 and second_receipts == [(2, want[2])] * 3


@pytest.mark.timeout(120)
def test_an_engine_that_answers_a_bucket_without_taking_its_broadcast_is_refused_at_once(start_server):
    # tokenspeed#1373's trap: a server whose group is not the trainer's answers the update call and loads
    # whatever its buffer held. Here the client answers without the server ever joining the broadcast.
    import time

    from strop.wire.errors import EngineReceiptError
    from strop.engines.sglang import SGLangEngine

    engine = SGLangEngine(start_server().url, require_checksum=True)

    async def answered(bucket, group_name, version, last):
        return None

    engine.receive_bucket = answered
    sync = BroadcastSync(bucket_bytes=1 << 20, timeout_s=100)
    state = make_tiny_model(seed=4).state_dict()  # (its 6 MiB embedding travels alone: more than a socket holds)

    async def main():
        t0 = time.monotonic()
        sent, results = await sync.send([engine], state, version=1)
        return time.monotonic() - t0, results

    seconds, results = asyncio.run(main())
    assert isinstance(results[0], EngineReceiptError) and "SGLangEngine" in str(results[0])
    assert seconds < 30  # not the group's 100 s timeout


@pytest.mark.timeout(120)
def test_bytes_changed_on_the_way_fail_the_receipt_naming_the_engine(start_server, monkeypatch):
    import strop.sync.broadcast as sync_module
    from strop.wire.errors import EngineReceiptError
    from strop.engines.sglang import SGLangEngine

    engine = SGLangEngine(start_server().url, require_checksum=True)
    send, corrupt = sync_module._broadcast, {"on": False}

    def broadcast(group, buf):  # one byte of what travels differs from what the trainer hashed
        if corrupt["on"] and buf.dtype == torch.uint8:
            buf = buf.clone()
            buf[0] ^= 1
        send(group, buf)

    monkeypatch.setattr(sync_module, "_broadcast", broadcast)
    sync = BroadcastSync(bucket_bytes=1 << 16, timeout_s=30)
    state = make_tiny_model(seed=5).state_dict()

    async def main():
        clean = await sync.send([engine], state, version=1)
        corrupt["on"] = True
        return clean, await sync.send([engine], state, version=2)

    (_, clean), (_, corrupted) = asyncio.run(main())
    assert clean == [1]
    assert isinstance(corrupted[0], EngineReceiptError)
    assert f"SGLangEngine({engine.url}): the update to version 2 arrived as crc32:" in str(corrupted[0])
