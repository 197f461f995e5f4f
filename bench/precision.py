"""The quickstart in fp32 and in bf16, over several seeds, interleaved: does bf16 learn as well, and how fast?

Each run is a full default `strop train` in a process of its own, with ``--train.seed=S
--rollout.seed=S`` (the prompts and the held-out set stay those of the default), in the order
fp32 seed 1, bf16 seed 1, fp32 seed 2, ... The bf16 arm is ``--engine.dtype=bfloat16
--train.bf16_autocast=true``: the engine decodes from a bf16 copy, the trainer's forward runs
under bf16 autocast with fp32 master weights and optimizer state. Reported per run: training
seconds (the steps' own time, without the held-out evaluations), wall seconds, the held-out curve
and its gain (last minus first), the best accuracy, and the mean train/rollout logprob gap.

    python bench/precision.py [--seeds 1 2] [--keep DIR] [-- extra strop train args]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import timed_train

ARMS = {"fp32": [], "bf16": ["--engine.dtype=bfloat16", "--train.bf16_autocast=true"]}


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--keep", default=None, help="keep the run directories under this folder")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="strop-precision-"))
    results = []
    for seed in args.seeds:
        for arm in args.arms:
            name = f"{arm} seed {seed}"
            wall, rows = timed_train(
                [*ARMS[arm], f"--train.seed={seed}", f"--rollout.seed={seed}", "--run.progress=false", *extra],
                root / f"{arm}-{seed}",
                name,
            )
            steps = [r for r in rows if "reward_mean" in r]
            evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
            gaps = [r["train_rollout_logprob_abs_diff"] for r in steps if "train_rollout_logprob_abs_diff" in r]
            results.append(
                {
                    "arm": arm,
                    "seed": seed,
                    "wall": wall,
                    "train": sum(r["step_seconds"] for r in steps),
                    "evals": evals,
                    "gain": evals[-1] - evals[0],
                    "best": max(evals),
                    "gap": statistics.fmean(gaps) if gaps else float("nan"),
                }
            )
            r = results[-1]
            print(f"  {name}: {r['train']:.0f} s of training, gain {r['gain']:+.1%}", flush=True)
    print(f"strop train (quickstart) {' '.join(extra)}; runs in {root}")
    print("| arm | seed | training s | wall s | held-out curve | gain | best | logprob gap |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        curve = " → ".join(f"{x:.1%}" for x in r["evals"])
        print(
            f"| {r['arm']} | {r['seed']} | {r['train']:.0f} | {r['wall']:.0f} | {curve} | {r['gain']:+.1%} | "
            f"{r['best']:.1%} | {r['gap']:.2e} |"
        )
    for arm in args.arms:
        mine = [r for r in results if r["arm"] == arm]
        print(
            f"{arm}: mean training {statistics.fmean(r['train'] for r in mine):.0f} s, mean gain "
            f"{statistics.fmean(r['gain'] for r in mine):+.1%} over {len(mine)} seeds"
        )


if __name__ == "__main__":
    main()
