"""Shared-prefix rows (train.shared_prefix): each group's common prefix forwarded once. The layout by
hand; logprobs and every gradient equal the unshared paths' (padded and packed) within 1e-6 in fp32, for
the losses, KL, a critic, chunked logprobs, several micro-batch splits and multi-turn groups."""

import copy

import pytest
import torch

from strop.algo.config import AlgoConfig
from strop.config import ConfigError, build_config
from strop.parallel.prefix import collate_shared_prefix, common_prefix, split_by_group, tree_tokens
from strop.parallel.strategy import SingleProcess
from strop.train.config import TrainConfig
from strop.train.logprob import response_logprobs
from strop.train.trainer import Sampling, Trainer, collate
from strop.types import Sample, Status
from tests.test_trainer import PRESET_LIKE, run_step


def _sample(prompt, response, group, index, logprob=-5.0):
    s = Sample(prompt="p", prompt_ids=list(prompt), group_id=group, index=index)
    s.append(list(response), [logprob - 0.1 * k for k in range(len(response))])
    s.status, s.reward = Status.COMPLETED, float((group * 7 + index * 3) % 5) / 4
    return s


def grouped_samples(groups=3, n=4, seed=0, shared_response=2):
    """``groups`` GRPO groups of ``n``: one prompt each; half of a group's responses begin with the same
    ``shared_response`` tokens (the shared prefix runs into the responses), one is a prefix of another,
    one group has a single member; a masked token here and there."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(groups):
        prompt = torch.randint(3, 500, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        start = torch.randint(3, 500, (shared_response,), generator=g).tolist()
        size = 1 if k == groups - 1 else n
        for i in range(size):
            R = int(torch.randint(1, 8, (1,), generator=g))
            response = torch.randint(3, 500, (R,), generator=g).tolist()
            if i % 2 == 0:
                response = start + response
            if i == 3:  # a response that is a prefix of sample 1's
                response = out[-2].response_ids[: max(1, out[-2].response_length - 2)]
            s = _sample(prompt, response, k, i)
            if i == 1 and s.response_length > 1:
                s.loss_mask[-1] = 0
            out.append(s)
    return out


def test_a_group_is_laid_out_as_its_common_prefix_then_each_samples_own_tokens():
    a = _sample([5, 6, 7], [8, 9], group=0, index=0)
    b = _sample([5, 6, 7], [8, 10, 11], group=0, index=1)
    c = _sample([20, 21], [22], group=1, index=0)
    batch = collate_shared_prefix([a, b, c])
    # group 0: prefix 5 6 7 8 (the responses share their first token), then 9 | 10 11; group 1 alone: 20 21 22
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 20, 21, 22]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 5, 0, 1, 2]]
    # response tokens: a's 8 (col 3) 9 (col 4); b's 8 (col 3) 10 (col 5) 11 (col 6); c's 22 (col 9)
    assert batch["positions"].tolist() == [[3, 4, 3, 5, 6, 9]]
    # each predicted by its own sequence's previous token: 8 by 7 (col 2), 9 by 8 (3), 10 by 8 (3), 11 by 10 (5)
    assert batch["pred_positions"].tolist() == [[2, 3, 2, 3, 5, 8]]
    mask = batch["attention_mask"][0, 0]
    assert mask[5].tolist() == [1, 1, 1, 1, 0, 1, 0, 0, 0, 0]  # b's 10 sees the prefix and itself, not a's 9
    assert mask[6].tolist() == [1, 1, 1, 1, 0, 1, 1, 0, 0, 0]
    assert mask[9].tolist() == [0] * 7 + [1, 1, 1]  # group 1 sees nothing of group 0
    assert batch["tokens"] == 10 and batch["tokens_unshared"] == 5 + 6 + 3 == tree_tokens([a, b, c]) + 4
    assert common_prefix([[1, 2, 3], [1, 2], [1, 2, 4]]) == 2 and common_prefix([[1, 2]]) == 0


def test_micro_batches_keep_groups_together_within_their_bounds():
    samples = grouped_samples(groups=4, n=4)
    order = list(range(len(samples)))[::-1]
    by_count = split_by_group(order, samples, micro_batch_size=6, max_tokens=None)
    assert sorted(i for mb in by_count for i in mb) == sorted(order)
    assert all(len(mb) <= 6 for mb in by_count)
    assert all(len({samples[i].group_id for i in mb}) == 1 for mb in by_count if len(mb) == 4)
    assert [len(mb) for mb in by_count] == [4, 4, 5]  # whole groups of 4 (two never fit in 6); the single one joins
    budget = 40
    by_tokens = split_by_group(order, samples, micro_batch_size=6, max_tokens=budget)
    assert all(tree_tokens([samples[i] for i in mb]) <= budget or len(mb) == 1 for mb in by_tokens)


def test_rows_stay_under_their_token_cap_and_a_micro_batch_sharing_nothing_keeps_its_layout(tiny_model, monkeypatch):
    import strop.parallel.prefix as prefix

    samples = grouped_samples(groups=3, n=4)
    monkeypatch.setattr(prefix, "ROW_TOKENS", 15)
    rows = split_by_group(list(range(len(samples))), samples, micro_batch_size=16, max_tokens=None)
    assert all(tree_tokens([samples[i] for i in mb]) <= 15 or len(mb) == 1 for mb in rows)
    assert len(rows) > 3  # (16 samples would have fit: the cap cut them)
    lone = [_sample([5, 6], [7], 0, 0), _sample([8, 9], [10, 11], 1, 0)]  # two groups of one: nothing shared
    trainer = Trainer(
        copy.deepcopy(tiny_model),
        pad_token_id=0,
        train=TrainConfig(),
        algo=AlgoConfig(),
        rollout=Sampling(max_new_tokens=8),
        parallel=SingleProcess("cpu"),
    )
    assert "pred_positions" not in trainer._collate(lone)  # padded rows, a 2D mask: no (L, L) one for nothing
    assert trainer._collate(samples[:4])["attention_mask"].dim() == 4
    _, m = run_step(copy.deepcopy(tiny_model), lone, shared_prefix=True)
    assert m["shared_prefix_tokens_saved"] == 0.0


def test_shared_logprobs_equal_the_padded_rows_logprobs(tiny_model):
    samples = grouped_samples()
    padded = collate(samples, pad_token_id=0)
    shared = collate_shared_prefix(samples)
    assert shared["tokens"] < shared["tokens_unshared"]
    with torch.no_grad():
        lp_pad, ent_pad = response_logprobs(
            tiny_model, padded["input_ids"], padded["attention_mask"], padded["positions"], with_entropy=True
        )
        lp, ent = response_logprobs(
            tiny_model,
            shared["input_ids"],
            shared["attention_mask"],
            shared["positions"],
            with_entropy=True,
            position_ids=shared["position_ids"],
            pred_positions=shared["pred_positions"],
        )
    from strop.parallel.packing import unpack

    mask = padded["response_mask"]
    for got, want in ((unpack(lp, shared), lp_pad), (unpack(ent, shared), ent_pad)):
        # within 1e-6 of each value's size: these logprobs are about -20, where one float32 step is 1.9e-6
        assert ((got - want).abs() * mask <= 1e-6 * want.abs().clamp(min=1)).all()


def _gradients(trainer) -> list[torch.Tensor]:
    """The clipped gradient of every parameter (policy, then critic), from AdamW's first moment."""
    out = []
    for opt in [trainer.optimizer] + ([trainer.critic_optimizer] if trainer.critic is not None else []):
        beta1 = opt.param_groups[0]["betas"][0]
        out += [opt.state[p]["exp_avg"] / (1 - beta1) for p in opt.param_groups[0]["params"]]
    return out


