"""A batch's slots: each decode step computing exactly the running rows (the default where one packing of the
weights serves every row count: oneDNN, or none) against slots in buckets of 16 (``exact_slots`` off: finished rows
keep computing until a whole bucket is free), side by side and interleaved on bench/engine.py's GRPO case (8 prompts x
8 samples that stop at end-of-turn, so rows finish apart), with ``engine.compile_step`` and without.

    python bench/slots.py [--dtype float32 bfloat16] [--new-tokens 128] [--rounds 3]

Prints the CPU, then per round each engine's tokens per second, the rows its steps computed against the rows that
were running, and the ratio exact / buckets.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_cases, strop_generate  # noqa: E402
from limits import cpu_line  # noqa: E402


def counted(engine) -> list:
    """Per decode step of ``engine``'s batches: (rows computed, rows running)."""
    from strop.serving.batch import Batch

    if not hasattr(Batch, "seen"):
        Batch.seen, batch_step = {}, Batch.step

        def step(batch):
            running = batch.live
            finished = batch_step(batch)  # (its slots after a compaction: the rows the step computed)
            batch.seen.get(id(batch.dec), []).append((len(batch.rows), running))
            return finished

        Batch.step = step
    return Batch.seen.setdefault(id(engine._fast), [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine

    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    tok = load_tokenizer(args.model)
    args.batch = [64]
    fixed, cases = make_cases(tok, args)
    _, prompts, stop, n = cases[-1]
    rows = [p for p in prompts for _ in range(n)]
    for name in args.dtype:
        model = load_model(args.model).to(dtype=getattr(torch, name)).eval()
        for compiled in (False, True):
            engines = {
                label: EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=compiled)
                for label in ("exact", "buckets of 16")
            }
            engines["buckets of 16"]._fast.exact_slots = False
            print(f"\n{name}, {'compiled step' if compiled else 'eager'}, kernel {engines['exact']._fast.kernel}:")
            seen = {label: counted(e) for label, e in engines.items()}
            for e in engines.values():  # (first steps: compiles, packing)
                strop_generate(e, fixed, 8, eos=None)
            print(
                "| round | "
                + " | ".join(f"{label} tok/s | rows computed / running" for label in engines)
                + " | ratio |"
            )
            print("|---|" + "---|---|" * len(engines) + "---|")
            for r in range(args.rounds):
                cells, rate = [], {}
                for label, e in engines.items():
                    seen[label].clear()
                    start = time.perf_counter()
                    tokens, _ = strop_generate(e, rows, args.new_tokens, eos=stop, seed0=100 * r)
                    rate[label] = tokens / (time.perf_counter() - start)
                    computed, running = (sum(x) for x in zip(*seen[label]))
                    cells.append(f"{rate[label]:.0f} | {computed / running:.3f}")
                ratio = rate["exact"] / rate["buckets of 16"]
                print(f"| {r + 1} | " + " | ".join(cells) + f" | {ratio:.2f} |", flush=True)
            del engines


if __name__ == "__main__":
    main()
