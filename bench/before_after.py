"""strop's RL step at a baseline revision and now, interleaved in one run (A B B A ...): a change that should
not change speed, measured.

Each round runs ``bench/rl_step.py``'s strop side (``strop train`` as a user runs it, 8 prompts x 8 samples,
``--steps`` steps) once in a worktree of ``--baseline`` and once in this tree, each in its own process, and
reads the per-step figures after the first step. The table gives each side's median over the rounds of its
per-round mean, and the ratio now/baseline round by round (median, min, max): a ratio near 1 within the
rounds' spread is no change.

    python bench/before_after.py --baseline REV [--rounds 3] [--steps 3] [--new-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("step_seconds", "generation_seconds", "train_seconds")


def worktree(rev: str) -> Path:
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"strop-before-{short}"
    if not tree.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), short], check=True, capture_output=True
        )
    return tree


def one_run(tree: Path, args, out: Path) -> dict:
    """The strop side of rl_step.py with ``tree``'s strop first on the path (checked), its per-step figures."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    found = subprocess.run(
        [sys.executable, "-c", "import strop; print(strop.__file__)"], env=env, cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    if not found.startswith(str(tree)):
        raise SystemExit(f"the run in {tree} would import strop from {found}")
    cmd = [sys.executable, str(tree / "bench" / "rl_step.py"), "--side", "strop", "--steps", str(args.steps)]
    cmd += ["--out", str(out)] + (["--new-tokens", str(args.new_tokens)] if args.new_tokens else [])
    subprocess.run(cmd, env=env, cwd=tree, check=True)
    result = json.loads(out.read_text())
    return {k: statistics.fmean(result[k][1:] or result[k]) for k in FIGURES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, metavar="REV")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=None)
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 2:
        raise SystemExit("--rounds >= 1 and --steps >= 2 (the first step is warm-up)")
    before, now = worktree(args.baseline), ROOT
    runs: dict[str, list[dict]] = {"baseline": [], "now": []}
    with tempfile.TemporaryDirectory() as d:
        for i in range(args.rounds):
            order = (("baseline", before), ("now", now))
            for name, tree in order if i % 2 == 0 else order[::-1]:  # A B B A ...: drift favours neither side
                runs[name].append(one_run(tree, args, Path(d) / f"{name}-{i}.json"))
                print(
                    f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[name][-1].items()), flush=True
                )
    print(f"\n{'figure (s, mean of steps 2..)':32} {'baseline':>9} {'now':>9} {'now/baseline median [min, max]':>32}")
    for k in FIGURES:
        ratios = [n[k] / b[k] for b, n in zip(runs["baseline"], runs["now"])]
        b, n = statistics.median(r[k] for r in runs["baseline"]), statistics.median(r[k] for r in runs["now"])
        print(f"{k:32} {b:9.2f} {n:9.2f} {statistics.median(ratios):>14.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")


if __name__ == "__main__":
    main()
