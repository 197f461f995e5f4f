"""Does the python tool help? The tool_python preset trained twice, with the tool and without.

Both arms are full `strop train --preset tool_python` runs with the same seed, prompts,
held-out set, steps and loss. They differ only in the tool:

- "tool": the preset as shipped (the python tool; the system prompt offers it);
- "no tool": `tools.enabled=[]`, and a system prompt asking for the same boxed answer without
  mentioning code.

The table is read from each run's metrics.jsonl. Held-out accuracy is greedy, at every
evaluation; in the tool arm the evaluation may call the tool too. Reward and tool use are the
means over the first and the last few steps.

    python bench/tool_run.py --steps 20 --eval-every 10 [--keep DIR] [--arms tool "no tool"] [-- extra args]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_TOOL_PROMPT = "Work out the answer step by step. End with the final answer as \\boxed{ANSWER}."


def run(arm: str, run_dir: Path, common: list[str]) -> float:
    args = [
        sys.executable,
        "-m",
        "strop.cli",
        "train",
        "--preset",
        "tool_python",
        f"--run.dir={run_dir}",
        "--run.progress=false",
        *common,
    ]
    if arm == "no tool":
        args += ["--tools.enabled=[]", f"--data.system_prompt={NO_TOOL_PROMPT}"]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{arm}: strop train failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def read(arm: str, run_dir: Path, last: int, wall: float | None) -> dict:
    """An arm's figures from its metrics.jsonl, up to ``steps`` (the learning rate is constant
    after warm-up, so the first k steps of a longer run are a k-step run)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) <= last]
    steps = [r for r in rows if "reward_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    if len(steps) < last:
        raise SystemExit(f"{arm}: {run_dir} holds {len(steps)} steps, fewer than --steps {last}")
    k = max(1, min(5, len(steps) // 3))

    def mean(key: str, part: list[dict]) -> float:
        values = [r[key] for r in part if key in r]
        return statistics.fmean(values) if values else float("nan")

    evals = [(r["step"], r["eval_accuracy"], r.get("eval_tool_call_fraction")) for r in evals]
    return {
        "arm": arm,
        "wall": float("nan") if wall is None else wall,
        "evals": evals,
        "reward_first": mean("reward_mean", steps[:k]),
        "reward_last": mean("reward_mean", steps[-k:]),
        "tool_first": mean("tool_call_fraction", steps[:k]),
        "tool_last": mean("tool_call_fraction", steps[-k:]),
        "errors_per_call": mean("tool_errors_per_call", steps),
        "aborted": mean("aborted_fraction", steps),
        "length": mean("response_length_generated_mean", steps),
        "step_s": mean("step_seconds", steps[1:]),
        "k": k,
        "steps": len(steps),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--keep", default=None, help="keep the run directories under this folder")
    ap.add_argument(
        "--arms",
        nargs="+",
        default=["tool", "no tool"],
        choices=["tool", "no tool"],
        help="arms to run now; the others are read from earlier runs under --keep",
    )
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="strop-tool-run-"))
    common = [
        f"--train.steps={args.steps}",
        f"--eval.every={args.eval_every}",
        f"--data.eval_size={args.eval_size}",
        "--run.save_every=0",
        "--run.save_final=false",
        *extra,
    ]
    walls = {arm: run(arm, root / arm.replace(" ", "_"), common) for arm in args.arms}
    results = [read(arm, root / arm.replace(" ", "_"), args.steps, walls.get(arm)) for arm in ("tool", "no tool")]
    print(f"strop train --preset tool_python {' '.join(common)}; runs in {root}")
    print("\nheld-out accuracy (greedy) by step; in brackets the fraction of eval answers that called the tool")
    steps = [s for s, _, _ in results[0]["evals"]]
    print("| arm | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for r in results:
        cells = [f"{acc:.1%}" + (f" ({tool:.0%})" if tool is not None else "") for _, acc, tool in r["evals"]]
        print(f"| {r['arm']} | " + " | ".join(cells) + " |")
    k = results[0]["k"]
    print(f"\nper step (first {k} / last {k} steps)")
    print(
        "| arm | reward first | reward last | tool-call fraction first | last | errors per call | aborted | "
        "response tokens | s/step | wall s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['arm']} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | {r['tool_first']:.2f} | "
            f"{r['tool_last']:.2f} | {r['errors_per_call']:.2f} | {r['aborted']:.3f} | {r['length']:.0f} | "
            f"{r['step_s']:.1f} | " + (f"{r['wall']:.0f}" if r["wall"] == r["wall"] else "(earlier run)") + " |"
        )


if __name__ == "__main__":
    main()
