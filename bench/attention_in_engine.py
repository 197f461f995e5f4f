"""The compiled step's attention as strop's C kernel against Inductor's loops, in the engine: two engines in one
process (each its own graph: ``compiled_step.USE_KERNEL`` is part of the shape a graph is compiled for), so that the
two share the process's state and only the attention differs. bench/engine.py's batch of ``--rows`` rows and its GRPO
case, 128 new tokens, temperature 1; per case and round the two run back to back, A B then B A in the next round.

    python bench/attention_in_engine.py [--dtype float32] [--rows 64] [--rounds 4]

Prints the CPU, each engine's compile and first 8 tokens, and a row per case and round with both rates.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    import torch

    sys.path.insert(0, str(HERE))
    from engine import make_cases, strop_generate
    from limits import cpu_line

    from strop.models import load_model, load_tokenizer
    from strop.serving import compiled_step
    from strop.serving.embedded import EmbeddedEngine

    logging.disable(logging.WARNING)
    print(cpu_line(), flush=True)
    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    fixed, cases = make_cases(tok, argparse.Namespace(batch=[args.rows]))
    model = load_model("embedded:smollm2-135m-instruct").to(dtype=getattr(torch, args.dtype)).eval()
    engines = {}
    for name, use in (("kernel", True), ("Inductor's", False)):
        compiled_step.USE_KERNEL = use
        engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=args.rows, compile_step=True)
        start = time.perf_counter()
        strop_generate(engine, fixed, 8, eos=None)
        print(f"{name}: compile + first 8 tokens {time.perf_counter() - start:.0f} s; {engine.decode_path}", flush=True)
        engines[name] = engine
    print(f"| dtype | case | round | kernel tok/s | Inductor's tok/s | kernel / Inductor's |\n|{'---|' * 6}")
    for r in range(args.rounds):
        for case, prompts, stop, n in cases:
            rows = [p for p in prompts for _ in range(n)]
            rate = {}
            for name in list(engines)[:: 1 if r % 2 == 0 else -1]:
                tokens, seconds = strop_generate(engines[name], rows, 128, eos=stop, seed0=100 * r)
                rate[name] = tokens / seconds
            k, i = rate["kernel"], rate["Inductor's"]
            print(f"| {args.dtype} | {case} | {r + 1} | {k:.0f} | {i:.0f} | {k / i:.2f} |", flush=True)


if __name__ == "__main__":
    main()
