"""The off-policy corrections of strop.algo.offpolicy, against numbers worked out by hand."""

import math

import pytest
import torch

from strop.algo.offpolicy import (
    distillation_advantages,
    dppo_loss,
    loglinear_proximal,
    opsm_mask,
    overlong_penalty,
    sequence_mean,
)

L = math.log


def test_sequence_mean_counts_loss_tokens_only_and_gives_zero_for_an_empty_row():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(sequence_mean(x, mask), torch.tensor([[2.0], [0.0]]))


def test_opsm_masks_only_negative_advantage_sequences_that_drifted_past_delta():
    # sequence KLs, mean over loss tokens of (old - current): 0.3 / 0.05 / 0.3 / 0 (its only token masked)
    old = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0], [-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0]])
    cur = torch.tensor([[-1.2, -2.4, 0.0], [-1.05, -1.05, -1.0], [-1.2, -2.4, 0.0], [-5.0, -5.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([[-1.0], [-1.0], [2.0], [-1.0]])
    got = opsm_mask(cur, old, adv, mask, delta=0.1)
    # row 0: A < 0, KL 0.3 > 0.1 -> masked; row 1: KL 0.0333 <= 0.1 -> kept;
    # row 2: KL 0.3 but A > 0 -> kept; row 3: nothing to keep, no NaN
    assert torch.equal(got, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    # a looser delta keeps row 0
    assert torch.equal(opsm_mask(cur, old, adv, mask, delta=0.5), mask)
    # per-token advantages: only the negative tokens of a drifted sequence go
    adv_t = torch.tensor([[-1.0, 1.0, 0.0]]).expand(4, 3)
    assert torch.equal(opsm_mask(cur, old, adv_t, mask, delta=0.1)[0], torch.tensor([0.0, 1.0, 0.0]))


def test_dppo_masks_by_probability_change_and_keeps_its_kl_term_everywhere():
    # behaviour probabilities 0.5, 0.5, 0.5, 0.5; current 0.8, 0.6, 0.2, 0.4
    mu = torch.full((1, 4), L(0.5))
    pi = torch.tensor([[L(0.8), L(0.6), L(0.2), L(0.4)]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, info = dppo_loss(pi, mu, adv, mask_low=0.2, mask_high=0.2, kl_coef=0.01)
    # token 0: A > 0, d = +0.3 > 0.2 -> masked; token 1: d = +0.1 kept; token 2: A < 0, d = -0.3 < -0.2
    # -> masked; token 3: d = -0.1 kept
    assert info["clipped_high"].tolist() == [[True, False, False, False]]
    assert info["clipped_low"].tolist() == [[False, False, True, False]]
    kl = lambda p: 0.01 * L(p / 0.5) ** 2  # noqa: E731
    want = [kl(0.8), -1.0 * 0.6 / 0.5 + kl(0.6), kl(0.2), 1.0 * 0.4 / 0.5 + kl(0.4)]
    assert loss[0].tolist() == pytest.approx(want, rel=1e-6)
    loss.sum().backward()
    # d/dlogpi of -A r is -A r; of c (log r)^2 is 2 c log r; masked tokens keep only the KL gradient
    want_grad = [0.02 * L(1.6), -1.2 + 0.02 * L(1.2), 0.02 * L(0.4), 0.8 + 0.02 * L(0.8)]
    assert pi.grad[0].tolist() == pytest.approx(want_grad, rel=1e-6)


def test_dppo_a_zero_advantage_token_is_judged_by_the_low_rule():
    mu = torch.full((1, 2), L(0.5))
    pi = torch.tensor([[L(0.9), L(0.1)]])
    _, info = dppo_loss(pi, mu, torch.zeros(1, 2), kl_coef=0.0)
    assert info["clipped_high"].tolist() == [[False, False]] and info["clipped_low"].tolist() == [[False, True]]


def test_loglinear_proximal_interpolates_by_version_distance():
    mu = torch.tensor([[-2.0, -2.0, -2.0, -2.0, -2.0]])
    pi = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -1.0]], requires_grad=True)
    # current version 5; tokens sampled at 5 (fresh), 4 (one old), 3 (two old), 1 (four old), 6 (newer)
    versions = torch.tensor([[5, 4, 3, 1, 6]])
    prox = loglinear_proximal(mu, pi, versions, 5)
    # alpha = 0, 0, 1/2, 3/4, 0
    assert prox.tolist() == [[-2.0, -2.0, -1.5, -1.25, -2.0]]
    assert not prox.requires_grad  # the proximal policy is a constant of the step


def test_overlong_penalty_is_zero_then_linear_over_the_buffer():
    lengths = torch.tensor([0, 30, 32, 36, 40, 48])
    got = overlong_penalty(lengths, max_new_tokens=48, buffer=16, factor=0.5)
    # L - B = 32: 0 up to 32, then -0.5 * (len - 32) / 16
    assert got.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.125, -0.25, -0.5])
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_new_tokens=48, buffer=0)
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(lengths, max_new_tokens=48, buffer=49)


