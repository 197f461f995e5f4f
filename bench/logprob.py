"""Logprobs + entropy through the lm_head: full logits (naive) vs chunked, time and peak memory.

Each variant computes loss = (lp * adv).sum() + 0.01 * ent.sum() with hidden
(tokens, hidden) and weight (vocab, hidden) both requiring grad, then runs
backward; the time is the best forward+backward wall time over --repeats.

Peak memory: each variant runs in its own fresh subprocess (this script with
--variant), so one variant's allocator state cannot hide or inflate the other's.
In it: allocate the inputs, run one small warm-up forward+backward (64 tokens and
1024 vocab rows, on copies, far below the full size, to load kernels and thread pools), read the current
RSS from /proc/self/statm, run the measured steps, then read the peak RSS
(getrusage(RUSAGE_SELF).ru_maxrss). "peak extra memory" = peak RSS - RSS just
before the measured steps: everything the step allocated at its high point,
including the (tokens, hidden) and (vocab, hidden) gradients (the same in both
variants). Large CPU tensors are mmap'd and returned to the OS when freed, so
this is the allocator's true high-water mark, not a cache artefact. The child
also reports how far the peak RSS already was above the current RSS before the
step ("slack"); the figure is exact whenever it exceeds the slack (otherwise it
is only a lower bound, and the script says so).

    python bench/logprob.py [--tokens 8192] [--hidden 576] [--vocab 49152] [--chunk-size 1024] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _child(args) -> None:
    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from strop.train.chunked_logprob import chunked_logprobs, naive_logprobs

    dtype = getattr(torch, args.dtype)
    if args.variant == "naive":

        def fn(h, w, t):
            return naive_logprobs(h, w, t)
    else:

        def fn(h, w, t):
            return chunked_logprobs(h, w, t, chunk_size=args.chunk_size)

    torch.manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, dtype=dtype).requires_grad_()
    # in place: no transient second (V, H) copy that would raise the peak RSS before the step
    weight = torch.randn(args.vocab, args.hidden).mul_(args.hidden**-0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,))
    adv = torch.randn(args.tokens)

    def step(h, w, t):
        h.grad = w.grad = None
        lp, ent = fn(h, w, t)
        loss = (lp * adv[: len(t)]).sum() + 0.01 * ent.sum()
        loss.backward()

    # warm-up on a small copy (64 tokens, 1024 vocab rows): loads kernels and thread pools without
    # allocating anything near full size, so the RSS high-water mark stays at the current RSS
    n_small, v_small = min(64, args.tokens), min(1024, args.vocab)
    step(
        hidden.detach()[:n_small].clone().requires_grad_(),
        weight.detach()[:v_small].clone().requires_grad_(),
        targets[:n_small] % v_small,
    )
    rss_before = _rss_kib()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step(hidden, weight, targets)
        times.append(time.perf_counter() - t)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(
        json.dumps(
            {
                "variant": args.variant,
                "time_s": min(times),
                "times": times,
                "peak_extra_mib": (maxrss - rss_before) / 1024,
                "slack_mib": max(0, maxrss_before - rss_before) / 1024,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of hidden and weight")
    ap.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)  # internal: child process
    args = ap.parse_args()
    if args.variant:
        _child(args)
        return
    results = {}
    for variant in ("naive", "chunked"):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--variant",
            variant,
            "--tokens",
            str(args.tokens),
            "--hidden",
            str(args.hidden),
            "--vocab",
            str(args.vocab),
            "--chunk-size",
            str(args.chunk_size),
            "--repeats",
            str(args.repeats),
            "--dtype",
            args.dtype,
        ]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    print(
        f"tokens={args.tokens} hidden={args.hidden} vocab={args.vocab} chunk_size={args.chunk_size} "
        f"repeats={args.repeats} dtype={args.dtype}"
    )
    print("| variant | time s | peak extra memory MiB |")
    print("|---|---|---|")
    for variant, r in results.items():
        name = variant if variant == "naive" else f"chunked ({args.chunk_size})"
        print(f"| {name} | {r['time_s']:.2f} | {r['peak_extra_mib']:.0f} |")
    n, c = results["naive"], results["chunked"]
    print(
        f"\nchunked / naive: time {c['time_s'] / n['time_s']:.2f}x, "
        f"memory {c['peak_extra_mib'] / n['peak_extra_mib']:.3f}x"
    )
    for variant, r in results.items():
        if r["slack_mib"] >= r["peak_extra_mib"]:
            print(
                f"(warning: {variant}: peak RSS was already {r['slack_mib']:.0f} MiB above RSS before the step, "
                "so its memory figure is only a lower bound)"
            )


if __name__ == "__main__":
    main()