def assert_same_step(a, b, atol=1e-6, grad_atol=None):
    """Loss and gradient norm within ``atol`` (the norm: of its size), every gradient element within
    ``grad_atol`` (default ``atol``)."""
    (ta, ma), (tb, mb) = a, b
    assert abs(ma["loss"] - mb["loss"]) <= atol
    assert abs(ma["grad_norm"] - mb["grad_norm"]) <= atol * max(1.0, abs(ma["grad_norm"])), (ma, mb)
    worst = max((x - y).abs().max().item() for x, y in zip(_gradients(ta), _gradients(tb)))
    assert worst <= (grad_atol or atol), worst
    if ta.critic is not None:
        assert abs(ma["value_loss"] - mb["value_loss"]) <= atol


@pytest.mark.parametrize("algo", PRESET_LIKE, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_a_shared_step_equals_the_padded_step(tiny_model, algo):
    samples = grouped_samples()
    padded = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=5, **algo)
    shared = run_step(copy.deepcopy(tiny_model), samples, micro_batch_size=5, shared_prefix=True, **algo)
    assert shared[1]["shared_prefix_tokens_saved"] > 0.2
    assert shared[1]["train_tokens_forwarded"] < padded[1]["train_tokens_forwarded"]
    assert_same_step(padded, shared)


