"""Parts of ``engine.compile_step``'s graph, each left out in turn: the sampler's first pass over the logits
(each vocabulary block's logsumexp, computed in the graph and handed to the sampler), the rotated queries stored
once before the attention (``compiled_step.STORE_QUERIES``; left to Inductor, every score recomputes its query's
rotation) and strop's C attention kernel (``compiled_step.USE_KERNEL``; without it, Inductor's loops).
bench/engine.py's batch of ``--rows`` rows and its GRPO case, 128 new tokens.

    python bench/step_parts.py [--dtype float32 bfloat16] [--rows 64] [--pairs 2] [--variants ...]

A graph is compiled once per process, so each variant runs in a process of its own, and the processes are
interleaved (A B C A B C, ``--pairs`` times). Prints the CPU, then one line per process: its variant, its compile and
first 8 tokens' time, and tokens per second per case and round.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("as shipped", "sampler's pass outside", "queries not stored", "attention Inductor's")


def child(dtype: str, variant: str, rows: int) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from engine import case_rates, make_cases, strop_generate

    from strop.models import load_model, load_tokenizer
    from strop.serving import compiled_step
    from strop.serving.embedded import EmbeddedEngine

    logging.disable(logging.WARNING)
    compiled_step.STORE_QUERIES = variant != "queries not stored"
    compiled_step.USE_KERNEL = variant != "attention Inductor's"
    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    args = argparse.Namespace(batch=[rows], new_tokens=128, rows=rows)
    fixed, cases = make_cases(tok, args)
    model = load_model("embedded:smollm2-135m-instruct").to(dtype=getattr(torch, dtype)).eval()
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True)
    if variant == "sampler's pass outside":
        sample = engine._sample
        engine._sample = lambda logits, *a, block_lse=None, **kw: sample(logits, *a, **kw)
    start = time.perf_counter()
    strop_generate(engine, fixed, 8, eos=None)
    first = time.perf_counter() - start
    cells = case_rates(engine, cases)
    graphs = engine._fast.compiled.graphs
    print(f"| {dtype} | {variant} | {first:.0f} s, {graphs} graphs | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child, args.rows)
    sys.path.insert(0, str(HERE))
    from limits import cpu_line

    print(cpu_line(), flush=True)
    print(f"| dtype | variant | compile + first 8 tokens | batch {args.rows} r1 | r2 | GRPO r1 | r2 |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for dtype in args.dtype:
        for _ in range(args.pairs):
            for variant in args.variants:
                cmd = [sys.executable, __file__, "--rows", str(args.rows), "--child", dtype, variant]
                subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
