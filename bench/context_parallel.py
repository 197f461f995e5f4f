"""Context parallel on this machine: one long sequence, cp=1 (one process) vs cp=2 (two gloo processes).

The model is SmolLM2-135M's architecture (30 layers, hidden 576, vocabulary
49152), randomly initialised (no download). One row of ``--length`` tokens, the
second half a response; one forward + backward of the response logprobs (the
trainer's chunked kernel). Each configuration runs in fresh processes; the
machine's cores are shared out equally (cp=1: one process with all threads;
cp=2: two processes with half each). Reported per rank: the rise of peak RSS
during the first step (the step's activation and gradient memory) and the median
time of ``--repeats`` further steps.

    python bench/context_parallel.py [--lengths 1024 2048 4096] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch

from strop.parallel.launch import run_on_ranks

MiB = 1 << 20


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
    )
    return LlamaForCausalLM(config).float().train()


def _step_fn(rank, world, length, threads):
    import torch.distributed as dist

    from strop.parallel import context
    from strop.train.logprob import response_logprobs

    torch.set_num_threads(threads)
    model = _model()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 49000, (1, length), generator=g)
    attention_mask = torch.ones(1, length, dtype=torch.long)
    positions = torch.arange(length // 2, length).unsqueeze(0)  # the second half is the response
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "positions": positions,
        "response_mask": torch.ones(1, positions.shape[1]),
    }
    plan = None
    if world > 1:
        context.enable(model)
        plan = context.ContextParallelPlan.for_batch(batch, dist.group.WORLD)

    def step():
        lp, _ = response_logprobs(model, input_ids, attention_mask, positions, chunk_size=1024, cp=plan)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return lp

    return step


def _measure(rank, world, length, threads, repeats):
    import resource

    import torch.distributed as dist

    step = _step_fn(rank, world, length, threads)
    if world > 1:
        dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()  # the first step: its peak is the activation + gradient memory
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return peak, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    env = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed big buffers leave RSS, so peaks are the step's own
    print(f"SmolLM2-135M architecture (random init), one row, response = second half, fp32, {cores} cores")
    print(
        f"{'tokens':>7} | {'cp=1 s':>7} | {'cp=2 s':>7} | {'time ratio':>10} | {'cp=1 peak MiB':>13} | "
        f"{'cp=2 peak MiB/rank':>18} | {'memory ratio':>12}"
    )
    for length in args.lengths:
        ((p1, t1),) = run_on_ranks(_measure, 1, length, cores, args.repeats, timeout=1800, env=env)
        two = run_on_ranks(_measure, 2, length, max(cores // 2, 1), args.repeats, timeout=1800, env=env)
        p2, t2 = max(p for p, _ in two), max(t for _, t in two)
        print(
            f"{length:>7} | {t1:>7.2f} | {t2:>7.2f} | {t2 / t1:>9.2f}x | {p1 / MiB:>13.0f} | "
            f"{p2 / MiB:>18.0f} | {p2 / p1:>11.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
