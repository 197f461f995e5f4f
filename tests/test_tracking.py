"""TensorBoard and offline wandb receive every step metric (read back from their files); samples.jsonl;
a missing tracker package fails before the run starts; ``strop plot``."""

import glob
import json
import struct
import sys

import pytest

from strop.config import build_config
from strop.loop import train
from tests.test_e2e import tiny_overrides


def _wandb_history(run_dir) -> dict[int, dict]:
    """The history rows of an offline wandb run, by step (the .wandb file is a LevelDB-style log of
    protobuf records after a 7-byte header; blocks of 32 KiB)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    buf = open(path, "rb").read()
    assert buf[:4] == b":W&B"
    pos, parts, out = 7, b"", {}
    while pos + 7 <= len(buf):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", buf[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:
            pos += left
            continue
        data, pos = buf[pos + 7 : pos + 7 + n], pos + 7 + n
        parts = data if kind in (1, 2) else parts + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            if record.WhichOneof("record_type") == "history":
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                out[row["_step"]] = out.get(row["_step"], {}) | row
    return out


@pytest.mark.timeout(300)
def test_tensorboard_and_offline_wandb_get_every_step_metric(tiny_model_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    cfg = tiny_overrides(
        tiny_model_dir,
        run_dir,
        run={"trackers": ["tensorboard", "wandb"], "log_samples": 2, "save_final": False, "plot": False},
    )
    train(build_config(overrides=cfg))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 2

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    for key in ("reward_mean", "loss", "grad_norm", "entropy", "train_rollout_logprob_abs_diff"):
        events = tb.Scalars(key)  # TensorBoard keeps float32
        assert [e.step for e in events] == [r["step"] for r in steps]
        assert [e.value for e in events] == pytest.approx([r[key] for r in steps], rel=1e-6, abs=1e-12)
    assert [e.step for e in tb.Scalars("eval_accuracy")] == [0, 1, 2]
    evals = [r for r in rows if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and all(0.0 <= r["eval_reward_mean"] <= 1.0 for r in evals)
    assert [e.step for e in tb.Scalars("eval_reward_mean")] == [0, 1, 2]
    assert "samples/text_summary" in tb.Tags()["tensors"]

    history = _wandb_history(run_dir)
    for r in rows:
        for k, v in r.items():
            if k != "step" and isinstance(v, float):
                assert history[r["step"]][k] == pytest.approx(v), (r["step"], k)
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 2

    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]
    assert all(s["prompt"] and isinstance(s["response"], str) and s["reward"] is not None for s in samples)


def test_eval_and_rollout_accuracy_use_the_threshold():
    from strop.config import build_config
    from strop.observe.metrics import eval_metrics, rollout_metrics
    from strop.types import Sample, Status

    def sample(reward):
        s = Sample(prompt="p", prompt_ids=[1, 2], group_id=0, index=0)
        s.append([3, 4], [-1.0, -1.0])
        s.status, s.reward = Status.COMPLETED, reward
        return s

    rewards = [0.5, 0.8, None, 0.2, 0.75]  # a reward scaled to 0..0.8; one prompt unscored
    groups = [[sample(r)] for r in rewards]
    # default threshold 1.0: nothing is correct; the mean is over the 4 scored: (0.5 + 0.8 + 0.2 + 0.75) / 4
    assert eval_metrics(groups) == pytest.approx({"eval_accuracy": 0.0, "eval_reward_mean": 0.5625})
    # 0.75: 0.8 and 0.75 reach it, of 5 prompts (the unscored one counts as wrong)
    assert eval_metrics(groups, 0.75) == pytest.approx({"eval_accuracy": 0.4, "eval_reward_mean": 0.5625})
    assert rollout_metrics(groups, 1.0)["accuracy"] == 0.0
    assert rollout_metrics(groups, 1.0, 0.75)["accuracy"] == pytest.approx(0.5)  # 2 of the 4 scored samples
    assert rollout_metrics(groups, 1.0, 0.5)["accuracy"] == pytest.approx(0.75)
    assert build_config(overrides={"eval": {"accuracy_threshold": 0.5}}).eval.accuracy_threshold == 0.5
    assert build_config().eval.accuracy_threshold == 1.0


def test_a_missing_tracker_package_fails_before_the_run_starts(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from strop.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # what Python does for a package that is not installed
    run_dir = tmp_path / "run"
    code = main(["train", f"--model.path={tiny_model_dir}", '--run.trackers=["wandb"]', f"--run.dir={run_dir}"])
    assert code == 1
    assert "pip install -e '.[wandb]'" in capsys.readouterr().err
    assert not run_dir.exists()


def test_strop_plot_draws_several_runs(tmp_path, capsys):
    from strop.cli import main

    for name, rewards in (("a", [0.1, 0.5]), ("b", [0.2, 0.3])):
        (tmp_path / name).mkdir()
        rows = [{"step": 0, "eval_accuracy": 0.1}] + [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "cmp.png"
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), f"--out={out}"]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "2 metrics of 2 runs" in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "a"), "--metrics=kl_ref"]) == 1
    assert "no run has kl_ref" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
