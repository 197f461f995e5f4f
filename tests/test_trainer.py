import copy
import math

import torch

from strop.train.trainer import Trainer
from strop.types import Sample, Status


def make_samples(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(2, 6, (1,), generator=g))
        R = int(torch.randint(1, 7, (1,), generator=g))
        s = Sample(prompt="p", prompt_ids=torch.randint(3, 500, (P,), generator=g).tolist(), group_id=i // 4, index=i % 4)
        s.append(torch.randint(3, 500, (R,), generator=g).tolist(), (-torch.rand(R, generator=g)).tolist())
        if i % 3 == 0 and R > 1:
            s.loss_mask[-1] = 0  # a masked (tool-output-like) token
        s.status = Status.COMPLETED
        out.append(s)
    return out


def run_step(model, samples, advantages, **kw):
    # Adam divides by |grad|: near-zero gradients amplify rounding, so keep lr small for 1e-6 checks
    trainer = Trainer(model, pad_token_id=0, lr=1e-3, **kw)
    metrics = trainer.step(samples, advantages)
    return trainer.model, metrics


def test_micro_batches_equal_one_batch(tiny_model):
    samples = make_samples()
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 2.0, -2.0, 0.5, -0.25])
    one, m1 = run_step(copy.deepcopy(tiny_model), samples, adv, micro_batch_size=8)
    many, m3 = run_step(copy.deepcopy(tiny_model), samples, adv, micro_batch_size=3)
    assert math.isclose(m1["loss"], m3["loss"], rel_tol=1e-5, abs_tol=1e-7)
    assert math.isclose(m1["grad_norm"], m3["grad_norm"], rel_tol=1e-5)
    for (name, a), b in zip(one.named_parameters(), many.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_every_parameter_changes_and_metrics_are_finite(tiny_model):
    before = copy.deepcopy(tiny_model)
    adv = torch.tensor([1.0, -1.0] * 4)
    after, metrics = run_step(tiny_model, make_samples(), adv, micro_batch_size=4)
    for (name, a), b in zip(after.named_parameters(), before.parameters()):
        assert not torch.equal(a, b), f"{name} did not change"
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["clip_fraction"] == 0.0  # one update per rollout: ratio is exactly 1


def test_aborted_failed_and_zero_advantage_samples_do_not_change_the_update(tiny_model):
    samples = make_samples()
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 2.0, -2.0, 0.5, -0.25])
    extra = make_samples(3, seed=5)
    extra[0].status, extra[1].status = Status.ABORTED, Status.FAILED
    # reference: the clean samples plus one zero-advantage sample (it counts in the denominator)
    ref, m_ref = run_step(copy.deepcopy(tiny_model), samples + extra[2:], torch.cat([adv, torch.zeros(1)]),
                          micro_batch_size=4)
    # aborted and failed samples with huge advantages must change nothing
    mixed_adv = torch.cat([adv, torch.tensor([50.0, -50.0, 0.0])])
    skip, m_skip = run_step(copy.deepcopy(tiny_model), samples + extra, mixed_adv, micro_batch_size=4)
    full, m_full = run_step(copy.deepcopy(tiny_model), samples + extra, mixed_adv, micro_batch_size=4,
                            skip_zero_advantage=False)
    assert m_skip["trained_samples"] == 8 and m_full["trained_samples"] == 9
    for (name, a), b, c in zip(ref.named_parameters(), skip.parameters(), full.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6, msg=name)