@pytest.mark.parametrize(
    "split",
    [
        dict(micro_batch_size=3),  # groups cut into pieces, each sharing its own prefix
        dict(micro_batch_size=64),  # every group in one row
        dict(max_tokens=30),  # packed by tokens
        dict(micro_batch_size=4, logprob_chunk_size=5),  # chunked logprobs
        dict(micro_batch_size=4, mini_batches=2),
        dict(micro_batch_size=4, estimator="ppo", kl_in_reward_coef=0.01, kl_coef=0.1),  # critic, KL
    ],
    ids=["pieces", "one-row", "packed", "chunked", "mini-batches", "critic-kl"],
)
def test_a_shared_step_equals_the_packed_step_for_each_split(tiny_model, split):
    samples = grouped_samples(groups=4, seed=3)
    tokens = split.pop("max_tokens", None)
    fp64 = "estimator" not in split  # (the critic's value head is built in fp32)
    for model, atol, grad_atol in _precisions(tiny_model, chunked="logprob_chunk_size" in split, fp64=fp64):
        packed = run_step(copy.deepcopy(model), samples, max_tokens=tokens or 10_000, **split)
        shared = run_step(copy.deepcopy(model), samples, max_tokens=tokens, shared_prefix=True, **split)
        assert_same_step(packed, shared, atol, grad_atol)


def _precisions(model, chunked=True, fp64=True):
    """The model in fp32 (the paths' matmuls have other shapes, so other roundings: every gradient within
    1e-6 on a Xeon, but up to 3.3e-6 on an AMD EPYC for the chunked and multi-turn cases, gradients of
    0.14-0.2 at most), and in fp64, where those roundings vanish and the paths must agree to 1e-7 (measured:
    1.0e-8, the fp32 stages inside the logprob)."""
    yield model, 1e-6, 5e-6 if chunked else 1e-6
    if fp64:
        yield model.double(), 1e-7, 1e-7


def test_multi_turn_segments_share_their_longest_common_prefix(tiny_model):
    """An agent group: turn 2's samples carry turn 1 and the tool's answer in their prompt; the group's
    rows share everything up to where they part."""
    turn1 = [7, 8, 9, 10, 11, 12]
    samples = [
        _sample(turn1 + [40, 41], [50, 51, 52], 0, 0),
        _sample(turn1 + [40, 41, 60, 61], [70, 71], 0, 1),  # a later turn of the same conversation
        _sample(turn1 + [42], [53, 54], 0, 2),
    ]
    batch = collate_shared_prefix(samples)
    assert batch["tokens"] == 6 + (2 + 3) + (4 + 2) + (1 + 2)  # the first turn once
    for model, atol, grad_atol in _precisions(tiny_model):
        padded = run_step(copy.deepcopy(model), samples, micro_batch_size=3)
        shared = run_step(copy.deepcopy(model), samples, micro_batch_size=3, shared_prefix=True)
        assert_same_step(padded, shared, atol, grad_atol)


def test_it_is_on_by_default_and_refused_or_off_where_it_cannot_hold(tiny_model):
    def trainer(**train):
        return Trainer(
            copy.deepcopy(tiny_model),
            pad_token_id=0,
            train=TrainConfig(**train),
            algo=AlgoConfig(),
            rollout=Sampling(max_new_tokens=8),
            parallel=SingleProcess("cpu"),
        )

    assert trainer().shared_prefix
    assert "each group's common prefix forwarded once" in trainer().describe_layout()
    off = trainer(shared_prefix=False)
    assert not off.shared_prefix and "no shared prefix (train.shared_prefix=false)" in off.describe_layout()
    with pytest.raises(ConfigError, match="flash_attention_2' takes no"):
        build_config(
            overrides={"train": {"shared_prefix": True}, "model": {"attn_implementation": "flash_attention_2"}}
        )
    with pytest.raises(ConfigError, match="context_parallel_size=2 splits rows"):
        build_config(overrides={"train": {"shared_prefix": True}, "parallel": {"context_parallel_size": 2}})