def test_distillation_advantage_is_the_negative_reverse_kl_on_loss_tokens():
    student = torch.tensor([[-1.0, -0.5, -3.0]], requires_grad=True)
    teacher = torch.tensor([[-0.25, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = distillation_advantages(student, teacher, mask, coef=2.0)
    assert adv.tolist() == [[1.5, -3.0, 0.0]] and not adv.requires_grad


# ---- through the trainer ------------------------------------------------------------------------------------
CORRECTIONS = {  # each with the metric that shows it acted on tests.test_trainer's samples
    "icepop": (dict(off_policy_correction="icepop"), "mis_masked_fraction"),
    "geo_mask": (dict(off_policy_correction="geo_mask", mis_low=0.9, mis_high=1.1), "mis_masked_fraction"),
    "opsm": (dict(opsm_delta=0.01), "opsm_masked_fraction"),
    # (the tiny model gives its random tokens probabilities of 1e-8 to 1e-6: bounds of that size)
    "dppo": (dict(policy_loss="dppo", dppo_mask_low=1e-8, dppo_mask_high=1e-8), "clip_fraction"),
    "overlong": (dict(overlong_buffer=4, overlong_penalty=0.5), "overlong_penalized_fraction"),
}


@pytest.mark.parametrize("name", sorted(CORRECTIONS))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_each_correction_acts_and_does_not_depend_on_the_micro_batch_split_packing_or_logit_chunks(
    tiny_model, name, mode
):
    import copy

    from tests.test_trainer import assert_same_update, make_samples, near_policy, run_step

    algo, metric = CORRECTIONS[name]
    samples = near_policy(tiny_model, make_samples())
    one = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=8, loss_agg=mode, **algo)
    assert one[1][metric] > 0, f"{name} changed nothing on these samples"
    assert_same_update(one, run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=2, loss_agg=mode, **algo))
    assert_same_update(one, run_step(copy.deepcopy(tiny_model), samples, max_tokens=20, loss_agg=mode, **algo))
    for chunk in (0, 3):  # the whole logits at once, and the lm_head in chunks of 3 tokens: the logprobs round
        # differently (~1e-6), which a loss of exp(log-ratios) shows at ~2e-5 of its value (GRPO's, ratio 1, at 0)
        other = run_step(copy.deepcopy(tiny_model), samples, logprob_chunk_size=chunk, loss_agg=mode, **algo)
        for key in ("loss", "grad_norm", metric):
            assert other[1][key] == pytest.approx(one[1][key], rel=1e-4), (chunk, key)
    plain = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=8, loss_agg=mode)
    assert not math.isclose(plain[1]["grad_norm"], one[1]["grad_norm"], rel_tol=1e-4)


