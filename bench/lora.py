"""LoRA against full fine-tuning on the quickstart, in one sitting: ``strop train`` as a user runs it, once
per setting, each in its own process, one after the other (``--order`` says which first).

For each: the held-out greedy accuracy before training (step 0) and after the last step, its gain, the peak
resident memory of the run, the seconds per step, and the bytes a weight update would move as a full update
and as the adapters alone. The ratios LoRA / full are printed last.

    python bench/lora.py [--steps 15] [--rank 16] [--alpha 32] [--lora-lr 3e-4] [--order full,lora]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(name: str, extra: list[str], steps: int, folder: Path) -> dict:
    run_dir = folder / name
    cmd = [sys.executable, "-m", "strop.cli", "train", f"--train.steps={steps}", f"--run.dir={run_dir}"]
    cmd += ["--run.progress=false", "--run.save_every=0", "--run.plot=false", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_accuracy" in r]
    steps_rows = [r for r in rows if "step_seconds" in r]
    out = {
        "accuracy_before": evals[0]["eval_accuracy"],
        "accuracy_after": evals[-1]["eval_accuracy"],
        "peak_rss_gib": max(r.get("peak_rss_gib", 0.0) for r in rows),
        "step_seconds": statistics.fmean(r["step_seconds"] for r in steps_rows[1:] or steps_rows),
    }
    out["gain"] = out["accuracy_after"] - out["accuracy_before"]
    final = run_dir / "final"
    out["full_update_bytes"] = sum(f.stat().st_size for f in final.glob("*.safetensors"))
    adapter = final / "adapter" / "adapter_model.safetensors"
    out["adapter_bytes"] = adapter.stat().st_size if adapter.exists() else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--lora-lr", type=float, default=3e-4)
    ap.add_argument("--order", default="full,lora")
    args = ap.parse_args()
    settings = {
        "full": [],
        "lora": [f"--model.lora_rank={args.rank}", f"--model.lora_alpha={args.alpha}", f"--train.lr={args.lora_lr}"],
    }
    results = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.order.split(","):
            results[name] = run(name, settings[name], args.steps, Path(d))
            print(f"{name}: " + json.dumps(results[name]), flush=True)
    full, lora = results["full"], results["lora"]
    print(
        f"\nLoRA rank {args.rank} alpha {args.alpha:g} lr {args.lora_lr:g} against full fine-tuning, {args.steps} steps"
    )
    print(f"{'':28} {'full':>10} {'lora':>10} {'lora/full':>10}")
    for key in ("accuracy_before", "accuracy_after", "gain", "peak_rss_gib", "step_seconds"):
        ratio = lora[key] / full[key] if full[key] else float("nan")
        print(f"{key:28} {full[key]:10.3f} {lora[key]:10.3f} {ratio:10.3f}")
    print(
        f"{'update bytes (full / adapter)':28} {full['full_update_bytes']:10d} {lora['adapter_bytes']:10d} "
        f"{lora['adapter_bytes'] / full['full_update_bytes']:10.4f}"
    )


if __name__ == "__main__":
    main()
