import math

import torch

from strop.algo.advantages import grpo_advantages
from strop.algo.losses import ppo_clip_loss


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5])
    groups = torch.tensor([0, 0, 0, 0, 3, 3, 3])
    adv = grpo_advantages(rewards, groups)
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6), 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=0, atol=1e-6)
    centred = grpo_advantages(rewards, groups, normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0]))


def test_grpo_groups_need_not_be_contiguous_and_singletons_are_zero():
    adv = grpo_advantages(torch.tensor([3.0, 1.0, 5.0]), torch.tensor([2, 9, 2]))
    torch.testing.assert_close(adv, torch.tensor([-1 / (math.sqrt(2) + 1e-6), 0.0, 1 / (math.sqrt(2) + 1e-6)]))


def test_ppo_clip_by_hand_both_sides_and_mask():
    # one sequence, four tokens; old logprob 0 so ratio = exp(logprob)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 3.0]])
    logprobs = ratios.log().requires_grad_(True)
    old = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last token is masked out
    pos = torch.ones(1, 1)
    loss, m = ppo_clip_loss(logprobs, old, pos, mask, clip_low=0.2, clip_high=0.28)
    # A=+1: token 0 clipped at 1.28 -> -1.28; token 1 below: max(-0.5, -0.8) = -0.5; token 2: -1.1
    assert math.isclose(loss.item(), (-1.28 - 0.5 - 1.1) / 3, rel_tol=1e-6)
    assert m == {"clipped_tokens": 1, "loss_tokens": 3}
    loss.backward()
    # gradient flows only through unclipped, unmasked tokens: d(-ratio)/dlogprob = -ratio, / 3 tokens
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3, 0.0]]))

    neg = -torch.ones(1, 1)
    lp2 = ratios.log().requires_grad_(True)
    loss2, m2 = ppo_clip_loss(lp2, old, neg, mask, clip_low=0.2, clip_high=0.28)
    # A=-1: token 0: max(1.5, 1.28) = 1.5 (unclipped); token 1: max(0.5, 0.8) = 0.8 (clipped low); token 2: 1.1
    assert math.isclose(loss2.item(), (1.5 + 0.8 + 1.1) / 3, rel_tol=1e-6)
    assert m2["clipped_tokens"] == 1


def test_ppo_normalizer_is_the_step_token_count():
    lp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0], [2.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, _ = ppo_clip_loss(lp, lp, adv, mask, normalizer=10.0)
    assert math.isclose(loss.item(), -(1 + 1 + 2) / 10, rel_tol=1e-6)
