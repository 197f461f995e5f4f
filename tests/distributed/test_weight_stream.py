"""Weight sync from a sharded trainer (FSDP over 2 ranks, tensor parallel 2, FSDP 2 x TP 2): rank 0 reads the weights a bucket
at a time inside a controller session while the other rank serves the gathers (strop.parallel.gather); the
disk writer, the broadcast's bucket fill and the embedded engine get exactly the eagerly gathered weights,
and no read gathers more than one bucket (or one tensor larger than a bucket)."""

import pytest

from strop.parallel.launch import run_on_ranks

BUCKET = 16 << 10  # the tied embedding (1024 x 32 fp32 = 128 KiB) travels alone; the rest in 16 KiB buckets


def _sync(rank, world, mode, tp, folder):
    import asyncio

    from safetensors.torch import load_file

    from strop.config import AlgoConfig, TrainConfig
    from strop.serving.embedded import EmbeddedEngine
    from strop.sync.disk import WeightWriter
    from strop.wire.buckets import fill_bucket, manifest_of, plan_buckets
    from strop.parallel.gather import ShardedWeights
    from strop.parallel.runtime import Control
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import make_strategy
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples
    from tests.tiny import make_tiny_qwen3

    dims = ParallelDims(world, tp=tp, dp_mode=mode, bucket_bytes=1 << 20)
    trainer = Trainer(
        make_tiny_qwen3(1024, tie=True),
        pad_token_id=0,
        train=TrainConfig(lr=1e-3, warmup_steps=0),
        algo=AlgoConfig(),
        rollout=Sampling(max_new_tokens=8),
        parallel=make_strategy(dims, dims.build_mesh("cpu")),
    )
    trainer.step(make_samples(6))  # (weights that moved from their initial values)
    from strop.parallel import gather

    gather.ROWS_BYTES = 1 << 10  # tensors split evenly by rows gathered in blocks of a few rows (1 KiB)
    control = Control(60)
    weights = trainer.weights()
    assert isinstance(weights, ShardedWeights)

    def read():  # rank 0, inside the session: what each weight-sync path makes of the weights
        largest = []

        def measured(fn, *args):  # the most one read of ``fn`` gathered
            weights.largest = 0
            out = fn(*args)
            largest.append(weights.largest)
            return out

        path, checksum = measured(WeightWriter(folder, bucket_bytes=BUCKET).write, weights, 1)
        fills = measured(lambda: [fill_bucket(b, weights, "cpu") for b in plan_buckets(manifest_of(weights), BUCKET)])
        engine = EmbeddedEngine(make_tiny_qwen3(1024, seed=1, tie=True), pad_token_id=0, default_stop_token_ids=[2])
        engine.update_bucket_bytes = BUCKET
        measured(asyncio.run, engine.update_weights(weights, version=1))
        copied = {k: v.clone() for k, v in engine.model.state_dict().items()}
        return load_file(str(path / "model.safetensors")), checksum, fills, copied, weights.gathers, largest

    got = control.on_controller(read, share=False, serving=weights)
    outside = None
    if rank == 0:
        try:
            weights["model.norm.weight"]  # the session is over: nobody serves this gather
        except RuntimeError as exc:
            outside = str(exc)
    full = trainer.full_weights()  # the eager gather, every rank (the reference)
    if rank != 0:
        return None
    file, checksum, fills, copied, gathers, largest = got
    expected_fills = [fill_bucket(b, full, "cpu") for b in plan_buckets(manifest_of(full), BUCKET)]
    return {
        "file": file,
        "checksum": checksum,
        "fills": fills,
        "expected_fills": expected_fills,
        "copied": copied,
        "gathers": gathers,
        "largest": largest,
        "full": full,
        "outside": outside,
        "manifest": manifest_of(full),
        "names": list(full),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world,mode,tp", [(2, "fsdp", 1), (2, "replicate", 2), (4, "fsdp", 2)], ids=["fsdp2", "tp2", "fsdp2xtp2"]
)
def test_a_sharded_trainer_syncs_a_bucket_at_a_time(world, mode, tp, tmp_path):
    import torch

    from strop.wire.digest import state_checksum

    out = run_on_ranks(_sync, world, mode, tp, str(tmp_path), timeout=200)[0]
    full = out["full"]
    assert sorted(out["file"]) == sorted(full)  # every name, the tied lm_head too
    assert all(torch.equal(out["file"][n], full[n]) for n in full)
    assert out["checksum"] == state_checksum(full)
    assert len(out["fills"]) == len(out["expected_fills"]) > 2
    assert all(torch.equal(a, b) for a, b in zip(out["fills"], out["expected_fills"]))
    assert all(torch.equal(out["copied"][n], full[n]) for n in full)  # the engine holds the trainer's weights
    # bounded reads: none gathered more than a bucket, or one tensor larger than a bucket on its own
    sizes = {n: t.numel() * t.element_size() for n, t in full.items() if n != "lm_head.weight"}
    assert all(n <= max(BUCKET, max(sizes.values())) < sum(sizes.values()) / 1.5 for n in out["largest"])
    assert out["gathers"] > 3 * len(out["fills"]) / 2  # (three readers, each a bucket at a time)
    assert "outside their session" in out["outside"]


def _failing_read(rank, world):
    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.dims import ParallelDims
    from strop.parallel.runtime import Control, ControllerError
    from strop.parallel.strategy import make_strategy
    from strop.train.trainer import Trainer
    from tests.tiny import make_tiny_qwen3

    dims = ParallelDims(world, dp_mode="fsdp")
    trainer = Trainer(
        make_tiny_qwen3(1024),
        pad_token_id=0,
        train=TrainConfig(),
        algo=AlgoConfig(),
        parallel=make_strategy(dims, dims.build_mesh("cpu")),
    )
    weights, control = trainer.weights(), Control(60)

    def read_then_fail():
        weights.gather(["model.norm.weight"])
        raise OSError("disk full")  # (say, the writer's)

    try:
        control.on_controller(read_then_fail, serving=weights)
    except (OSError, ControllerError) as exc:
        seen = f"{type(exc).__name__}: {exc}"
    trainer.full_weights()  # every rank is out of the session and in step again: the next collective matches
    return seen


@pytest.mark.timeout(120)
def test_a_read_that_fails_ends_the_session_on_every_rank():
    """Rank 0's sync fails after a read: the other ranks leave their serving loop, every rank raises the failure
    (rank 0 its own, the others naming it), and the ranks' next collective still matches."""
    seen = run_on_ranks(_failing_read, 2, timeout=100)
    assert seen == ["OSError: disk full", "ControllerError: rank 0: OSError: disk full"]
