"""Every estimator, loss, KL form and aggregation mode against numbers worked out by hand."""

import math

import pytest
import torch

from strop.algo.advantages import (
    discounted_cumsum,
    discounted_returns,
    gae,
    grpo_advantages,
    outcome_token_rewards,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from strop.algo.kl import importance_weighted_kl, kl_estimate
from strop.algo.losses import aggregate, cispo_loss, gspo_loss, ppo_clip_loss, rollout_correction, value_loss


# ---- advantages ------------------------------------------------------------------------------
def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 3, 3, 3])
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    centred = grpo_advantages(rewards, groups, normalize_std=False)  # Dr. GRPO
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))


def test_grpo_groups_need_not_be_contiguous_and_singletons_are_zero():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 5.0]), torch.tensor([2, 9, 2]))
    torch.testing.assert_close(adv, torch.tensor([-1 / (math.sqrt(2) + 1e-6), 0.0, 1 / (math.sqrt(2) + 1e-6)]))


def test_rloo_by_hand():
    # group of 3: r = 1, 0, 2 -> baselines (0+2)/2=1, (1+2)/2=1.5, (1+0)/2=0.5
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 2.0, 7.0]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.tensor([0.0, -1.5, 1.5, 0.0]))


def test_outcome_reward_sits_on_the_last_token():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    out = outcome_token_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0, 0, 2.0, 0], [-1.0, 0, 0, 0], [0, 0, 0, 0]]))


def serial_discounted(x, factor):
    out = torch.zeros_like(x, dtype=torch.float64)
    for i in range(x.shape[0]):
        running = 0.0
        for t in reversed(range(x.shape[1])):
            running = float(x[i, t]) + factor * running
            out[i, t] = running
    return out


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 3), (50, 8), (130, 64), (64, 64)])
@pytest.mark.parametrize("factor", [1.0, 0.99, 0.5])
def test_chunked_discounted_cumsum_equals_the_serial_loop(T, chunk, factor):
    x = torch.randn(3, T, generator=torch.Generator().manual_seed(T))
    torch.testing.assert_close(
        discounted_cumsum(x, factor, chunk_size=chunk).double(), serial_discounted(x, factor), rtol=1e-5, atol=1e-5
    )


def test_discounted_returns_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    torch.testing.assert_close(discounted_returns(r, mask, 0.5, chunk_size=2), torch.tensor([[0.25, 0.5, 1.0, 0.0]]))


def serial_gae(rewards, values, mask, gamma, lam):
    N, T = rewards.shape
    adv = torch.zeros(N, T, dtype=torch.float64)
    for i in range(N):
        L = int(mask[i].sum())
        last = 0.0
        for t in reversed(range(L)):
            next_v = float(values[i, t + 1]) if t + 1 < L else 0.0
            delta = float(rewards[i, t]) + gamma * next_v - float(values[i, t])
            last = delta + gamma * lam * last
            adv[i, t] = last
    return adv, (adv + values.double()) * mask.double()


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_chunked_gae_equals_the_serial_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([70, 3, 129, 1])
    mask = (torch.arange(130).unsqueeze(0) < lengths.unsqueeze(1)).float()
    rewards, values = torch.randn(4, 130, generator=g) * mask, torch.randn(4, 130, generator=g)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam, chunk_size=16)
    ref_adv, ref_ret = serial_gae(rewards, values * mask, mask, gamma, lam)
    torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_by_hand():
    # two tokens, gamma = 1, lam = 0.5: delta_1 = 1 - 0.5 = 0.5; delta_0 = 0 + 0.5 - 0.25 = 0.25;
    # A_1 = 0.5, A_0 = 0.25 + 0.5 * 0.5 = 0.5; returns = A + V = (0.75, 1.0)
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.25, 0.5]]), torch.ones(1, 2), gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.75, 1.0]]))


def test_reinforce_pp_by_hand():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kl = torch.tensor([[0.5, 1.0], [2.0, 0.0]])
    # token rewards: [-0.1*0.5, 1 - 0.1*1], [0 - 0.1*2]; gamma 1 returns: [0.85, 0.9], [-0.2]
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, kl=kl, kl_coef=0.1)
    returns = torch.tensor([0.85, 0.9, -0.2])
    expected = (returns - returns.mean()) / (returns.var(unbiased=False).sqrt() + 1e-8)
    torch.testing.assert_close(adv[mask > 0], expected)
    assert adv[1, 1] == 0
    # -baseline: group mean is subtracted first; one group -> rewards 0.5, -0.5
    base = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, baseline=True)
    returns = torch.tensor([0.5, 0.5, -0.5])
    torch.testing.assert_close(base[mask > 0], (returns - returns.mean()) / (returns.var(unbiased=False).sqrt() + 1e-8))