def test_overlong_shaping_equals_the_same_penalty_added_to_the_rewards_by_hand(tiny_model):
    import copy

    from tests.test_trainer import assert_same_update, make_samples, run_step

    samples = make_samples()
    lengths = [s.response_length for s in samples]
    assert any(n > 4 for n in lengths) and any(n <= 4 for n in lengths)
    shaped = run_step(copy.deepcopy(tiny_model), copy.deepcopy(samples), overlong_buffer=4, overlong_penalty=0.5)
    by_hand = copy.deepcopy(samples)
    for s in by_hand:  # max_new_tokens 8 (run_step), buffer 4: -0.5 * (len - 4) / 4 past 4 tokens
        s.reward += -0.5 * max(s.response_length - 4, 0) / 4
    assert_same_update(shaped, run_step(copy.deepcopy(tiny_model), by_hand))
    assert shaped[1]["overlong_penalty_mean"] == pytest.approx(
        sum(-0.5 * max(n - 4, 0) / 4 for n in lengths) / len(lengths)
    )


def test_an_off_policy_run_without_a_correction_is_refused_with_the_list():
    from strop.config import ConfigError, build_config

    for mode in ("async", "one_step_off"):
        with pytest.raises(ConfigError) as e:
            build_config(overrides={"rollout": {"mode": mode}})
        for name in (
            "icepop",
            "geo_mask",
            "tis_cap",
            "mis_low",
            "opsm_delta",
            "dppo",
            "use_rollout_logprobs",
            "off_policy_correction='none'",
        ):
            assert name in str(e.value), name
        build_config(overrides={"rollout": {"mode": mode}, "algo": {"off_policy_correction": "none"}})
        # a resumed run reads back every field of its saved config, unset ones as null: still accepted
        build_config(
            overrides={
                "rollout": {"mode": mode},
                "algo": {
                    "off_policy_correction": "icepop",
                    "tis_cap": None,
                    "mis_level": "token",
                    "distill_temperature": None,
                    "distill_teacher": None,
                    "opsm_delta": None,
                },
            }
        )
        for algo in (
            dict(off_policy_correction="icepop"),
            dict(off_policy_correction="geo_mask"),
            dict(tis_cap=2.0),
            dict(mis_high=2.0),
            dict(opsm_delta=1e-4),
            dict(policy_loss="dppo"),
            dict(use_rollout_logprobs=True),
        ):
            build_config(overrides={"rollout": {"mode": mode}, "algo": algo})
    build_config(overrides={})  # sync needs none


@pytest.mark.parametrize(
    "algo,message",
    [
        (dict(off_policy_correction="none", tis_cap=2.0), "says no correction, but algo.tis_cap=2.0"),
        (dict(off_policy_correction="icepop", tis_cap=2.0), "leave algo.tis_cap unset"),
        (dict(off_policy_correction="icepop", use_rollout_logprobs=True), "nothing would ever be masked"),
    ],
)
def test_contradictory_corrections_are_refused(algo, message):
    from strop.config import AlgoConfig

    with pytest.raises(ValueError, match=message):
        AlgoConfig(**algo)


def test_an_overlong_buffer_past_the_length_limit_or_with_tools_is_refused():
    from strop.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="overlong_buffer=64 is longer than rollout.max_new_tokens=48"):
        build_config(overrides={"algo": {"overlong_buffer": 64}})
    with pytest.raises(ConfigError, match="shape its reward in the reward function"):
        build_config(overrides={"algo": {"overlong_buffer": 8}, "tools": {"enabled": ["python"]}})


