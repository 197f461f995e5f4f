"""``--nproc 2`` against 2 Ray trainer actors on the same work, interleaved (local, ray, local, ray, ...).

Each run is a full ``strop train`` of the default quickstart (plus any extra arguments). Printed per
run and as the Ray/local ratio of the means: seconds per step (mean over steps 2.., so start-up is not
counted) and the seconds outside the steps ("start-up": the command's wall time minus the span of its
steps on the run's own clock: process start, model load, for Ray the local cluster's and the actors'
start; and the shut-down after the last step).
The Ray runs start and stop a local cluster of their own, as a one-node user's run does.

    python bench/scale_out.py [--rounds 2] [--steps 4] [-- extra strop train args]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import timed_train


def run(how: str, run_dir: Path, steps: int, extra: list[str]) -> dict:
    launcher = ["--nproc=2"] if how == "local" else ["--cluster.launcher=ray", "--cluster.trainer_ranks=2"]
    wall, rows = timed_train(
        [f"--train.steps={steps}", "--run.progress=false", "--run.threads=1", "--eval.every=0", *launcher, *extra],
        run_dir,
        how,
    )
    train = [r for r in rows if "reward_mean" in r]
    # the steps span from step 1's start to the last step's end (the run's own clock)
    steps_span = train[-1]["elapsed_seconds"] - train[0]["elapsed_seconds"] + train[0]["step_seconds"]
    return {
        "how": how,
        "wall": wall,
        "step": statistics.fmean(r["step_seconds"] for r in train[1:]),
        "start_up": wall - steps_span,
        "steps": len(train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    results = []
    with tempfile.TemporaryDirectory(prefix="strop-bench-scale-") as tmp:
        for r in range(args.rounds):
            for how in ("local", "ray"):  # interleaved: the machine's drift hits both columns alike
                res = run(how, Path(tmp) / f"{how}-{r}", args.steps, extra)
                results.append(res)
                print(
                    f"round {r + 1} {how:5s}: {res['step']:.2f} s/step (steps 2..{res['steps']}), start-up "
                    f"{res['start_up']:.1f} s, wall {res['wall']:.1f} s",
                    flush=True,
                )
    mean = lambda how, key: statistics.fmean(x[key] for x in results if x["how"] == how)  # noqa: E731
    print(f"\n{'':10s}{'s/step':>10s}{'start-up s':>12s}  (start-up: wall minus the steps)")
    for how in ("local", "ray"):
        print(f"{how:10s}{mean(how, 'step'):10.2f}{mean(how, 'start_up'):12.1f}")
    for r in range(args.rounds):
        local, ray = results[2 * r], results[2 * r + 1]
        print(
            f"round {r + 1}: ray/local step time {ray['step'] / local['step']:.3f}x (goal <= 1.15x), "
            f"start-up {ray['start_up'] - local['start_up']:+.1f} s"
        )
    print(
        f"mean: ray/local step time {mean('ray', 'step') / mean('local', 'step'):.3f}x, start-up "
        f"{mean('ray', 'start_up'):.1f} s vs {mean('local', 'start_up'):.1f} s"
    )
    print(f"({time.strftime('%Y-%m-%d %H:%M')}, {args.steps} steps per run, {' '.join(extra) or 'the quickstart'})")


if __name__ == "__main__":
    main()
