"""The quickstart in each rollout mode, one after the other on this machine, side by side.

Each mode is a full `strop train` run of the default quickstart (plus any extra arguments)
with `--rollout.mode=MODE`. The table is read from each run's metrics.jsonl: seconds per
step (the mean over steps 2.. so start-up is not counted), how long a step waited for its
groups (rollout_seconds), the train step and the weight sync, held-out accuracy first and
last, trained-token staleness, and the samples dropped. Off-policy modes add the correction
given by --offpolicy-args (default: TIS with cap 2 against the rollout's logprobs).

    python bench/rollout_modes.py [--modes sync one_step_off async] [-- extra strop train args]
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
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="strop-modes-"))
    results = [run(m, root / m, extra, shlex.split(args.offpolicy_args)) for m in args.modes]
    base = results[0]["step"]
    print(f"strop train (quickstart) {' '.join(extra)}; off-policy modes: {args.offpolicy_args}; runs in {root}")
    head = (
        "mode",
        "s/step",
        "vs first",
        "rollout wait s",
        "train s",
        "sync s",
        "held-out first->last (best)",
        "staleness",
        "dropped",
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
                    str(r["dropped"]),
                    f"{r['len_trained']:.1f}/{r['len_generated']:.1f}",
                    f"{r['wall']:.0f}",
                ]
            )
        )


if __name__ == "__main__":
    main()