def test_the_presets_resolve_to_their_published_bounds():
    from strop.algo.objective import correction_settings
    from strop.config import AlgoConfig

    assert correction_settings(AlgoConfig(off_policy_correction="icepop")) == dict(
        tis_cap=5.0, mis_low=0.5, mis_high=5.0, mis_level="token"
    )
    assert correction_settings(AlgoConfig(off_policy_correction="icepop", mis_low=0.8, mis_high=2.0)) == dict(
        tis_cap=2.0, mis_low=0.8, mis_high=2.0, mis_level="token"
    )
    assert correction_settings(AlgoConfig(off_policy_correction="geo_mask")) == dict(
        tis_cap=None, mis_low=0.99, mis_high=1.01, mis_level="sequence"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "algo,metric",
    [
        (dict(off_policy_correction="icepop"), "mis_masked_fraction"),
        (dict(off_policy_correction="geo_mask"), "mis_masked_fraction"),
        (dict(opsm_delta=1e-4), "opsm_masked_fraction"),
        (dict(policy_loss="dppo"), "clip_fraction"),
        (dict(off_policy_correction="none"), "importance_weight_mean"),
    ],
    ids=["icepop", "geo_mask", "opsm", "dppo", "none"],
)
def test_an_async_run_trains_with_each_correction(tiny_model_dir, tmp_path, algo, metric):
    import json

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir,
        run_dir,
        rollout={"mode": "async", "max_staleness": 1},
        train={"steps": 3},
        algo=algo,
        run={"save_every": 0, "plot": False},
    )
    assert train(build_config(overrides=cfg))["steps"] == 3
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 3 and all(metric in r and math.isfinite(r["loss"]) for r in steps)
    assert any(r["grad_norm"] > 0 for r in steps)
    assert max(r["staleness_max"] for r in steps) >= 1  # it trained tokens of older weights


def _forwards(model):
    calls = []
    model.model.register_forward_hook(lambda *a: calls.append(1))  # (the trainer runs the backbone, then its own head)
    return calls


def test_loglinear_proximal_in_the_trainer_needs_no_forward_and_is_the_rollout_policy_for_fresh_tokens(tiny_model):
    import copy

    from tests.test_trainer import assert_same_update, make_samples, near_policy, run_step

    samples = near_policy(tiny_model, make_samples())
    fresh = copy.deepcopy(samples)
    for s in fresh:  # sampled by the weights this (first) step starts from: version 0
        s.weight_versions = [0] * s.response_length
    # the step turns version 0 into 1: for version-0 tokens alpha = 0, so pi_old is the rollout's own policy
    models = [copy.deepcopy(tiny_model) for _ in range(3)]
    counts = [_forwards(m) for m in models]
    loglinear = run_step(models[0], fresh, mini_batches=2, micro_batch_size=4, proximal="loglinear")
    assert_same_update(
        loglinear, run_step(models[1], fresh, mini_batches=2, micro_batch_size=4, use_rollout_logprobs=True)
    )
    recompute = run_step(models[2], fresh, mini_batches=2, micro_batch_size=4)
    # 8 samples, 2 mini-batches of 4, one micro-batch each; recompute adds a no-grad pass over all 8 (2 forwards)
    assert len(counts[0]) == len(counts[1]) == 2 and len(counts[2]) == 4
    assert not math.isclose(loglinear[1]["grad_norm"], recompute[1]["grad_norm"], rel_tol=1e-4)
    # tokens two versions old (make_samples' -1): alpha = 1/2, halfway between the rollout's policy and pi
    stale = run_step(copy.deepcopy(tiny_model), samples, mini_batches=2, micro_batch_size=4, proximal="loglinear")
    assert not math.isclose(stale[1]["grad_norm"], loglinear[1]["grad_norm"], rel_tol=1e-4)
    with pytest.raises(ValueError, match="choose one"):
        run_step(copy.deepcopy(tiny_model), samples, proximal="loglinear", use_rollout_logprobs=True)


@pytest.mark.parametrize(
    "algo,field",
    [
        (dict(tis_cap=2.0), "algo.tis_cap"),
        (dict(mis_low=0.5), "algo.mis_low"),
        (dict(mis_high=2.0), "algo.mis_high"),
        (dict(off_policy_correction="icepop"), "algo.off_policy_correction='icepop'"),
        (dict(off_policy_correction="geo_mask"), "algo.off_policy_correction='geo_mask'"),
    ],
)
def test_loglinear_proximal_with_a_correction_of_pi_old_against_the_rollout_is_refused(algo, field):
    from strop.config import AlgoConfig

    # loglinear gives a token one version old pi_old = pi_rollout (alpha = 0): the weight pi_old/pi_rollout is 1
    # there, every token in sync mode, so TIS / MIS / IcePop / geo_mask could never act on it
    with pytest.raises(ValueError) as e:
        AlgoConfig(proximal="loglinear", **algo)
    assert "algo.proximal='loglinear'" in str(e.value) and field in str(e.value) and "never" in str(e.value)
    AlgoConfig(proximal="recompute", **algo)  # the recomputed pi_old is the trainer's own: accepted
    for other in (dict(opsm_delta=0.1), dict(policy_loss="dppo"), dict(off_policy_correction="none")):
        AlgoConfig(proximal="loglinear", **other)  # none of these compares pi_old with the rollout


