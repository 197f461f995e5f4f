import copy

import pytest
import torch

from strop.parallel.packing import collate_packed, pack_by_token_budget, unpack
from strop.train.logprob import response_logprobs
from strop.train.trainer import collate
from tests.test_trainer import assert_same_update, make_samples, run_step


def test_first_fit_decreasing_respects_the_budget():
    lengths = [5, 9, 3, 7, 2, 12, 4]
    bins = pack_by_token_budget(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 10 or len(b) == 1  # 12 > 10 travels alone
    # by hand, longest first: 12 alone (over budget); 9; 7; 5; 4 fits after 5; 3 after 7; 2 fits nowhere
    assert bins == [[5], [1], [3, 2], [0, 6], [4]]


def test_packed_logprobs_equal_padded_logprobs(tiny_model):
    samples = make_samples(5)
    padded = collate(samples, pad_token_id=0)
    packed = collate_packed(samples)
    assert packed["input_ids"].shape == (1, sum(s.total_length for s in samples))  # no padding at all
    with torch.no_grad():
        lp_pad, ent_pad = response_logprobs(
            tiny_model, padded["input_ids"], padded["attention_mask"], padded["positions"], with_entropy=True
        )
        lp_pack, ent_pack = response_logprobs(
            tiny_model,
            packed["input_ids"],
            packed["attention_mask"],
            packed["positions"],
            with_entropy=True,
            position_ids=packed["position_ids"],
        )
    mask = padded["response_mask"]
    torch.testing.assert_close(unpack(lp_pack, packed) * mask, lp_pad * mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(unpack(ent_pack, packed) * mask, ent_pad * mask, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "algo",
    [dict(), dict(loss_agg="seq_mean_token_mean", kl_coef=0.1), dict(estimator="ppo", kl_in_reward_coef=0.01)],
    ids=["grpo", "kl", "ppo"],
)
def test_packed_update_equals_padded_update(tiny_model, algo):
    samples = make_samples(8)
    padded = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=3, **algo)
    packed = run_step(copy.deepcopy(tiny_model), samples, max_tokens=20, **algo)
    assert_same_update(padded, packed)
