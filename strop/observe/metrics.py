"""Run outputs: metrics.jsonl, summary.json, the reward/accuracy plot, the progress bar."""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path


class MetricsLog:
    """``metrics.jsonl`` (one row per step and per evaluation), ``samples.jsonl`` (a few readable
    samples per step), and the trackers that receive both (strop.observe.tracking)."""

    def __init__(self, run_dir: Path):
        self.path, self.samples_path = run_dir / "metrics.jsonl", run_dir / "samples.jsonl"
        self.rows: list[dict] = []
        self.trackers: list = []

    def reload(self) -> None:
        """The rows already written (a resumed run)."""
        self.rows = [json.loads(x) for x in self.path.read_text().splitlines()] if self.path.exists() else []

    def log(self, row: dict) -> None:
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for t in self.trackers:
            t.log(row, row["step"])

    def samples(self, rows: list[dict], step: int) -> None:
        if not rows:
            return
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        for t in self.trackers:
            t.samples(rows, step)

    def close(self) -> None:
        trackers, self.trackers = self.trackers, []
        for t in trackers:
            t.close()


# measurements of this machine and moment (time, speed, memory): they differ between two runs of
# the same config; every other metric is a function of the config and seed (docs/checkpoints.md)
MEASURED_SUFFIXES = ("_seconds", "_per_s", "_gib")


def reproducible(row: dict) -> dict:
    """``row`` without its measured entries: what two runs of one config must agree on exactly."""
    return {k: v for k, v in row.items() if not k.endswith(MEASURED_SUFFIXES)}


