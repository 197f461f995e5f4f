"""The quickstart in each rollout mode, one after the other on this machine, side by side.

Each mode is a full `strop train` run of the default quickstart (plus any extra arguments)
with `--rollout.mode=MODE`; with --repeats 2 the modes run interleaved (A B C A B C), a table
per round. The table is read from each run's metrics.jsonl: seconds per step (the mean over
steps 2.. so start-up is not counted), how long a step waited for its groups (rollout_seconds),
the train step and the weight sync, held-out accuracy first and last, trained-token staleness,
the samples dropped (and how many as stale), and the pacing diagnostics: the trainer starved
(rollout_wait_seconds), generation idle behind the staleness bound (rollout_backpressure_seconds),
and the groups finished and waiting / generating against their bound when a step asked. Off-policy
modes add the correction given by --offpolicy-args (default: TIS with cap 2 against the rollout's
logprobs). The diagnostics of every run are drawn in ROOT/pacing.png (`strop plot`).

    python bench/rollout_modes.py [--modes sync one_step_off async] [--repeats 2] [-- extra strop train args]
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from common import timed_train


def run(mode: str, run_dir: Path, extra: list[str], offpolicy: list[str]) -> dict:
    wall, rows = timed_train(
        [f"--rollout.mode={mode}", "--run.progress=false", *(offpolicy if mode != "sync" else []), *extra],
        run_dir,
        mode,
    )
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    later = steps[1:] or steps
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in later)  # noqa: E731
    return {
        "mode": mode,
        "wall": wall,
        "step": mean("step_seconds"),
        "rollout_wait": mean("rollout_seconds"),
        "train": mean("train_seconds"),
        "sync": mean("weight_sync_seconds"),
        "eval_first": evals[0],
        "eval_last": evals[-1],
        "eval_best": max(evals),
        "staleness": statistics.fmean(r.get("staleness_mean", 0.0) for r in steps),
        "dropped": sum(r.get("samples_dropped", 0) for r in steps),
        "stale": sum(r.get("dropped/stale", 0) for r in steps),
        "starved": mean("rollout_wait_seconds"),
        "blocked": mean("rollout_backpressure_seconds"),
        "queue": mean("rollout_queue_groups"),
        "inflight": mean("rollout_inflight_groups"),
        "bound": mean("rollout_max_inflight"),
        "len_trained": statistics.fmean(r["response_length_trained_mean"] for r in steps),
        "len_generated": statistics.fmean(
            r["response_length_generated_mean"] for r in steps if "response_length_generated_mean" in r
        ),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"])
    ap.add_argument(
        "--offpolicy-args",
        default="--algo.tis_cap=2.0",
        help="extra arguments for the off-policy modes (default: TIS, cap 2)",
    )
    ap.add_argument("--keep", default=None, help="keep the run directories under this folder")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of all the modes, interleaved")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="strop-modes-"))
    offpolicy = shlex.split(args.offpolicy_args)
    dirs = []
    for k in range(args.repeats):
        results = []
        for m in args.modes:
            dirs.append(root / (f"{m}-{k + 1}" if args.repeats > 1 else m))
            results.append(run(m, dirs[-1], extra, offpolicy))
        table(results, extra, args.offpolicy_args, root, f"round {k + 1} of {args.repeats}")
    from strop.observe.metrics import plot_runs

    drawn = plot_runs(
        dirs, root / "pacing.png", [m for m in PACING if any(m in r for d in dirs for r in metrics_of(d))]
    )
    print(f"pacing diagnostics ({', '.join(drawn)}) of every run: {root / 'pacing.png'}")


PACING = (
    "rollout_wait_seconds",
    "rollout_backpressure_seconds",
    "rollout_queue_groups",
    "rollout_inflight_groups",
    "staleness_mean",
    "step_seconds",
)


def metrics_of(run_dir: Path) -> list[dict]:
    from strop.observe.metrics import read_metrics

    return read_metrics(run_dir)


def table(results: list[dict], extra: list[str], offpolicy: str, root: Path, title: str) -> None:
    base = results[0]["step"]
    print(f"strop train (quickstart) {' '.join(extra)}; off-policy modes: {offpolicy}; runs in {root}; {title}")
    head = (
        "mode",
        "s/step",
        "vs first",
        "rollout wait s",
        "train s",
        "sync s",
        "held-out first->last (best)",
        "staleness",
        "dropped (stale)",
        "trainer starved s",
        "generation idle s",
        "queue+generating/bound",
        "len trained/generated",
        "wall s",
    )
    print(" | ".join(head))
    for r in results:
        print(
            " | ".join(
                [
                    r["mode"],
                    f"{r['step']:.1f}",
                    f"{base / r['step']:.2f}x",
                    f"{r['rollout_wait']:.1f}",
                    f"{r['train']:.1f}",
                    f"{r['sync']:.2f}",
                    f"{r['eval_first']:.1%}->{r['eval_last']:.1%} ({r['eval_best']:.1%})",
                    f"{r['staleness']:.2f}",
                    f"{r['dropped']} ({r['stale']})",
                    f"{r['starved']:.1f}",
                    f"{r['blocked']:.1f}",
                    f"{r['queue']:.1f}+{r['inflight']:.1f}/{r['bound']:.1f}",
                    f"{r['len_trained']:.1f}/{r['len_generated']:.1f}",
                    f"{r['wall']:.0f}",
                ]
            )
        )


if __name__ == "__main__":
    main()
