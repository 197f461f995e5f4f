"""The kv-cache decoder's decode attention, eager (PyTorch's fused kernel) against compiled
(``engine.compile_attention``, strop.serving.attention), side by side and interleaved, at SmolLM2-135M's shape
(3 kv heads of 3 query heads, head size 64) on slices of a longer cache as a decode step passes them.

    python bench/attention.py [--batch 32 64] [--keys 64 170] [--repeats 2] [--calls 100]

Prints the CPU, the compile time and, per dtype, batch and length, microseconds per call of each, the ratio
eager / compiled, and each one's largest distance from a float64 reference.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from limits import cpu_line
from strop.serving.attention import CompiledAttention, eager

KV, G, D, CAPACITY = 3, 3, 64, 320


def case(B: int, T: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(B * 1000 + T)
    q = torch.randn(B, KV, G, D, generator=g).to(dtype)
    keys = torch.randn(B, KV, CAPACITY, D, generator=g).to(dtype)
    values = torch.randn(B, KV, CAPACITY, D, generator=g).to(dtype)
    bias = torch.zeros(B, 1, 1, T, dtype=dtype)
    for r in range(B):  # (left-padded prompts: each row masks a few leading columns)
        bias[r, ..., : r % 7] = float("-inf")
    return q, keys[:, :, 5 : 5 + T], values[:, :, 5 : 5 + T], bias


def per_call(fn, args, calls: int) -> float:
    fn(*args)
    t = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--keys", type=int, nargs="+", default=[64, 170])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    compiled = CompiledAttention()
    scale = D**-0.5
    print(
        "| dtype | batch | keys | eager us/call | compiled us/call | eager / compiled | error eager | error compiled |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for B in args.batch:
            for T in args.keys:
                q, k, v, bias = case(B, T, dtype)
                call = (q, k, v, bias, scale)
                compiled(*call)  # (compiles at the first call of the process; the time is printed below)
                times: dict[str, list[float]] = {"eager": [], "compiled": []}
                for _ in range(args.repeats):  # interleaved: A B A B
                    times["eager"].append(per_call(eager, call, args.calls))
                    times["compiled"].append(per_call(compiled, call, args.calls))
                exact = F.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), attn_mask=bias.double(), scale=scale
                )
                err = {n: (fn(*call).double() - exact).abs().max().item() for n, fn in (("e", eager), ("c", compiled))}
                e, c = times["eager"], times["compiled"]
                print(
                    f"| {name} | {B} | {T} | {' / '.join(f'{x:.0f}' for x in e)} | {' / '.join(f'{x:.0f}' for x in c)} "
                    f"| {' / '.join(f'{a / b:.2f}' for a, b in zip(e, c))} | {err['e']:.1e} | {err['c']:.1e} |",
                    flush=True,
                )
    print(
        f"\ncompile: {compiled.seconds:.1f} s at the first call"
        + (f"; fell back: {compiled.reason}" if compiled.reason else "")
    )


if __name__ == "__main__":
    main()
