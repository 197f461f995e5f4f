"""The decoder's linear-layer kernels on this CPU, side by side (``engine.cpu_kernels``): for the embedded
SmolLM2-135M in fp32 and bf16, the seconds one decode step's linear layers take at several batch sizes with each
kernel this CPU and torch build have (MKL's packed sgemm, oneDNN's packed matmul, plain ``F.linear``), the kernels
interleaved within each round, best of ``--rounds``; the whole table ``--repeats`` times. Printed first: the CPU
model, its AMX and AVX-512 bf16 support, and the kernel ``auto`` picks for each dtype; then, per row, whether that
pick is the fastest here.

    python bench/linear_kernels.py [--batch 1 8 32 64] [--rounds 5] [--repeats 2]
"""

from __future__ import annotations

import argparse

import torch

from limits import cpu_line, decode_linear_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from strop.models import EMBEDDED_MODEL, load_model
    from strop.serving.cpu_kernels import choose

    picks = {d: choose("auto", getattr(torch, d), torch.device("cpu")) for d in ("float32", "bfloat16")}
    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| repeat | dtype | batch | mkl ms | onednn ms | plain ms | fastest | auto's pick | pick vs fastest |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rep in range(args.repeats):
        for dtype in ("float32", "bfloat16"):
            for batch in args.batch:
                secs = decode_linear_seconds(load_model(EMBEDDED_MODEL), batch, dtype, rounds=args.rounds)
                fastest = min(secs, key=secs.get)
                cells = " | ".join(f"{secs[k] * 1e3:.1f}" if k in secs else "-" for k in ("mkl", "onednn", "plain"))
                pick = picks[dtype]
                print(
                    f"| {rep + 1} | {dtype} | {batch} | {cells} | {fastest} | {pick} | "
                    f"{secs[fastest] / secs[pick]:.2f}x |"
                )


if __name__ == "__main__":
    main()
