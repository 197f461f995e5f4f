"""A trainer state saved under one layout resumes under another, resharded on load (torch.distributed.checkpoint):
saved on a (dp 2, tp 2) FSDP mesh of 4 ranks, resumed by 4 FSDP ranks without tensor parallel and by one process.
The loaded weights and AdamW state are the saved ones bit for bit; one more step then equals the saving layout's."""

import pytest

from strop.parallel.launch import run_on_ranks


def _trainer(world, tp, mode):
    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy
    from strop.train.trainer import Sampling, Trainer
    from tests.tiny import make_tiny_qwen3

    strategy = SingleProcess()
    if world > 1:
        dims = ParallelDims(world, tp=tp, dp_mode=mode, bucket_bytes=1 << 20)
        strategy = make_strategy(dims, dims.build_mesh("cpu"))
    return Trainer(
        make_tiny_qwen3(1024),
        pad_token_id=0,
        train=TrainConfig(lr=1e-4, warmup_steps=0, micro_batch_size=3),
        algo=AlgoConfig(),
        rollout=Sampling(max_new_tokens=8),
        parallel=strategy,
    )


def _state(trainer):
    """Every parameter and its AdamW moments, whole (collectives: every rank calls this)."""
    from tests.distributed.test_dp import _full

    out = {}
    for name, p in trainer.model.named_parameters():
        s = trainer.optimizer.state[p]
        out[name] = [
            _full(p.detach()).clone(),
            _full(s["exp_avg"]).clone(),
            _full(s["exp_avg_sq"]).clone(),
            float(s["step"]),
        ]
    return out


def _run(rank, world, tp, mode, folder, save):
    from pathlib import Path

    from strop import checkpoint
    from tests.test_trainer import make_samples

    trainer = _trainer(world, tp, mode)
    if save:
        trainer.step(make_samples(10))
        (Path(folder)).mkdir(exist_ok=True)
        checkpoint.save_trainer(Path(folder), trainer)
    else:
        checkpoint.load_trainer(Path(folder), trainer)
    at_save = _state(trainer)
    metrics = trainer.step(make_samples(10, seed=1))  # one more step
    return at_save, metrics, _state(trainer)


@pytest.mark.timeout(300)
def test_a_2x2_checkpoint_resumes_at_4x1_and_in_one_process(tmp_path):
    saved = run_on_ranks(_run, 4, 2, "fsdp", str(tmp_path / "ckpt"), True, timeout=250)[0]
    resumed = {
        "4x1": run_on_ranks(_run, 4, 1, "fsdp", str(tmp_path / "ckpt"), False, timeout=250)[0],
        "1x1": _run(0, 1, 1, "replicate", str(tmp_path / "ckpt"), False),
    }
    for layout, (loaded, metrics, after) in resumed.items():
        assert loaded.keys() == saved[0].keys()
        for name, (p, m, v, step) in loaded.items():  # resharded on load: the saved state exactly
            sp, sm, sv, sstep = saved[0][name]
            assert torch_equal(p, sp) and torch_equal(m, sm) and torch_equal(v, sv) and step == sstep, (layout, name)
        assert abs(metrics["loss"] - saved[1]["loss"]) <= 1e-6, (layout, metrics["loss"], saved[1]["loss"])
        assert max((after[n][0] - saved[2][n][0]).abs().max().item() for n in after) <= 1e-6, layout


def torch_equal(a, b):
    import torch

    return a.shape == b.shape and torch.equal(a, b)