# ---- on-policy distillation -----------------------------------------------------------------------------------
def _teacher_logprobs(teacher, samples, temperature=1.0):
    """The teacher's logprob of each sampled response token, by hand: (N, T) padded with 0."""
    T = max(s.response_length for s in samples)
    out = torch.zeros(len(samples), T)
    with torch.no_grad():
        for i, s in enumerate(samples):
            logits = teacher(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0].float() / temperature
            P = len(s.prompt_ids)
            lp = logits[P - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(s.response_ids).unsqueeze(-1)).squeeze(-1)
            out[i, : len(lp)] = lp
    return out


def _distill_step(student, teacher, samples, *, advantage_fn=None, temperature=0.7, remote_teacher=None, **algo):
    from strop.config import AlgoConfig, TrainConfig
    from strop.train.trainer import Sampling, Trainer

    train = TrainConfig(lr=1e-3, warmup_steps=0, micro_batch_size=3)
    trainer = Trainer(
        student,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(**algo),
        rollout=Sampling(temperature=temperature, max_new_tokens=8),
        teacher=teacher if teacher is not None else remote_teacher,
        hooks={"advantage": advantage_fn},
    )
    return trainer, trainer.step(samples)


@pytest.mark.parametrize("temperature", [None, 1.0])
def test_pure_distillation_trains_on_the_teachers_reverse_kl_as_the_advantage(temperature):
    """distill_only: the update equals one whose advantage hook returns -coef (log pi_student - log pi_teacher) per
    loss token, computed here by hand from the teacher (at the rollout's temperature 0.7, or at 1.0 when set)."""
    import copy

    from tests.test_trainer import assert_same_update, make_samples, near_policy
    from tests.tiny import make_tiny_model

    student, teacher = make_tiny_model(seed=0), make_tiny_model(seed=1)
    samples = near_policy(student, make_samples())
    mask = torch.zeros(len(samples), max(s.response_length for s in samples))
    rollout = torch.zeros_like(mask)
    for i, s in enumerate(samples):
        mask[i, : s.response_length] = torch.tensor(s.loss_mask, dtype=torch.float32)
        rollout[i, : s.response_length] = torch.tensor(s.rollout_logprobs)
    teacher_lp = _teacher_logprobs(teacher, samples, temperature or 0.7)
    want = -0.5 * (rollout - teacher_lp) * mask
    extra = {"distill_temperature": temperature} if temperature else {}
    distilled = _distill_step(
        copy.deepcopy(student),
        copy.deepcopy(teacher),
        samples,
        distill_teacher="t",
        distill_coef=0.5,
        distill_only=True,
        **extra,
    )
    # (rel 1e-4: the trainer scores the batch padded, the hand one sequence at a time; on an AMD EPYC with AVX2
    # their fp32 sums differed by 1.4e-5 relative; a teacher 1 % off in temperature moves it by 0.11)
    assert distilled[1]["distill_reverse_kl"] == pytest.approx(
        float((rollout - teacher_lp).mul(mask).sum() / mask.sum()), rel=1e-4
    )
    by_hand = _distill_step(copy.deepcopy(student), None, samples, advantage_fn=lambda **_: want)
    assert_same_update(distilled, by_hand, rel=1e-4)  # (the teacher's logprobs as above: within 1.4e-5 of each other)
    # with the task's advantages: the sum (the default GRPO advantages + the same term)
    both = _distill_step(
        copy.deepcopy(student), copy.deepcopy(teacher), samples, distill_teacher="t", distill_coef=0.5, **extra
    )
    task = _distill_step(copy.deepcopy(student), None, samples)
    assert not math.isclose(both[1]["grad_norm"], task[1]["grad_norm"], rel_tol=1e-4)
    assert not math.isclose(both[1]["grad_norm"], distilled[1]["grad_norm"], rel_tol=1e-4)


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, tiny_model_dir, tokenizer):
    import shutil

    from strop.config import ConfigError, build_config
    from strop.setup import load_teacher
    from tests.tiny import make_tiny_model

    other = tmp_path / "teacher"
    make_tiny_model(seed=1).save_pretrained(other)
    changed = tokenizer.__class__.from_pretrained(str(tiny_model_dir))
    changed.add_tokens(["<strop-teacher-only>"])
    changed.save_pretrained(other)
    cfg = build_config(overrides={"model": {"path": str(tiny_model_dir)}, "algo": {"distill_teacher": str(other)}})
    with pytest.raises(ConfigError, match=r"another tokenizer than the student.*'<strop-teacher-only>'"):
        load_teacher(cfg, tokenizer)
    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    assert (
        load_teacher(
            build_config(overrides={"model": {"path": str(tiny_model_dir)}, "algo": {"distill_teacher": str(same)}}),
            tokenizer,
        )
        is not None
    )
    with pytest.raises(ConfigError, match="need a teacher"):
        build_config(overrides={"algo": {"distill_only": True}})
    with pytest.raises(ConfigError, match="distill_teacher is loaded whole"):
        build_config(overrides={"algo": {"distill_teacher": str(same)}, "parallel": {"tensor_parallel_size": 2}})


