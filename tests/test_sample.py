import pytest

from strop.types import Completion, Sample, SampleInvariantError, Status


def make():
    return Sample(prompt="q", prompt_ids=[1, 2, 3], label="4", group_id=7, index=1)


def test_append_keeps_every_per_token_list_in_step():
    s = make()
    s.append([10, 11], [-0.5, -0.25], weight_version=3)
    s.append([12, 13, 14], trainable=False, weight_version=3)  # tool output
    assert s.response_ids == [10, 11, 12, 13, 14]
    assert s.loss_mask == [1, 1, 0, 0, 0]
    assert s.rollout_logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0]
    assert s.weight_versions == [3] * 5
    assert s.total_length == 8 and s.response_length == 5


def test_trainable_tokens_need_logprobs():
    with pytest.raises(SampleInvariantError, match="need logprobs"):
        make().append([1, 2])


def test_logprob_count_must_match():
    with pytest.raises(SampleInvariantError, match="2 token ids but 1 logprobs"):
        make().append([1, 2], [-0.1])


def test_broken_lengths_fail_loudly_and_name_the_sample():
    s = make()
    s.append([1], [-0.1])
    s.loss_mask.append(1)
    with pytest.raises(SampleInvariantError, match=r"group=7 index=1.*loss_mask has 2"):
        s.check()
    with pytest.raises(SampleInvariantError):
        Sample(prompt="q", prompt_ids=[1], response_ids=[5], rollout_logprobs=[], loss_mask=[1], weight_versions=[0])


def test_loss_mask_values_are_checked():
    with pytest.raises(SampleInvariantError, match="0 and 1"):
        Sample(prompt="q", prompt_ids=[1], response_ids=[5], rollout_logprobs=[0.0], loss_mask=[2], weight_versions=[0])


@pytest.mark.parametrize("reason,status", [("stop", Status.COMPLETED), ("length", Status.TRUNCATED), ("abort", Status.ABORTED)])
def test_completion_sets_status(reason, status):
    s = make()
    s.apply_completion(Completion([5, 6], [-1.0, -2.0], reason, weight_version=4))
    assert s.status is status and s.weight_versions == [4, 4]
    assert s.status.trainable == (status in (Status.COMPLETED, Status.TRUNCATED))


def test_reset_response_starts_clean():
    s = make()
    s.apply_completion(Completion([5], [-1.0], "stop", 1))
    s.reward = 1.0
    s.reset_response()
    assert (s.response_ids, s.loss_mask, s.reward, s.status) == ([], [], None, Status.PENDING)
    assert not Status.ABORTED.trainable and not Status.FAILED.trainable and not Status.PENDING.trainable
