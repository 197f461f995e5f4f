import re

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


@pytest.mark.parametrize(
    "reason,status", [("stop", Status.COMPLETED), ("length", Status.TRUNCATED), ("abort", Status.ABORTED)]
)
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


def test_numpy_values_in_label_and_metadata_become_the_python_values_a_checkpoint_loads_back(tmp_path):
    """A reasoning-gym entry holds numpy strings and tuples; a hook may return numpy numbers and arrays: the
    sample keeps them as Python values (what .item() / .tolist() give), which torch's safe loader reads back."""
    import numpy as np
    import torch

    from strop.checkpoint import _safe_load

    s = Sample(
        prompt="q",
        prompt_ids=[1],
        label=np.str_("Amelia"),
        metadata={
            "score": np.float64(0.5),
            "names": [np.str_("Amelia"), "Ben"],
            "solution": (np.bool_(True), False),
            "grid": np.arange(4, dtype=np.int32).reshape(2, 2),
            "nested": {np.str_("k"): np.int64(3)},
            "kept": (1, "a"),
        },
    )
    expected = {
        "score": 0.5,
        "names": ["Amelia", "Ben"],
        "solution": (True, False),
        "grid": [[0, 1], [2, 3]],
        "nested": {"k": 3},
        "kept": (1, "a"),
    }
    assert s.metadata == expected and s.label == "Amelia" and type(s.label) is str
    assert [
        type(x)
        for x in (
            s.metadata["score"],
            s.metadata["names"][0],
            s.metadata["solution"][0],
            s.metadata["grid"][0][0],
            s.metadata["nested"]["k"],
        )
    ] == [float, str, bool, int, int]
    assert type(next(iter(s.metadata["nested"]))) is str
    torch.save({"ready": [[s]]}, tmp_path / "controller.pt")
    back = _safe_load(tmp_path / "controller.pt")["ready"][0][0]
    assert back == s and back.metadata["solution"] == (True, False)
    plain = {"a": [1, 2.5, "x"], "b": (None, True)}
    assert Sample(prompt="q", prompt_ids=[1], metadata=plain).metadata is plain  # nothing to convert: not copied


@pytest.mark.parametrize(
    "metadata,where,kind",
    [
        ({"entry": {"when": __import__("datetime").date(2024, 1, 1)}}, "metadata['entry']['when']", "datetime.date"),
        ({"xs": [1, object()]}, "metadata['xs'][1]", "builtins.object"),
        ({"a": __import__("numpy").array([1, object()], dtype=object)}, "metadata['a'][1]", "builtins.object"),
    ],
)
def test_a_metadata_value_a_checkpoint_cannot_hold_is_refused_at_the_sample_with_its_path(metadata, where, kind):
    with pytest.raises(
        SampleInvariantError,
        match=rf"sample group=7 index=1 {re.escape(where)}: {kind} cannot be "
        "saved in a checkpoint; use Python numbers",
    ):
        Sample(prompt="q", prompt_ids=[1], group_id=7, index=1, metadata=metadata)
    with pytest.raises(SampleInvariantError, match=r"sample group=0 index=0 label: builtins.object cannot be saved"):
        Sample(prompt="q", prompt_ids=[1], label=object())


def test_a_knights_and_knaves_sample_loads_back_from_a_checkpoint_and_still_scores(tmp_path):
    """The shipped reasoning-gym task knights_knaves puts numpy strings and tuples in its entries: its samples
    round-trip through the checkpoint's safe loader, and the task's own scorer still scores them."""
    pytest.importorskip("reasoning_gym")
    import torch

    from strop.checkpoint import _safe_load
    from strop.data.sources import reasoning_gym_rows
    from strop.rollout.rewards import reasoning_gym_reward

    row = reasoning_gym_rows("knights_knaves", seed=1, size=1, options={})[0]
    s = Sample(prompt=row.prompt, prompt_ids=[1, 2], label=row.label, metadata=dict(row.metadata, row_index=0))
    s.append([3], [-0.5])
    s.response_text = row.label
    torch.save({"ready": [[s]]}, tmp_path / "controller.pt")
    back = _safe_load(tmp_path / "controller.pt")["ready"][0][0]
    assert back == s and back.metadata["reasoning_gym_entry"]["answer"] == row.label
    assert reasoning_gym_reward(back) == 1.0
    back.response_text = "nonsense"
    assert reasoning_gym_reward(back) < 1.0