@pytest.mark.timeout(300)
def test_a_run_distils_from_a_teacher_on_disk(tiny_model_dir, tmp_path):
    """strop train with algo.distill_teacher (here the student's own starting weights, so the first step's
    reverse KL is the engine/trainer gap, ~0) logs the reverse KL every step; it grows as the student moves."""
    import json

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir, run_dir, train={"steps": 3}, algo={"distill_teacher": str(tiny_model_dir), "distill_coef": 1.0}
    )
    assert train(build_config(overrides=cfg))["steps"] == 3
    kl = [
        r["distill_reverse_kl"]
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "loss" in r
    ]
    assert len(kl) == 3 and abs(kl[0]) < 1e-4 and abs(kl[-1]) > 10 * abs(kl[0])


@pytest.mark.parametrize("name", sorted(set(CORRECTIONS) - {"overlong"}))
def test_an_all_masked_sequence_and_an_empty_step_give_no_nan(name):
    """policy_objective with each correction: a sequence with no loss token contributes nothing and no NaN; a
    micro-batch with no loss token at all gives a loss of exactly 0."""
    from strop.algo.objective import Normalisers, policy_objective
    from strop.config import AlgoConfig

    algo = AlgoConfig(**CORRECTIONS[name][0])
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(3, 4, generator=g) - 1).requires_grad_(True)
    rollout = logprobs.detach() + 0.3 * torch.randn(3, 4, generator=g)
    adv = torch.tensor([[1.0], [-1.0], [0.5]])
    for mask in (torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]]), torch.zeros(3, 4)):
        norms = Normalisers(num_sequences=3.0, total_tokens=float(mask.sum()), constant=4.0)
        loss, pg, stats = policy_objective(
            logprobs,
            None,
            old_logprobs=logprobs.detach(),
            rollout_logprobs=rollout,
            ref_logprobs=None,
            advantages=adv,
            loss_mask=mask,
            norms=norms,
            algo=algo,
        )
        assert torch.isfinite(loss) and all(torch.isfinite(v).all() for v in stats.values())
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.isfinite(grad).all() and grad[1].abs().sum() == 0  # the all-masked row: no gradient
        if mask.sum() == 0:
            assert loss.item() == 0.0


# ---- DPPO with the other corrections, through policy_objective --------------------------------------------------
def _objective(logprobs, old, rollout, adv, mask, **algo):
    """policy_objective with token_mean over the mask's tokens, no reference, no entropy."""
    from strop.algo.objective import Normalisers, policy_objective
    from strop.config import AlgoConfig

    norms = Normalisers(num_sequences=float(mask.shape[0]), total_tokens=float(mask.sum()), constant=1.0)
    return policy_objective(
        logprobs,
        None,
        old_logprobs=old,
        rollout_logprobs=rollout,
        ref_logprobs=None,
        advantages=adv,
        loss_mask=mask,
        norms=norms,
        algo=AlgoConfig(loss_agg="token_mean", **algo),
    )