def memory_metrics(device) -> dict[str, float]:
    """This process's peak resident memory and, on a GPU, the peak memory torch allocated there (GiB)."""
    import resource

    import torch

    out = {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # kB on Linux
    if device.type == "cuda":
        out["cuda_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


def eval_metrics(groups, threshold: float = 1.0) -> dict:
    """Greedy evaluation (one sample per group): ``eval_accuracy``, the fraction of prompts whose reward reaches
    ``threshold`` (``eval.accuracy_threshold``; an unscored one counts as wrong), and ``eval_reward_mean`` over
    the scored ones."""
    rewards = [g[0].reward for g in groups if g[0].reward is not None]
    return {
        "eval_accuracy": sum(r >= threshold for r in rewards) / len(groups),
        "eval_reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
    }


def rollout_metrics(groups, seconds: float, threshold: float = 1.0) -> dict:
    """One step's rollout: rewards, lengths, what ended how, generation speed, failures and tool use.
    ``accuracy``: the fraction of scored samples whose reward reaches ``threshold`` (``eval.accuracy_threshold``)."""
    samples = [s for g in groups for s in g]
    rewards = [s.reward for s in samples if s.reward is not None]
    lengths = [s.response_length for s in samples]
    return (
        {
            "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
            "accuracy": sum(r >= threshold for r in rewards) / max(len(rewards), 1),
            "response_length_mean": statistics.fmean(lengths),
            "response_length_min": min(lengths),
            "response_length_max": max(lengths),
            "truncated_fraction": sum(s.status.value == "truncated" for s in samples) / len(samples),
            "failed_fraction": sum(s.status.value == "failed" for s in samples) / len(samples),
            "aborted_fraction": sum(s.status.value == "aborted" for s in samples) / len(samples),
            "zero_advantage_group_fraction": sum(len({s.reward for s in g}) == 1 for g in groups) / len(groups),
            "rollout_tokens_per_s": sum(lengths) / seconds,
            "rollout_seconds": seconds,
        }
        | failure_counts(samples)
        | tool_metrics(samples)
        | agent_metrics(samples)
    )


def agent_metrics(samples) -> dict:
    """Agent sessions (their samples carry ``agent_session``): forks, calls and how sessions ended."""
    first = [s for s in samples if "agent_session" in s.metadata and s.metadata.get("segment", 0) == 0]
    if not first:
        return {}
    out = {
        "agent_sessions_ended": len(first),
        "agent_forks": sum(max(s.metadata.get("segments", 1) - 1, 0) for s in first),  # (0 segments: no call)
        "agent_forked_session_fraction": sum(s.metadata.get("segments", 1) > 1 for s in first) / len(first),
        "agent_calls_per_session": statistics.fmean(s.metadata.get("session_calls", 0) for s in first),
    }
    for state in sorted({s.metadata.get("session_state", "?") for s in first}):
        out[f"agent_sessions/{state}"] = sum(s.metadata.get("session_state") == state for s in first)
    return out


def tool_metrics(samples) -> dict:
    """Multi-turn samples (they carry ``tool_calls``): calls, errors and turns per sample."""
    multi = [s for s in samples if "tool_calls" in s.metadata]
    if not multi:
        return {}
    calls = [s.metadata["tool_calls"] for s in multi]
    return {
        "tool_calls_mean": statistics.fmean(calls),
        "tool_calls_max": max(calls),
        "tool_call_fraction": sum(c > 0 for c in calls) / len(multi),
        "tool_errors_per_call": sum(s.metadata["tool_errors"] for s in multi) / max(sum(calls), 1),
        "turns_mean": statistics.fmean(s.metadata["turns"] for s in multi),
    }


def failure_counts(samples) -> dict:
    """How many samples failed and why: ``failed_samples`` and ``failed/<stage>/<error type>`` counts
    (the error texts are in run_dir/failed_samples.jsonl)."""
    out = {"failed_samples": 0}
    for s in samples:
        if s.status.value == "failed":
            out["failed_samples"] += 1
            why = (
                f"failed/{s.metadata.get('error_stage', 'rollout')}/{s.metadata.get('error', 'unknown').split(':')[0]}"
            )
            out[why] = out.get(why, 0) + 1
    return out


def run_summary(rows: list[dict], seconds: float, run_dir: Path) -> dict:
    """summary.json of a completed run, from its metrics rows."""
    train_rows = [r for r in rows if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return {
        "status": "completed",
        "steps": len(train_rows),
        "wall_seconds": round(seconds, 1),
        "eval_accuracy_first": evals[0] if evals else None,
        "eval_accuracy_last": evals[-1] if evals else None,
        "eval_accuracy_curve": evals,
        "reward_mean_first": train_rows[0]["reward_mean"] if train_rows else None,
        "reward_mean_last": train_rows[-1]["reward_mean"] if train_rows else None,
        "max_train_rollout_logprob_abs_diff": max(
            (r["train_rollout_logprob_abs_diff"] for r in train_rows), default=None
        ),
        "run_dir": str(run_dir),
    }


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(run_dir / "summary.json")


def plot_curves(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    if train:
        ax.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="rollout reward (mean)")
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval_accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)"
        )
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Progress:
    """A tqdm bar showing step, reward, eval accuracy, elapsed and remaining time."""

    def __init__(self, total: int, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True)
        self.fields: dict = {}

    def update(self, n: int = 0, **fields) -> None:
        self.fields.update(
            {k: v for k, v in fields.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        )
        self.bar.set_postfix(
            {k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in self.fields.items()}, refresh=False
        )
        self.bar.update(n)
        if n == 0:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class Timer:
    def __init__(self):
        self.start = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.start


class StepStats:
    """One step's metrics as sums: token-weighted means, plain sums, maxima and last values.

    Each rank measures its own micro-batches; :meth:`absorb` adds every rank's
    :meth:`parts` (gathered by the data-parallel strategy) into one result.
    """

    def __init__(self):
        self.tok_sum, self.tok_n, self.raw, self.maxes, self.lasts = {}, {}, {}, {}, {}

    def tok(self, name, values, mask):
        self.tok_sum[name] = self.tok_sum.get(name, 0.0) + float((values * mask).sum())
        self.tok_n[name] = self.tok_n.get(name, 0.0) + float(mask.sum())

    def policy_tokens(self, tok: dict, mask) -> None:
        """The per-token statistics of :func:`strop.algo.objective.policy_objective`, under their metric names."""
        for name, key in (
            ("clip_fraction_low", "clipped_low"),
            ("clip_fraction_high", "clipped_high"),
            ("dual_clip_fraction", "dual_clipped"),
            ("approx_kl_old", "approx_kl_old"),
            ("kl_ref", "kl_ref"),
            ("importance_weight_mean", "importance_weight"),
            ("mis_masked_fraction", "mis_dropped"),
            ("opsm_masked_fraction", "opsm_dropped"),
        ):
            if key in tok:
                self.tok(name, tok[key], mask)
        self.max("importance_weight_max", (tok["importance_weight"] * mask).max().item())

    def ratio(self, name, hits: float, n: float):
        """A fraction summed over ranks: ``hits`` of ``n`` (a result of 0 when no rank counted any)."""
        self.tok_sum[name] = self.tok_sum.get(name, 0.0) + hits
        self.tok_n[name] = self.tok_n.get(name, 0.0) + n

    def add(self, name, value):
        self.raw[name] = self.raw.get(name, 0.0) + value

    def max(self, name, value):
        self.maxes[name] = max(self.maxes.get(name, -math.inf), value)

    def last(self, name, value):
        self.lasts[name] = value

    def parts(self) -> tuple:
        return self.tok_sum, self.tok_n, self.raw, self.maxes

    def absorb(self, all_parts: list[tuple]) -> None:
        """Replace the sums by the total of ``all_parts`` (every rank's :meth:`parts`)."""
        self.tok_sum, self.tok_n, self.raw, self.maxes = {}, {}, {}, {}
        for tok_sum, tok_n, raw, maxes in all_parts:
            for target, source in ((self.tok_sum, tok_sum), (self.tok_n, tok_n), (self.raw, raw)):
                for k, v in source.items():
                    target[k] = target.get(k, 0.0) + v
            for k, v in maxes.items():
                self.maxes[k] = max(self.maxes.get(k, -math.inf), v)

    def result(self) -> dict[str, float]:
        out = {k: v / max(self.tok_n[k], 1.0) for k, v in self.tok_sum.items()}
        return out | self.raw | self.maxes | self.lasts


def advantage_stats(advantages, mask) -> dict[str, float]:
    """Mean and standard deviation of the advantages over the tokens ``mask`` keeps (torch tensors)."""
    kept = advantages[mask > 0]
    return {"advantage_mean": kept.mean().item(), "advantage_std": kept.std().item() if kept.numel() > 1 else 0.0}


DEFAULT_PLOT_METRICS = (
    "reward_mean",
    "eval_accuracy",
    "response_length_mean",
    "entropy",
    "grad_norm",
    "train_rollout_logprob_abs_diff",
    "kl_ref",
    "step_seconds",
)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (not a strop run directory?)")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def plot_runs(run_dirs: list[Path], path: Path, metrics: list[str] | None = None) -> list[str]:
    """One panel per metric, one line per run (``strop plot``). Returns the metrics drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    present = {k for _, rows in runs for r in rows for k in r if k != "step"}
    if metrics:
        missing = [m for m in metrics if m not in present]
        if missing:
            raise ValueError(f"no run has {', '.join(missing)}; the runs have: {', '.join(sorted(present))}")
    else:
        metrics = [m for m in DEFAULT_PLOT_METRICS if m in present]
    cols = min(2, len(metrics))
    n_rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(6 * cols, 3.2 * n_rows), squeeze=False)
    names = [d.name if [x.name for x, _ in runs].count(d.name) == 1 else str(d) for d, _ in runs]
    for ax, metric in zip(axes.flat, metrics):
        for name, (_, rows) in zip(names, runs):
            pts = [(r["step"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) < 12 else "-", label=name, markersize=3)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics) :]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return metrics
