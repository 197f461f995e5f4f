"""Per-rank peak memory and step time of the trainer under tensor parallel (issue 23), in one run, for a random
model shaped like Qwen3-0.6B (28 layers, hidden 1024, 16 heads, 8 KV heads of 128, MLP 3072, vocabulary 151936,
tied embeddings; 0.6B parameters, 2.4 GB in fp32):

- tp=1: one process, the whole model (loaded whole, as today);
- FSDP dp=2, tp=2 (with sequence parallel, the default, and without), and a (dp 2, tp 2) mesh with FSDP:
  built on the meta device, each rank reading only its slices of the same safetensors folder.

For each layout: every rank's peak RSS after loading (with the trainer built) and after the training steps,
as GiB and as a fraction of tp=1's; the load peak also as a fraction of the whole weights' bytes; the fastest
step's seconds; and the memory a weight sync through disk adds, streamed from the shards against gathered whole
first (item 5: no rank holds the whole model beyond one bucket). Goal (issue 23): tp=2's per-rank peak <= 0.6x tp=1's; loading at tp=2 <= 0.6x the weights.
Layouts run one after the other in fresh processes (RSS peaks are per process); on this 2-core machine the
4-process layout shares 2 cores among 4 ranks, so its step time says little.

    python bench/tensor_parallel.py [--layers 28] [--steps 2] [--samples 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

LAYOUTS = [
    ("tp=1", 1, 1, "replicate", True),
    ("fsdp dp=2", 2, 1, "fsdp", True),
    ("tp=2", 2, 2, "replicate", True),
    ("tp=2, no SP", 2, 2, "replicate", False),
    ("dp=2 x tp=2 (fsdp)", 4, 2, "fsdp", True),
]


def _gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _save(rank, world, path, layers):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(path)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _rss_gib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 2**20


def _added_peak(fn) -> float:
    """The most resident memory (GiB) above where it stood that ``fn()`` added, sampled every 2 ms."""
    import threading

    start, top, done = _rss_gib(), [0.0], threading.Event()

    def watch():
        while not done.is_set():
            top[0] = max(top[0], _rss_gib())
            done.wait(0.002)

    thread = threading.Thread(target=watch)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(top[0], _rss_gib()) - start


def _sync_peaks(trainer, folder) -> tuple[float, float]:
    """A weight sync through disk from the sharded trainer, streamed (strop: a bucket gathered at a time while
    rank 0 writes) and then as a whole gather onto rank 0 first (every rank all-gathers everything): the memory
    each added on this rank."""
    from strop.sync.disk import WeightWriter
    from strop.parallel.runtime import Control

    control, writer = Control(600), WeightWriter(folder)
    weights = trainer.weights()
    streamed = _added_peak(
        lambda: control.on_controller(lambda: writer.write(weights, 1), share=False, serving=weights)
    )

    def whole():
        full = trainer.full_weights()
        control.on_controller(lambda: writer.write(full, 2), share=False)

    return streamed, _added_peak(whole)


def _layout(rank, world, path, tp, mode, sequence, steps, n, lengths):
    import torch

    from common import synthetic_samples
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import load_model, meta_model
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy
    from strop.train.modules import build_modules
    from strop.train.trainer import Sampling, Trainer

    import transformers.models.qwen3.modeling_qwen3  # noqa: F401  (the modelling code: ~0.1 GiB, before "base")

    torch.set_num_threads(max(1, 2 // world))
    base = _gib()
    strategy = SingleProcess()
    if world > 1:
        dims = ParallelDims(world, tp=tp, dp_mode=mode, sequence_parallel=sequence)
        strategy = make_strategy(dims, dims.build_mesh("cpu"))
    t0 = time.perf_counter()
    model = meta_model(path) if world > 1 else load_model(path)
    train, algo = TrainConfig(lr=1e-6, warmup_steps=0, micro_batch_size=4), AlgoConfig()
    modules = build_modules(model, strategy, algo, train, weights_path=path if world > 1 else None)
    trainer = Trainer(
        modules, pad_token_id=0, train=train, algo=algo, rollout=Sampling(max_new_tokens=16), parallel=strategy
    )
    load_s, load_peak = time.perf_counter() - t0, _gib()
    times = []
    for k in range(steps):
        t = time.perf_counter()
        trainer.step(synthetic_samples(n=n, prompt_len=lengths[0], response_len=lengths[1], seed=k))
        times.append(time.perf_counter() - t)
    peak = _gib()  # (before the sync below: its transient is reported on its own)
    sync = _sync_peaks(trainer, str(Path(path).parent / "sync")) if world > 1 else (float("nan"),) * 2
    return {
        "base": base,
        "load": load_peak,
        "load_s": load_s,
        "peak": peak,
        "step_s": min(times),
        "sync": sync[0],
        "sync_whole": sync[1],
    }


def main() -> None:
    from strop.parallel.launch import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--only", nargs="*", help="layouts to run, by name (default: all)")
    args = ap.parse_args()
    layouts = [row for row in LAYOUTS if not args.only or row[0] in args.only]
    with tempfile.TemporaryDirectory(prefix="strop-tp-bench-") as tmp:
        path = str(Path(tmp) / "model")
        weights = run_on_ranks(_save, 1, path, args.layers, timeout=1800)[0]
        print(
            f"model: Qwen3-0.6B shape, {args.layers} layers, {weights / 2**30:.2f} GiB of fp32 weights; "
            f"{args.samples} samples of {args.prompt_len} + {args.response_len} tokens per step, {args.steps} steps",
            flush=True,
        )
        rows = []
        for name, world, tp, mode, sequence in layouts:
            found = run_on_ranks(
                _layout,
                world,
                path,
                tp,
                mode,
                sequence,
                args.steps,
                args.samples,
                (args.prompt_len, args.response_len),
                timeout=3600,
            )
            rows.append((name, world, found))
            print(f"  done: {name}", flush=True)
    ref = max(r["peak"] for r in rows[0][2])
    print(
        f"\n{'layout':<20} {'ranks':>5} {'base GiB':>9} {'load peak':>10} {'x weights':>10} {'net x w':>8} "
        f"{'peak GiB':>9} {'x first':>7} {'step GiB':>8} {'load s':>7} {'step s':>7} {'sync x w':>9} {'gather x w':>11}"
    )
    for name, world, found in rows:
        base, load, peak = (max(r[k] for r in found) for k in ("base", "load", "peak"))
        net = max(r["load"] - r["base"] for r in found)
        print(
            f"{name:<20} {world:>5} {base:>9.2f} {load:>10.2f} {load * 2**30 / weights:>10.2f} "
            f"{net * 2**30 / weights:>8.2f} {peak:>9.2f} {peak / ref:>7.2f} {max(r['peak'] - r['load'] for r in found):>8.2f} "
            f"{max(r['load_s'] for r in found):>7.1f} "
            f"{max(r['step_s'] for r in found):>7.1f} {max(r['sync'] for r in found) * 2**30 / weights:>9.2f} "
            f"{max(r['sync_whole'] for r in found) * 2**30 / weights:>11.2f}"
        )
    print(
        "(per-rank maxima of peak RSS; x first: over the first layout's; step GiB: what the steps added above "
        "the load peak (gradients, AdamW state, activations). base: the process with torch, the modelling code and its process group, "
        "before the model; net x w: what loading added, over the whole weights' bytes. tp=1 loads through "
        "transformers' memory map, whose untouched pages are not resident until the first step. sync x w: "
        "the most memory a weight sync through disk added on any rank, streamed a bucket at a time (64 MiB) "
        "from the shards; gather x w: the same sync after gathering the whole model first, as before; both "
        "over the whole weights' bytes, measured after the steps)"
    )


if __name__ == "__main__":
    main()