def test_dppo_with_icepop_weighs_each_kept_token_by_its_ratio_once_as_prime_rl_does():
    # prime-rl's DPPO (src/prime_rl/trainer/rl/loss.py, default_loss_fn): -keep A pi/mu + kl_tau (log pi/mu)^2, the
    # ratio pi/mu once. IcePop only masks: its weight pi_old/mu is already inside DPPO's pi/mu, not a second factor.
    # mu = 0.5 everywhere; first mini-batch: pi = pi_old = 0.55, 0.6, 0.1, 0.45 (w = pi_old/mu = 1.1, 1.2, 0.2, 0.9)
    mu = torch.full((1, 4), L(0.5))
    probs = [0.55, 0.6, 0.1, 0.45]
    pi = torch.tensor([[L(p) for p in probs]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    loss, pg, stats = _objective(
        pi,
        pi.detach(),
        mu,
        adv,
        torch.ones(1, 4),
        policy_loss="dppo",
        off_policy_correction="icepop",
        dppo_kl_coef=0.01,
    )
    # IcePop keeps w in [0.5, 5]: token 2 (w = 0.2) leaves; DPPO's own mask (|pi - mu| <= 0.2 on the others) keeps all
    assert stats["mis_dropped"].tolist() == [[0.0, 0.0, 1.0, 0.0]]
    kl = lambda p: 0.01 * L(p / 0.5) ** 2  # noqa: E731
    want = [-1.1 + kl(0.55), -1.2 + kl(0.6), 0.0, 0.9 + kl(0.45)]  # -A r + kl, r = pi/mu; token 2 masked
    assert loss.item() == pytest.approx(sum(want) / 4, rel=1e-6)  # token_mean over the 4 loss tokens
    loss.backward()
    # d/dlog pi: -A r + 2 c log r (r once: the doubled weight would give -A r^2 = -1.21, -1.44, -, 0.81)
    want_grad = [(-1.1 + 0.02 * L(1.1)) / 4, (-1.2 + 0.02 * L(1.2)) / 4, 0.0, (0.9 + 0.02 * L(0.9)) / 4]
    assert pi.grad[0].tolist() == pytest.approx(want_grad, rel=1e-6)


def test_dppo_with_tis_truncates_the_behaviour_factor_of_its_one_ratio():
    # a later mini-batch: pi_old = 0.6, 0.5, 0.4, 0.8 (w = pi_old/mu = 1.2, 1.0, 0.8, 1.6 against mu = 0.5), and
    # pi = 0.66, 0.55, 0.4, 0.8. DPPO's ratio pi/mu = (pi/pi_old) (pi_old/mu); TIS caps the second factor at C = 1.1:
    # r = (pi/pi_old) min(w, C) = 1.1 * 1.1, 1.1 * 1.0, 1.0 * 0.8, 1.0 * 1.1 (not pi/mu * min(w, C) again)
    mu = torch.full((1, 4), L(0.5))
    old = torch.tensor([[L(0.6), L(0.5), L(0.4), L(0.8)]])
    probs = [0.66, 0.55, 0.4, 0.8]
    pi = torch.tensor([[L(p) for p in probs]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, _, stats = _objective(pi, old, mu, adv, torch.ones(1, 4), policy_loss="dppo", tis_cap=1.1, dppo_kl_coef=0.01)
    assert stats["importance_weight"][0].tolist() == pytest.approx([1.2, 1.0, 0.8, 1.6], rel=1e-6)
    r = [1.21, 1.1, 0.8, 1.1]
    kl = [0.01 * L(p / 0.5) ** 2 for p in probs]  # the squared-log term: no importance weight, as in prime-rl
    # DPPO's mask: d = pi - mu = 0.16, 0.05, -0.1, 0.3; no A > 0 token rose by > 0.2, no A <= 0 one fell by > 0.2
    want = [-a * x + k for a, x, k in zip([1.0, 1.0, -1.0, -1.0], r, kl)]
    assert loss.item() == pytest.approx(sum(want) / 4, rel=1e-6)
    loss.backward()
    want_grad = [(-a * x + 0.02 * L(p / 0.5)) / 4 for a, x, p in zip([1.0, 1.0, -1.0, -1.0], r, probs)]
    assert pi.grad[0].tolist() == pytest.approx(want_grad, rel=1e-6)
    # on the first mini-batch (pi_old = pi) an untruncated token's gradient is -A pi/mu, exactly prime-rl's
    pi2 = torch.tensor([[L(0.52), L(0.45)]], requires_grad=True)
    loss2, _, _ = _objective(
        pi2,
        pi2.detach(),
        torch.full((1, 2), L(0.5)),
        torch.tensor([[1.0, -1.0]]),
        torch.ones(1, 2),
        policy_loss="dppo",
        tis_cap=1.1,
        dppo_kl_coef=0.0,
    )
    loss2.backward()
    assert pi2.grad[0].tolist() == pytest.approx([-1.04 / 2, 0.9 / 2], rel=1e-6)


def test_under_opsm_and_dppo_a_zero_advantage_sequence_past_delta_keeps_its_kl_term():
    # OPSM drops a sequence only when A < 0: row 0 (A = 0) drifted far past delta and keeps DPPO's squared-log
    # term; row 1 (A = -1, the same drift) is dropped. mu = 0.5; pi = 0.3, 0.2 in both rows.
    mu = torch.full((2, 2), L(0.5))
    pi = torch.tensor([[L(0.3), L(0.2)], [L(0.3), L(0.2)]], requires_grad=True)
    adv = torch.tensor([[0.0], [-1.0]])
    # KL_i = mean(log mu - log pi) = (log(5/3) + log(5/2)) / 2 = 0.71 > delta = 0.1 in both rows
    loss, _, stats = _objective(
        pi,
        pi.detach(),
        mu,
        adv,
        torch.ones(2, 2),
        policy_loss="dppo",
        opsm_delta=0.1,
        dppo_kl_coef=0.01,
        dppo_mask_low=0.5,
    )
    loss.backward()
    # row 0: no policy term (A = 0); d/dlog pi of c (log pi/mu)^2 = 2 c log(pi/mu), over the step's 4 loss tokens
    assert pi.grad[0].tolist() == pytest.approx([0.02 * L(0.6) / 4, 0.02 * L(0.4) / 4], rel=1e-6)
    assert stats["opsm_dropped"].tolist() == [[0.0, 0.0], [1.0, 1.0]]  # OPSM did act, on row 1


def test_a_zero_advantage_step_under_dppo_trains_its_kl_term_and_opsm_leaves_it_alone(tiny_model):
    import copy

    from tests.test_trainer import assert_same_update, make_samples, near_policy, run_step

    samples = near_policy(tiny_model, make_samples(), noise=0.0)
    for s in samples:  # equal rewards (GRPO advantages all 0); the rollout 0.3 nats above pi: KL_i = 0.3 > delta
        s.reward = 1.0
        s.rollout_logprobs = [x + 0.3 for x in s.rollout_logprobs]
    # (the tiny model's token probabilities are ~1e-6: DPPO's probability trust region masks nothing)
    dppo = dict(policy_loss="dppo", dppo_kl_coef=0.1)
    alone = run_step(copy.deepcopy(tiny_model), samples, **dppo)
    with_opsm = run_step(copy.deepcopy(tiny_model), samples, opsm_delta=0.1, **dppo)
    # the squared-log term gives every token a gradient even at A = 0, and OPSM (A < 0 only) takes none of it
    assert alone[1]["grad_norm"] > 0 and alone[1]["trained_samples"] == len(samples)
    assert with_opsm[1]["opsm_masked_fraction"] == 0.0
    assert_same_update(alone, with_opsm)
