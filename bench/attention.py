"""The kv-cache decoder's decode attention, eager (PyTorch's fused kernel) against compiled
(``engine.compile_attention``, strop.serving.attention) and against strop's C kernel (the compiled step's,
strop.serving.attention_kernel: the last column passed as the step's own key and value), side by side and
interleaved, at SmolLM2-135M's shape (3 kv heads of 3 query heads, head size 64) on slices of a longer cache as a
decode step passes them.

    python bench/attention.py [--batch 32 64] [--keys 64 170] [--repeats 2] [--calls 100]

Prints the CPU, the compile time and, per dtype, batch and length, microseconds per call of each, the ratios
eager / compiled and compiled / kernel, and each one's largest distance from a float64 reference.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from limits import cpu_line
from strop.serving import attention_kernel
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


def kernel(q, k, v, bias, scale):
    """The C kernel on the same inputs: the last column as the step's own key and value."""
    B, T = q.shape[0], k.shape[2]
    own_k, own_v = k[:, :, -1].float(), v[:, :, -1].float()
    return attention_kernel.attend(q, k[:, :, :-1], v[:, :, :-1], bias.reshape(B, T), own_k, own_v, scale)


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
    why = attention_kernel.why_unavailable()
    arms = {"eager": eager, "compiled": compiled} | ({} if why else {"kernel": kernel})
    print(
        f"| dtype | batch | keys | {' | '.join(f'{a} us/call' for a in arms)} | eager / compiled | compiled / kernel "
        f"| {' | '.join(f'error {a}' for a in arms)} |"
    )
    print("|---" * (5 + 2 * len(arms)) + "|")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for B in args.batch:
            for T in args.keys:
                q, k, v, bias = case(B, T, dtype)
                call = (q, k, v, bias, scale)
                compiled(*call)  # (compiles at the first call of the process; the time is printed below)
                times: dict[str, list[float]] = {a: [] for a in arms}
                for _ in range(args.repeats):  # interleaved: A B C A B C
                    for a, fn in arms.items():
                        times[a].append(per_call(fn, call, args.calls))
                exact = F.scaled_dot_product_attention(
                    q.double(), k.double(), v.double(), attn_mask=bias.double(), scale=scale
                )
                err = {a: (fn(*call).double() - exact).abs().max().item() for a, fn in arms.items()}
                e, c, kn = times["eager"], times["compiled"], times.get("kernel", [])
                print(
                    f"| {name} | {B} | {T} | "
                    + " | ".join(" / ".join(f"{x:.0f}" for x in times[a]) for a in arms)
                    + f" | {' / '.join(f'{a / b:.2f}' for a, b in zip(e, c))}"
                    + f" | {' / '.join(f'{a / b:.2f}' for a, b in zip(c, kn)) or '-'} | "
                    + " | ".join(f"{err[a]:.1e}" for a in arms)
                    + " |",
                    flush=True,
                )
    if why:
        print(f"\nthe C kernel is not here: {why}")
    print(
        f"\ncompile: {compiled.seconds:.1f} s at the first call"
        + (f"; fell back: {compiled.reason}" if compiled.reason else "")
    )


if __name__ == "__main__":
    main()
