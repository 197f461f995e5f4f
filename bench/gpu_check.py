"""One short, prepared GPU check: the quickstart for a few steps, fp32 and bf16 autocast.

Prints per step: the train/rollout logprob gap, step / rollout / train seconds, and the
peak memory (GPU memory torch allocated on cuda, resident memory on cpu); then held-out
accuracy before and after. Fits in five minutes on one GPU; runs on CPU too (slowly).

    python bench/gpu_check.py                 # cuda (fails clearly without a GPU)
    python bench/gpu_check.py --device cpu --steps 2 --eval-size 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def run(device: str, bf16: bool, steps: int, eval_size: int, root: Path, model: str) -> list[dict]:
    from strop.config import build_config
    from strop.loop import train

    run_dir = root / f"{device}-{'bf16' if bf16 else 'fp32'}"
    cfg = build_config(
        overrides={
            **({"model": {"path": model}} if model else {}),
            "run": {"device": device, "dir": str(run_dir), "progress": False, "plot": False, "save_final": False},
            "train": {"steps": steps, "bf16_autocast": bf16},
            "data": {"eval_size": eval_size},
            "eval": {"every": 0},
        }
    )
    t0 = time.perf_counter()
    train(cfg)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    print(f"  ({'bf16 autocast' if bf16 else 'fp32'} run: {time.perf_counter() - t0:.0f}s)", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=64)
    parser.add_argument(
        "--model",
        default=None,
        help="model.path (a folder: e.g. random weights in SmolLM2's shape where the embedded "
        "package is not installed)",
    )
    args = parser.parse_args()
    import torch

    from strop.cli import _quiet_libraries

    _quiet_libraries()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to this torch; use --device cpu", file=sys.stderr)
        return 2
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"gpu_check: torch {torch.__version__} on {where}", flush=True)
    mem_key = "cuda_peak_allocated_gib" if args.device == "cuda" else "peak_rss_gib"
    with tempfile.TemporaryDirectory(prefix="strop-gpu-check-") as tmp:
        for bf16 in (False, True):
            rows = run(args.device, bf16, args.steps, args.eval_size, Path(tmp), args.model)
            steps = [r for r in rows if "reward_mean" in r]
            evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
            print(f"\n{'bf16 autocast' if bf16 else 'fp32'} on {args.device}:")
            print("| step | logprob gap | step s | rollout s | train s | reward | peak GiB |")
            print("|---|---|---|---|---|---|---|")
            for r in steps:
                print(
                    f"| {r['step']} | {r['train_rollout_logprob_abs_diff']:.2e} | {r['step_seconds']:.2f} | "
                    f"{r['rollout_seconds']:.2f} | {r['train_seconds']:.2f} | {r['reward_mean']:.3f} | "
                    f"{r[mem_key]:.2f} |"
                )
            print(f"held-out accuracy: {' -> '.join(f'{a:.1%}' for a in evals)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
