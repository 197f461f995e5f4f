"""Chunked coalesced all-reduce vs one flat buffer, 2 gloo processes on this machine.

Gradient-like tensors (a 135M-parameter model's shapes by default: SmolLM2's
30 layers plus the embedding) are averaged across 2 ranks, once through one
flat buffer (``torch.cat`` of everything, one all_reduce, copy back) and once
through :func:`strop.parallel.collectives.all_reduce_coalesced` at each
budget. Each (variant, budget) runs in fresh processes; time is the best of
median of ``--repeats`` rounds in which all variants run interleaved in the
same process pair (so the machine's noise hits them alike); peak extra memory
is the rise of a fresh process's peak RSS during one call (glibc's mmap
threshold fixed so freed buffers leave RSS).

    python bench/reduce.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from strop.parallel.launch import run_on_ranks

MiB = 1 << 20


def model_like_shapes(layers: int = 30, hidden: int = 576, inter: int = 1536, vocab: int = 49152, kv: int = 192):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
            (hidden,),
            (hidden,),
        ]
    return shapes + [(hidden,)]


def flat_reduce(tensors):
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat)
    flat.div_(dist.get_world_size())
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _runner(tensors, budget):
    from strop.parallel.collectives import all_reduce_coalesced

    if budget == 0:
        return lambda: flat_reduce(tensors)
    return lambda: all_reduce_coalesced(tensors, op="avg", bucket_bytes=budget)


def _peak(rank, world, budget):
    """Fresh processes: the rise of peak RSS during one reduction."""
    import resource

    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(*s, generator=g) for s in model_like_shapes()]
    flat_reduce([torch.ones(8)])  # warm the gloo connection
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _runner(tensors, budget)()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before


def _times(rank, world, budgets, repeats):
    """One process pair, variants interleaved round by round (the machine's noise hits all alike)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(*s, generator=g) for s in model_like_shapes()]
    runs = {b: _runner(tensors, b) for b in budgets}
    for run in runs.values():
        run()  # warm-up
    samples = {b: [] for b in budgets}
    for _ in range(repeats):
        for b, run in runs.items():
            dist.barrier()
            t = time.perf_counter()
            run()
            samples[b].append(time.perf_counter() - t)
    return {b: sorted(v)[len(v) // 2] for b, v in samples.items()}  # median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    total = sum(torch.Size(s).numel() * 4 for s in model_like_shapes())
    largest = max(torch.Size(s).numel() * 4 for s in model_like_shapes())
    print(
        f"{len(model_like_shapes())} tensors, {total / MiB:.0f} MiB in all, largest {largest / MiB:.0f} MiB; 2 gloo ranks"
    )
    print("| variant | budget | median time s | peak extra MiB (max over ranks) | time vs flat |")
    print("|---|---|---|---|---|")
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
    budgets = [0, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 << 30]
    times = run_on_ranks(_times, 2, budgets, args.repeats, timeout=900, env=env)
    for budget in budgets:
        t = max(r[budget] for r in times)
        peak = max(run_on_ranks(_peak, 2, budget, timeout=600, env=env)) / MiB
        flat = max(r[0] for r in times)
        if budget == 0:
            print(f"| one flat buffer | - | {t:.3f} | {peak:.0f} | 1.00 |", flush=True)
        else:
            label = f"{budget / MiB:.0f} MiB" if budget < (1 << 30) else "1 GiB (default)"
            print(f"| chunked | {label} | {t:.3f} | {peak:.0f} | {t / flat:.2f} |", flush=True)


if __name__ == "__main__":
    main()
