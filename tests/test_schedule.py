"""Learning-rate schedules (``train.lr_schedule``): hand-computed rates, the default unchanged, an exact resume,
and a skipped update that neither advances the schedule nor warns."""

import io
import math
import warnings

import pytest
import torch

from strop.config import AlgoConfig, TrainConfig
from strop.train.optim import GuardedOptimizer, lr_factor


class _Stats:
    def __init__(self):
        self.added = {}

    def add(self, key, value):
        self.added[key] = self.added.get(key, 0.0) + value


class _Plain:
    """The single-process strategy's two calls, without the trainer."""

    def after_backward(self, params):
        pass

    def clip_grad_norm(self, params, max_norm):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def _opt(train: TrainConfig, seed: int = 0) -> GuardedOptimizer:
    torch.manual_seed(seed)
    return GuardedOptimizer("policy", torch.nn.Linear(3, 2), train.lr, train, _Plain())


def _update(opt: GuardedOptimizer, nan: bool = False) -> float:
    """One update; returns the rate it used."""
    lr = opt.lr
    loss = opt.module(torch.ones(1, 3)).sum() * (float("nan") if nan else 1.0)
    loss.backward()
    opt.step(_Stats())
    return lr


def test_rates_by_hand():
    # warm-up 2 of 12 updates, floor 0.1: updates 0 and 1 warm up, 2 is the first at the full rate
    assert lr_factor(0, "cosine", 2, 12, 0.1) == pytest.approx(1 / 3)
    assert lr_factor(1, "cosine", 2, 12, 0.1) == pytest.approx(2 / 3)
    assert lr_factor(2, "cosine", 2, 12, 0.1) == pytest.approx(1.0)
    # update 4: progress (4-2)/(12-2) = 0.2; cosine 0.1 + 0.9 * 0.5 * (1 + cos(0.2 pi)) = 0.914058
    assert lr_factor(4, "cosine", 2, 12, 0.1) == pytest.approx(0.9140576, abs=1e-6)
    assert lr_factor(4, "linear", 2, 12, 0.1) == pytest.approx(0.82)  # 0.1 + 0.9 * 0.8
    assert lr_factor(7, "cosine", 2, 12, 0.1) == pytest.approx(0.55)  # half way: cos(pi/2) = 0
    assert lr_factor(12, "cosine", 2, 12, 0.1) == pytest.approx(0.1)  # the end, and past it: the floor
    assert lr_factor(30, "linear", 2, 12, 0.0) == 0.0
    assert lr_factor(0, "cosine", 0, 4) == 1.0 and lr_factor(2, "cosine", 0, 4) == pytest.approx(0.5)


def test_the_default_is_the_old_warm_up_then_constant():
    for warmup in (0, 2, 5):
        old = [min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0 for s in range(20)]
        opt = _opt(TrainConfig(lr=0.1, warmup_steps=warmup, steps=3))
        assert TrainConfig().lr_schedule == "constant"
        assert [_update(opt) for _ in range(20)] == pytest.approx([0.1 * f for f in old], rel=1e-12)


def test_cosine_spans_steps_times_mini_batches():
    train = TrainConfig(lr=0.2, warmup_steps=1, steps=3, mini_batches=2, lr_schedule="cosine", min_lr_ratio=0.25)
    opt = _opt(train)
    used = [_update(opt) for _ in range(7)]
    expected = [0.2 * lr_factor(s, "cosine", 1, 6, 0.25) for s in range(7)]
    assert used == pytest.approx(expected, rel=1e-12)
    assert used[1] == pytest.approx(0.2) and used[6] == pytest.approx(0.05)  # full after warm-up; the floor at 6


@pytest.mark.parametrize("with_optimizer_state", [True, False])
def test_resume_gives_the_same_rates(with_optimizer_state):
    train = TrainConfig(lr=0.1, warmup_steps=2, steps=10, lr_schedule="cosine", min_lr_ratio=0.1)
    straight = _opt(train)
    whole = [_update(straight) for _ in range(10)]
    first = _opt(train)
    head = [_update(first) for _ in range(4)]
    buf = io.BytesIO()  # through torch's safe loader, as checkpoints are read back
    torch.save({"optimizer": first.optimizer.state_dict(), "scheduler": first.scheduler.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _opt(train, seed=0)
    if with_optimizer_state:
        resumed.optimizer.load_state_dict(saved["optimizer"])
    resumed.scheduler.load_state_dict(saved["scheduler"])  # (the checkpoint restores it after the optimizer)
    tail = [_update(resumed) for _ in range(6)]
    assert head + tail == pytest.approx(whole, rel=1e-12)
    assert whole == pytest.approx([0.1 * lr_factor(s, "cosine", 2, 10, 0.1) for s in range(10)], rel=1e-12)


def test_a_skipped_update_keeps_the_rate_and_does_not_warn():
    opt = _opt(TrainConfig(lr=0.1, warmup_steps=3, steps=5, max_nonfinite_grad_steps=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" would raise
        skipped = _update(opt, nan=True)
        applied = [_update(opt) for _ in range(2)]
    assert opt.scheduler.last_epoch == 2  # two applied updates
    assert skipped == applied[0] == pytest.approx(0.1 / 4)  # the skipped update's rate is the next one's
    assert applied[1] == pytest.approx(0.1 * 2 / 4)


def test_the_lr_metric_is_the_rate_of_that_step(tiny_model):
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples

    train = TrainConfig(lr=1e-3, warmup_steps=0, steps=2, micro_batch_size=8, lr_schedule="cosine")
    trainer = Trainer(tiny_model, pad_token_id=0, train=train, algo=AlgoConfig(), rollout=Sampling(max_new_tokens=8))
    rates = [trainer.step(make_samples(seed=k))["lr"] for k in range(2)]
    assert rates == pytest.approx([1e-3, 0.5e-3])  # cos(0) then cos(pi/2): 1, then (1 + 0) / 2
    assert math.isclose(trainer.policy_opt.lr, 0.0, abs_tol=1e-15)  # the schedule ended at the floor