def test_whiten_ignores_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


# ---- policy losses ---------------------------------------------------------------------------
def test_ppo_clip_by_hand_both_sides_and_mask():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 3.0]])
    logprobs = ratios.log().requires_grad_(True)
    old = torch.zeros(1, 4)  # old logprob 0: ratio = exp(logprob)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is masked out
    loss_t, info = ppo_clip_loss(logprobs, old, torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    loss = aggregate(loss_t, mask, "token_mean", num_sequences=1, total_tokens=3)
    # A=+1: token 0 clipped at 1.28 -> -1.28; token 1 below: max(-0.5, -0.8) = -0.5; token 2: -1.1
    assert math.isclose(loss.item(), (-1.28 - 0.5 - 1.1) / 3, rel_tol=1e-6)
    assert info["clipped_high"].tolist() == [[True, False, False, True]] and not info["clipped_low"].any()
    loss.backward()
    # gradient flows only through unclipped, unmasked tokens: d(-ratio)/dlogprob = -ratio, / 3 tokens
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3, 0.0]]))

    lp2 = ratios.log().requires_grad_(True)
    loss_t2, info2 = ppo_clip_loss(lp2, old, -torch.ones(1, 1), clip_low=0.2, clip_high=0.28)
    # A=-1: token 0: max(1.5, 1.28) = 1.5; token 1: max(0.5, 0.8) = 0.8 (clipped low); token 2: 1.1
    torch.testing.assert_close(loss_t2[:, :3], torch.tensor([[1.5, 0.8, 1.1]]))
    assert info2["clipped_low"].tolist() == [[False, True, False, False]]


def test_dual_clip_caps_negative_advantage_tokens():
    logprobs = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss_t, info = ppo_clip_loss(logprobs, torch.zeros(1, 3), adv, clip_low=0.2, clip_high=0.2, dual_clip=3.0)
    # A=-1, ratio 5: max(5, 1.2) = 5 > cap 3 -> 3 (no gradient); ratio 2: 2 < 3 stays; A=+1 untouched: -1.2
    torch.testing.assert_close(loss_t, torch.tensor([[3.0, 2.0, -1.2]]))
    assert info["dual_clipped"].tolist() == [[True, False, False]]
    loss_t.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, 2.0, 0.0]]))
    with pytest.raises(ValueError):
        ppo_clip_loss(logprobs, torch.zeros(1, 3), adv, dual_clip=0.5)


