import copy
import math

import pytest
import torch

from strop.config import AlgoConfig, TrainConfig
from strop.parallel.strategy import SingleProcess
from strop.train.trainer import Sampling, Trainer
from strop.types import Sample, Status


def make_samples(n=8, seed=0, group_size=4):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        P = int(torch.randint(2, 6, (1,), generator=g))
        R = int(torch.randint(1, 7, (1,), generator=g))
        s = Sample(
            prompt="p",
            prompt_ids=torch.randint(3, 500, (P,), generator=g).tolist(),
            group_id=i // group_size,
            index=i % group_size,
        )
        s.append(torch.randint(3, 500, (R,), generator=g).tolist(), (-torch.rand(R, generator=g) - 5).tolist())
        if i % 3 == 0 and R > 1:
            s.loss_mask[-1] = 0  # a masked (tool-output-like) token
        s.status = Status.COMPLETED
        s.reward = float(torch.rand(1, generator=g))
        out.append(s)
    return out


def near_policy(model, samples, noise=0.3, seed=1):
    """``samples`` with rollout logprobs the model's own plus Gaussian noise of ``noise`` (an engine a little
    off the trainer, or a few versions behind), instead of make_samples' arbitrary ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float()
            P = len(s.prompt_ids)
            own = logits[P - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(s.response_ids).unsqueeze(-1)).squeeze(-1)
            s.rollout_logprobs = (own + noise * torch.randn(len(own), generator=g)).tolist()
    return samples


def run_step(
    model,
    samples,
    *,
    micro_batch_size=8,
    mini_batches=1,
    max_tokens=None,
    device="cpu",
    bf16_autocast=False,
    exact_logprobs=False,
    logprob_chunk_size=1024,
    shared_prefix=False,
    **algo,
):
    # Adam divides by |grad|: near-zero gradients amplify rounding, so keep lr small for 1e-6 checks
    train = TrainConfig(
        lr=1e-3,
        warmup_steps=0,
        micro_batch_size=micro_batch_size,
        mini_batches=mini_batches,
        max_tokens_per_micro_batch=max_tokens,
        bf16_autocast=bf16_autocast,
        logprob_chunk_size=logprob_chunk_size,
        shared_prefix=shared_prefix,
    )
    trainer = Trainer(
        model,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(**algo),
        rollout=Sampling(max_new_tokens=8, exact_logprobs=exact_logprobs),
        parallel=SingleProcess(device),
    )
    metrics = trainer.step(samples)
    return trainer, metrics


def assert_same_params(a, b, atol=1e-6):
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        assert (x - y).abs().max().item() <= atol, name


def assert_same_gradients(opt_a, opt_b, rel=1e-5):
    """After one AdamW step exp_avg = (1 - beta1) * clipped gradient: compare gradients exactly.

    (Parameters after Adam are a poor comparator: Adam divides by |g|, so rounding
    in gradients of ~1e-10 becomes an lr-sized difference.)"""
    for pa, pb in zip(opt_a.param_groups[0]["params"], opt_b.param_groups[0]["params"]):
        ga, gb = opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"]
        scale = ga.abs().max().item()
        assert (ga - gb).abs().max().item() <= rel * scale + 1e-12


def assert_same_update(a, b, rel=1e-5):
    """Two (trainer, metrics) results of one step: same loss, grad norm and gradients (critic too), within
    ``rel`` of each."""
    (ta, ma), (tb, mb) = a, b
    assert math.isclose(ma["loss"], mb["loss"], rel_tol=rel, abs_tol=1e-6)
    assert math.isclose(ma["grad_norm"], mb["grad_norm"], rel_tol=rel)
    assert_same_gradients(ta.optimizer, tb.optimizer, rel)
    if ta.critic is not None:
        assert math.isclose(ma["value_loss"], mb["value_loss"], rel_tol=rel)
        assert_same_gradients(ta.critic_optimizer, tb.critic_optimizer, rel)


PRESET_LIKE = [
    dict(),
    dict(estimator="dr_grpo", loss_agg="seq_mean_token_sum_norm"),
    dict(loss_agg="seq_mean_token_mean", kl_coef=0.1, kl_kind="k3"),
    dict(estimator="rloo", clip_high=0.28, dual_clip=3.0),
    dict(policy_loss="gspo", loss_agg="seq_mean_token_mean"),
    dict(policy_loss="cispo", clip_low=1.0, clip_high=0.28, entropy_coef=0.01),
    dict(estimator="reinforce_pp", kl_in_reward_coef=0.05, kl_coef=0.0),
    dict(estimator="reinforce_pp_baseline", kl_coef=0.05, kl_kind="k2", ref_mode="swap"),
    dict(estimator="ppo", kl_in_reward_coef=0.01),
    dict(use_rollout_logprobs=True),
    dict(tis_cap=2.0, mis_low=1e-3, mis_high=2.0),  # (with use_rollout_logprobs this is refused: a no-op)
]


@pytest.mark.parametrize("algo", PRESET_LIKE, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_update_does_not_depend_on_the_micro_batch_split(tiny_model, algo, mode):
    samples = make_samples()
    algo = {**algo, "loss_agg": mode}
    one = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=8, **algo)
    four = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=2, **algo)
    assert_same_update(one, four)


def test_every_parameter_changes_and_metrics_are_finite(tiny_model):
    before = copy.deepcopy(tiny_model)
    trainer, metrics = run_step(tiny_model, make_samples(), micro_batch_size=4)
    for (name, a), b in zip(trainer.model.named_parameters(), before.parameters()):
        assert not torch.equal(a, b), f"{name} did not change"
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["clip_fraction"] == 0.0  # one update per rollout: ratio is exactly 1


def test_aborted_failed_and_zero_advantage_samples_do_not_change_the_update(tiny_model):
    samples = make_samples()
    extra = make_samples(3, seed=5, group_size=1)  # groups of one: advantage exactly 0
    for s in extra:
        s.group_id += 100
    extra[0].status, extra[1].status = Status.ABORTED, Status.FAILED
    extra[0].reward, extra[1].reward = 50.0, -50.0
    ref, _ = run_step(copy.deepcopy(tiny_model), samples + extra[2:], micro_batch_size=4)
    mixed, m = run_step(copy.deepcopy(tiny_model), samples + extra, micro_batch_size=4)
    assert m["trained_samples"] == 8  # the zero-advantage sample is not even forwarded
    assert_same_params(ref.model, mixed.model)


def test_mini_batches_take_several_optimizer_steps_and_clip(tiny_model):
    trainer, m = run_step(
        tiny_model, make_samples(16), micro_batch_size=4, mini_batches=4, clip_high=0.001, clip_low=0.001
    )
    assert trainer.scheduler.last_epoch == 4  # four optimizer steps in one trainer step
    # later mini-batches see a moved policy: ratios leave the tiny clip range
    assert m["clip_fraction"] > 0 and m["approx_kl_old"] > 0


def test_ppo_critic_value_loss_falls(tiny_model):
    samples = make_samples()
    train = TrainConfig(lr=1e-4, warmup_steps=0, micro_batch_size=4)
    trainer = Trainer(
        tiny_model,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(estimator="ppo", critic_lr=1e-2, kl_in_reward_coef=0.0),
        rollout=Sampling(max_new_tokens=8),
    )
    metrics = [trainer.step(samples) for _ in range(6)]
    losses = [m["value_loss"] for m in metrics]
    assert losses[-1] < 0.5 * losses[0], losses
    # the zero-initialised critic explains nothing at first, then more and more of the returns
    assert metrics[0]["value_explained_variance"] <= 0.0 < metrics[-1]["value_explained_variance"]


def test_swap_and_copy_reference_give_the_same_kl(tiny_model):
    samples = make_samples()
    a, ma = run_step(copy.deepcopy(tiny_model), samples, kl_coef=0.5, ref_mode="copy")
    b, mb = run_step(copy.deepcopy(tiny_model), samples, kl_coef=0.5, ref_mode="swap")
    assert ma["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # before any update pi == pi_ref
    assert_same_params(a.model, b.model)
    # after the step the training module holds its own (updated) weights again, not the reference
    assert not torch.equal(b.model.model.embed_tokens.weight, b.ref_state["model.embed_tokens.weight"])


def _exact_rollout_logprobs(model, samples, temperature=1.0):
    """The trainer's own logprobs of each sample's response (what a perfect engine reports)."""
    from strop.train.batch import collate
    from strop.train.logprob import response_logprobs

    batch = collate(samples, 0)
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, batch["input_ids"], batch["attention_mask"], batch["positions"], temperature=temperature
        )
    return [lp[i, : s.response_length].tolist() for i, s in enumerate(samples)]


def test_tis_changes_the_update_when_rollout_logprobs_differ(tiny_model):
    """The engine sampled from a slightly different policy: TIS reweights tokens by min(pi_old/pi_rollout, C)."""
    samples = make_samples()
    exact = _exact_rollout_logprobs(tiny_model, samples)
    g = torch.Generator().manual_seed(3)
    for s, lp in zip(samples, exact):  # the engine's numbers are off by up to +-1 nat
        s.rollout_logprobs = [x + float(torch.rand(1, generator=g)) * 2 - 1 for x in lp]
    plain, mp = run_step(copy.deepcopy(tiny_model), samples)
    tis, mt = run_step(copy.deepcopy(tiny_model), samples, tis_cap=1.5)
    assert mt["importance_weight_mean"] != pytest.approx(1.0, abs=1e-3)
    assert not math.isclose(mp["loss"], mt["loss"], rel_tol=1e-4)
    assert any(not torch.allclose(a, b) for a, b in zip(plain.model.parameters(), tis.model.parameters()))
    # with the engine exactly on-policy the weight is 1 and TIS changes nothing
    for s, lp in zip(samples, exact):
        s.rollout_logprobs = lp
    plain, mp = run_step(copy.deepcopy(tiny_model), samples)
    tis, mt = run_step(copy.deepcopy(tiny_model), samples, tis_cap=1.5)
    assert mt["importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert_same_params(plain.model, tis.model)


def test_logprob_gap_metric_skips_loss_masked_tokens(tiny_model):
    """Tokens with loss mask 0 (tool output, a plugin's prefix) may carry any engine logprob: the gap
    metric must average over trainable tokens only."""
    samples = make_samples()
    exact = _exact_rollout_logprobs(tiny_model, samples)
    masked = 0
    for s, lp in zip(samples, exact):
        s.rollout_logprobs = [x if m else 0.0 for x, m in zip(lp, s.loss_mask)]  # garbage where masked
        masked += s.loss_mask.count(0)
    assert masked > 0
    _, m = run_step(copy.deepcopy(tiny_model), samples)
    assert m["train_rollout_logprob_abs_diff"] < 1e-5
    _, m2 = run_step(copy.deepcopy(tiny_model), samples, mini_batches=2)  # the pre-pass path too
    assert m2["train_rollout_logprob_abs_diff"] < 1e-5


@pytest.mark.parametrize("mini_batches,micro_batch_size", [(1, 8), (2, 3)])
def test_exact_logprobs_make_the_gap_exactly_zero(tiny_model, mini_batches, micro_batch_size):
    """rollout.exact_logprobs: the trainer's own forward becomes the rollout's logprobs, bitwise, in
    the batch and in each sample; the engine's gap it replaced is reported on its own."""
    samples = make_samples()
    exact = _exact_rollout_logprobs(tiny_model, samples)
    g = torch.Generator().manual_seed(5)
    for s, lp in zip(samples, exact):  # an engine a few 1e-6 off, as a real one is
        s.rollout_logprobs = [x + float(torch.randn(1, generator=g)) * 3e-6 for x in lp]
    _, plain = run_step(
        copy.deepcopy(tiny_model), copy.deepcopy(samples), mini_batches=mini_batches, micro_batch_size=micro_batch_size
    )
    assert plain["train_rollout_logprob_abs_diff"] > 0 and "engine_logprob_abs_diff" not in plain
    _, m = run_step(
        copy.deepcopy(tiny_model),
        samples,
        mini_batches=mini_batches,
        micro_batch_size=micro_batch_size,
        exact_logprobs=True,
    )
    assert m["train_rollout_logprob_abs_diff"] == 0.0
    assert 1e-7 < m["engine_logprob_abs_diff"] < 1e-4
    for s, lp in zip(samples, exact):  # the samples now carry the trainer's numbers
        torch.testing.assert_close(torch.tensor(s.rollout_logprobs), torch.tensor(lp), rtol=0, atol=1e-5)


def test_exact_logprobs_are_refused_where_the_trainer_did_not_sample():
    from strop.config import Config

    with pytest.raises(ValueError, match="exact_logprobs.*sync mode.*rollout.mode='async'"):
        Config.model_validate(
            {"rollout": {"exact_logprobs": True, "mode": "async"}, "algo": {"off_policy_correction": "none"}}
        )
    with pytest.raises(ValueError, match="exact_logprobs.*data.samples"):
        Config.model_validate({"rollout": {"exact_logprobs": True}, "data": {"samples": "s.jsonl"}})
    assert Config.model_validate({"rollout": {"exact_logprobs": True}}).rollout.exact_logprobs


def test_loss_metrics_are_means_over_mini_batches(tiny_model):
    """policy_loss / loss / value_loss are the step's mean over mini-batches, not their sum."""
    half = make_samples(8)
    samples = half + copy.deepcopy(half)  # two identical mini-batches: each one's loss is the whole batch's

    def step(mini_batches, **algo):  # a tiny learning rate: the second mini-batch sees the same weights
        train = TrainConfig(lr=1e-12, warmup_steps=0, micro_batch_size=4, mini_batches=mini_batches)
        trainer = Trainer(
            copy.deepcopy(tiny_model),
            pad_token_id=0,
            train=train,
            algo=AlgoConfig(**algo),
            rollout=Sampling(max_new_tokens=8),
        )
        return trainer.step(samples)

    for algo, names in (({}, ("policy_loss", "loss")), ({"estimator": "ppo", "critic_lr": 1e-12}, ("value_loss",))):
        one, two = step(1, **algo), step(2, **algo)
        for name in names:
            assert abs(one[name]) > 1e-3, name
            assert two[name] == pytest.approx(one[name], rel=1e-3), name  # the sum would be 2x


def test_non_finite_gradients_are_counted_then_stop_the_run(tiny_model):
    from strop.train.trainer import NonFiniteGradientError

    train = TrainConfig(lr=1e-3, warmup_steps=0, micro_batch_size=8, max_nonfinite_grad_steps=2)
    trainer = Trainer(tiny_model, pad_token_id=0, train=train, algo=AlgoConfig(), rollout=Sampling(max_new_tokens=8))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(float("nan"))  # every forward is NaN from here
    m = trainer.step(make_samples())
    assert m["nonfinite_grad_norm_steps"] == 1 and not math.isfinite(m["grad_norm"])
    for p, b in zip(list(trainer.model.parameters())[:1], before[:1]):
        assert torch.equal(p, b)  # the embedding was not updated with NaN
    with pytest.raises(NonFiniteGradientError, match="2 optimizer steps in a row"):
        trainer.step(make_samples())


def test_non_finite_reward_is_refused_by_the_trainer(tiny_model):
    samples = make_samples()
    samples[3].reward = float("nan")
    trainer = Trainer(
        tiny_model, pad_token_id=0, train=TrainConfig(), algo=AlgoConfig(), rollout=Sampling(max_new_tokens=8)
    )
    with pytest.raises(ValueError, match=r"sample 3 .*reward nan; rewards must be finite"):
        trainer.step(samples)


def test_full_weights_are_copies_not_live_aliases(tiny_model, device):
    train = TrainConfig(lr=1e-2, warmup_steps=0)
    trainer = Trainer(
        tiny_model,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(),
        rollout=Sampling(max_new_tokens=8),
        parallel=SingleProcess(device),
    )
    weights = trainer.full_weights()
    snapshot = {k: v.clone() for k, v in weights.items()}
    assert all(v.device.type == torch.device(device).type for v in weights.values())  # stays on the device
    trainer.step(make_samples())
    for k, v in weights.items():
        assert torch.equal(v, snapshot[k]), f"{k} changed under the reader"
    assert not torch.equal(trainer.full_weights()["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])
    # tied embedding / lm_head still share one copy
    assert weights["lm_head.weight"].data_ptr() == weights["model.embed_tokens.weight"].data_ptr()


def test_trainer_runs_on_the_fixture_device(tiny_model, device):
    trainer, m = run_step(tiny_model, make_samples(), device=device)
    assert all(p.device.type == torch.device(device).type for p in trainer.model.parameters())
    state = trainer.optimizer.state[next(trainer.model.parameters())]["exp_avg"]
    assert state.device.type == torch.device(device).type and math.isfinite(m["loss"])


def test_bf16_autocast_keeps_fp32_master_weights(tiny_model, device):
    trainer, m = run_step(copy.deepcopy(tiny_model), make_samples(), device=device, bf16_autocast=True)
    _, ref = run_step(copy.deepcopy(tiny_model), make_samples(), device=device)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert m["loss"] == pytest.approx(ref["loss"], rel=0.05, abs=1e-3)  # bf16 compute, same step


def test_activation_checkpointing_recomputes_each_layer_and_changes_nothing():
    """train.activation_checkpointing: every decoder layer runs again in backward (its MLP's activation once
    more per micro-batch that trains), and the step's loss, gradient norm and updated weights are the same."""
    from tests.tiny import make_tiny_model

    samples = make_samples(8)

    def run(on):
        model = make_tiny_model()
        calls, act = [], model.model.layers[1].mlp.act_fn
        forward = act.forward  # (counted inside the module: forward hooks do not run again in a recompute)
        act.forward = lambda x: (calls.append(torch.is_grad_enabled()), forward(x))[1]
        train = TrainConfig(lr=1e-3, warmup_steps=0, micro_batch_size=4, activation_checkpointing=on)
        trainer = Trainer(model, pad_token_id=0, train=train, algo=AlgoConfig(), rollout=Sampling(max_new_tokens=8))
        metrics = trainer.step(samples)
        return metrics, [p.detach().clone() for p in trainer.model.parameters()], calls

    (m0, p0, c0), (m1, p1, c1) = run(False), run(True)
    assert len(c1) == len(c0) + 2  # two micro-batches trained: each layer recomputed once for each
    assert m0["loss"] == m1["loss"] and abs(m0["grad_norm"] - m1["grad_norm"]) <= 1e-6 * m0["grad_norm"]
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(p0, p1))
