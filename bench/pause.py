"""What a weight update costs generation in the quickstart's async mode, per way of handling unfinished samples.

Each form is a full `strop train` run of the default quickstart with `--rollout.mode=async` and
`--rollout.partial=FORM` (finish: the engine's wait, the copy runs once the running rows end; keep: the
engine's keep pause, rows frozen across the copy; resume: its abort pause). The forms alternate (A B C A B C:
this machine drifts). Reported from each run's metrics.jsonl, steps 2.. (start-up not counted):

- ``pause``: ``weight_sync_pause_seconds``, the time no row could decode because of the update (the pause
  from /pause to /resume, or the copy with no row decoding);
- ``transfer``: ``weight_sync_seconds``, the whole update as the trainer sees it (for finish, with the
  wait for running rows);
- ``step``: ``step_seconds``; and ``pause / step``, the target being at most 5 %.

    python bench/pause.py [--forms finish keep resume] [--rounds 2] [--steps 4] [-- extra strop train args]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import timed_train


def run(form: str, run_dir: Path, steps: int, extra: list[str]) -> dict:
    args = [
        "--rollout.mode=async",
        f"--rollout.partial={form}",
        "--algo.use_rollout_logprobs=true",
        f"--train.steps={steps}",
        "--run.progress=false",
        *extra,
    ]
    _, rows = timed_train(args, run_dir, form)
    later = [r for r in rows if "reward_mean" in r][1:]
    mean = lambda key: statistics.fmean(r[key] for r in later)  # noqa: E731
    out = {"form": form, "pause": mean("weight_sync_pause_seconds"), "transfer": mean("weight_sync_seconds")}
    out["step"] = mean("step_seconds")
    out["ratio"] = out["pause"] / out["step"]
    return out


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forms", nargs="+", default=["finish", "keep", "resume"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory() as work:
        print("| round | partial | pause s | update s | step s | pause / step |")
        print("|---|---|---|---|---|---|")
        for r in range(args.rounds):
            for form in args.forms:
                out = run(form, Path(work) / f"{form}-{r}", args.steps, extra)
                print(
                    f"| {r + 1} | {form} | {out['pause']:.3f} | {out['transfer']:.3f} | {out['step']:.1f} "
                    f"| {100 * out['ratio']:.2f} % |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