def test_gspo_sequence_ratio_by_hand():
    # sequence of 2 loss tokens with log ratios 0.2 and 0.0 (and a masked one): s = exp(0.1)
    logprobs = torch.tensor([[0.2, 0.0, 9.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    s = math.exp(0.1)
    loss_t, info = gspo_loss(logprobs, old, torch.ones(1, 1), mask, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss_t[:, :2], torch.tensor([[-s, -s]]))  # value is s on every token
    aggregate(loss_t, mask, "seq_mean_token_mean", num_sequences=1).backward()
    # d/dlogprob_t of -(1/2) sum_t sg[s] exp(lp_t - sg[lp_t]) = -s / 2 per loss token
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))
    # with a clip of 0.05, s = 1.105 is clipped for A > 0: no gradient
    lp = logprobs.detach().clone().requires_grad_(True)
    loss_c, info_c = gspo_loss(lp, old, torch.ones(1, 1), mask, clip_low=0.05, clip_high=0.05)
    torch.testing.assert_close(loss_c[:, :2], torch.tensor([[-1.05, -1.05]]))
    assert info_c["clipped_high"][:, :2].all()


def test_cispo_by_hand():
    logprobs = torch.tensor([[math.log(2.0), math.log(0.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]])
    loss_t, info = cispo_loss(logprobs, torch.zeros(1, 2), adv, clip_low=1.0, clip_high=0.28)
    # weights sg[clip(2, 0, 1.28)] = 1.28 and sg[0.5]; loss = -w * A * logprob
    torch.testing.assert_close(loss_t, torch.tensor([[-1.28 * math.log(2.0), 2 * 0.5 * math.log(0.5)]]))
    loss_t.sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.28, 1.0]]))  # every token keeps a gradient
    assert info["clipped_high"].tolist() == [[True, False]]


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.0]])
    returns = torch.tensor([[0.0, 1.0]])
    loss_t, info = value_loss(values, old, returns, clip=0.2)
    # token 0: unclipped (1-0)^2 = 1, clipped V = 0.7 -> 0.49; max = 1 -> 0.5
    # token 1: unclipped 1, clipped V = 0 -> 1 (equal) -> 0.5
    torch.testing.assert_close(loss_t, torch.tensor([[0.5, 0.5]]))
    loss_t2, info2 = value_loss(torch.tensor([[0.0]]), torch.tensor([[0.5]]), torch.tensor([[1.0]]), clip=0.2)
    # V moved 0.5 down, past the clip: clipped V = 0.3 -> (0.3 - 1)^2 = 0.49; unclipped (0 - 1)^2 = 1; max = 1 -> 0.5
    torch.testing.assert_close(loss_t2, torch.tensor([[0.5]]))
    assert not info2["value_clipped"].item()  # the unclipped term was the larger: it was used
    # and a case where the clip is worse:
    loss_t3, info3 = value_loss(torch.tensor([[0.9]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), clip=0.2)
    # unclipped 0.01; clipped V = 0.2 -> 0.64 -> 0.32
    torch.testing.assert_close(loss_t3, torch.tensor([[0.32]]))
    assert info3["value_clipped"].item()


# ---- aggregation -----------------------------------------------------------------------------
def test_aggregation_modes_by_hand():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(per_token, mask, "token_mean", num_sequences=2, total_tokens=4).item() == pytest.approx(10 / 4)
    assert aggregate(per_token, mask, "seq_mean_token_mean", num_sequences=2).item() == pytest.approx((2 + 4) / 2)
    assert aggregate(
        per_token, mask, "seq_mean_token_sum_norm", num_sequences=2, constant_normalizer=8
    ).item() == pytest.approx(10 / 16)
    # per-rollout denominators: sample 0 belongs to a rollout of 6 loss tokens
    assert aggregate(
        per_token, mask, "seq_mean_token_mean", num_sequences=2, sequence_tokens=torch.tensor([6.0, 1.0])
    ).item() == pytest.approx((1 + 4) / 2)
    with pytest.raises(ValueError):
        aggregate(per_token, mask, "nope", num_sequences=2)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_summed_over_splits_equals_the_whole(mode):
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    kw = dict(num_sequences=6, total_tokens=float(mask.sum()), constant_normalizer=5.0)
    whole = aggregate(per_token, mask, mode, **kw)
    parts = sum(aggregate(per_token[i : i + 2], mask[i : i + 2], mode, **kw) for i in range(0, 6, 2))
    torch.testing.assert_close(whole, parts)


# ---- KL --------------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])  # log r = ref - lp = -0.5
    assert kl_estimate(lp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(lp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(lp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    # log r is clamped to [-10, 10] and the value to <= 10
    assert kl_estimate(torch.tensor([0.0]), torch.tensor([-50.0]), "k3").item() == pytest.approx(math.exp(-10) + 9)
    assert kl_estimate(torch.tensor([-50.0]), torch.tensor([0.0]), "k3").item() == pytest.approx(10.0)
    w = importance_weighted_kl(torch.tensor([-1.0]), torch.tensor([-1.2]), ref, "k3")
    assert w.item() == pytest.approx(math.exp(0.2) * (math.exp(-0.5) - 1 + 0.5))
    with pytest.raises(ValueError):
        kl_estimate(lp, ref, "k9")


def test_k3_is_unbiased_for_the_true_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), -1)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    idx = torch.multinomial(p, 400_000, replacement=True, generator=g)
    true_kl = (p * (p / q).log()).sum()
    for kind in ("k1", "k3"):
        est = kl_estimate(p.log()[idx], q.log()[idx], kind).mean()
        assert est.item() == pytest.approx(true_kl.item(), rel=0.03)


# ---- train/rollout mismatch ------------------------------------------------------------------
def test_tis_and_mis_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rollout = torch.tensor([[math.log(0.5), 0.0, math.log(4.0)], [math.log(0.9), math.log(1.1), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w_expected = torch.tensor([[2.0, 1.0, 0.25], [1 / 0.9, 1 / 1.1, 1.0]])
    weight, keep, info = rollout_correction(old, rollout, mask, tis_cap=1.5)
    torch.testing.assert_close(info["w"], w_expected)
    torch.testing.assert_close(weight, w_expected.clamp(max=1.5))
    torch.testing.assert_close(keep, mask)
    _, keep_tok, _ = rollout_correction(old, rollout, mask, mis_low=0.5, mis_high=1.5)
    torch.testing.assert_close(keep_tok, torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 0.0]]))
    _, keep_seq, _ = rollout_correction(old, rollout, mask, mis_low=0.8, mis_high=1.25, mis_level="sequence")
    # sequence 0: geometric mean of (2, 1, 0.25) = 0.79 -> dropped; sequence 1: ~1.0 -> kept
    torch.testing.assert_close(keep_seq, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo"])
def test_tool_tokens_are_not_actions_for_any_estimator(estimator):
    """Inserting tool-output tokens (loss mask 0, arbitrary values and KL there) into responses
    leaves every action token's advantage (and critic target) exactly as without them, and gives
    the tool tokens 0: returns, GAE, KL-in-reward and whitening all run over actions only."""
    from strop.algo.advantages import compute_advantages
    from strop.config import AlgoConfig

    g = torch.Generator().manual_seed(0)
    N, T = 4, 6
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.2]), torch.tensor([0, 0, 1, 1])
    lengths = [6, 4, 5, 3]
    resp = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    pol, ref, val = (torch.randn(N, T, generator=g) for _ in range(3))
    algo = AlgoConfig(
        estimator=estimator, kl_in_reward_coef=0.1 if estimator in ("reinforce_pp", "ppo") else 0.0, gamma=0.9, lam=0.8
    )
    plain_adv, plain_ret = compute_advantages(
        algo,
        rewards=rewards,
        group_ids=groups,
        response_mask=resp,
        loss_mask=resp,
        policy_logprobs=pol,
        ref_logprobs=ref,
        old_values=val,
    )
    # the same responses with 3 tool tokens inserted after each one's second token
    tool = 3
    T2 = T + tool
    where = [list(range(2)) + list(range(2 + tool, n + tool)) for n in lengths]  # action positions in the long form
    resp2, loss2 = torch.zeros(N, T2), torch.zeros(N, T2)
    pol2, ref2, val2 = (torch.randn(N, T2, generator=g) * 50 for _ in range(3))  # garbage at tool tokens
    for i, pos in enumerate(where):
        resp2[i, : lengths[i] + tool] = 1.0
        loss2[i, pos] = 1.0
        pol2[i, pos], ref2[i, pos], val2[i, pos] = pol[i, : lengths[i]], ref[i, : lengths[i]], val[i, : lengths[i]]
    adv, ret = compute_advantages(
        algo,
        rewards=rewards,
        group_ids=groups,
        response_mask=resp2,
        loss_mask=loss2,
        policy_logprobs=pol2,
        ref_logprobs=ref2,
        old_values=val2,
    )
    for i, pos in enumerate(where):
        torch.testing.assert_close(adv[i, pos], plain_adv[i, : lengths[i]], rtol=0, atol=1e-6)
        assert bool((adv[i][loss2[i] == 0] == 0).all())
        if ret is not None:
            torch.testing.assert_close(ret[i, pos], plain_ret[i, : lengths[i]], rtol=0, atol=1e-6)
            assert bool((ret[i][loss2[i] == 0] == 0).all())


def test_mis_keeps_a_ratio_exactly_at_either_bound():
    """MIS keeps ``mis_low <= w <= mis_high``: a ratio exactly at a bound is inside (``>``/``<``
    would drop it). old == rollout gives w = exp(0) = 1.0 exactly; the other tokens are 2 and 1/2."""
    old = torch.tensor([[0.0, 0.0, 0.0]])
    rollout = torch.tensor([[0.0, -math.log(2.0), math.log(2.0)]])  # w = 1, 2, 1/2
    mask = torch.ones(1, 3)
    _, keep, _ = rollout_correction(old, rollout, mask, mis_low=1.0, mis_high=1.5)  # w = 1 at the lower bound
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 0.0]]))
    _, keep, _ = rollout_correction(old, rollout, mask, mis_low=0.75, mis_high=1.0)  # w = 1 at the upper bound
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 0.0]]))
    # sequence level: the geometric mean of (1, 1, 1) is exactly 1, at either bound: the sequence is kept
    _, keep, _ = rollout_correction(old, old, mask, mis_low=1.0, mis_high=2.0, mis_level="sequence")
    torch.testing.assert_close(keep, mask)
    _, keep, _ = rollout_correction(old, old, mask, mis_low=0.5, mis_high=1.0, mis_level="sequence")
    torch.testing.assert_close(keep, mask)


def test_dr_grpo_is_dispatched_without_the_std_division():
    """compute_advantages with estimator='dr_grpo' only centres the rewards, even though
    algo.normalize_std defaults to true (that flag is GRPO's); 'grpo' divides by the group std."""
    from strop.algo.advantages import compute_advantages
    from strop.config import AlgoConfig

    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    # mean 0.25; sample std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25])
    for estimator, expected in (("dr_grpo", centred), ("grpo", centred / (0.5 + 1e-6))):
        algo = AlgoConfig(estimator=estimator)
        assert algo.normalize_std
        adv, returns = compute_advantages(algo, rewards=rewards, group_ids=groups, response_mask=mask, loss_mask=mask)
        torch.testing.assert_close(adv, expected.unsqueeze(-1) * mask, rtol=0, atol=1e-6, msg=estimator)
        assert returns is None
