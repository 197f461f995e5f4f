"""The kv-cache decoder's prefill of bench/engine.py's 64 distinct prompts, every prompt forwarded whole against their
common prefix forwarded once (:mod:`strop.serving.prefix`), interleaved, in fp32 and bf16.

    python bench/prefill.py [--rounds 3] [--rows 64]

Prints the CPU, the prompts' lengths and common prefix, seconds per prefill of each way per round and their ratio,
and the largest distance between the two ways' logits.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_cases  # noqa: E402
from limits import cpu_line  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from strop.models import load_model, load_tokenizer
    from strop.serving.kvdecode import LlamaDecoder
    from strop.serving.linear import PackedLinear
    from strop.serving.prefix import common_prefix, forward_prompts

    hf_logging.set_verbosity_error()
    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    tok = load_tokenizer(args.model)
    args.batch, args.new_tokens = [args.rows], 1
    prompts, _ = make_cases(tok, args)
    P = max(map(len, prompts))
    ids = torch.full((len(prompts), P), tok.pad_token_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, P - len(p) :] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts])
    print(f"{len(prompts)} prompts of {min(lengths.tolist())}-{P} tokens; common prefix {common_prefix(ids, lengths)}")
    for name in ("float32", "bfloat16"):
        dec = LlamaDecoder(load_model(args.model).to(dtype=getattr(torch, name)).eval())
        dec._sync()

        def whole():
            return forward_prompts(dec, ids, lengths, PackedLinear.batched)

        def shared():
            return dec.prefill(ids, lengths)

        with torch.no_grad():
            gap = (whole()[0] - shared()[0]).abs().max().item()  # (also the first calls: packing)
            print(f"\n{name}: largest logit gap whole / shared {gap:.2e}")
            print("| round | whole s | shared s | whole / shared |\n|---|---|---|---|")
            for r in range(args.rounds):
                seconds = []
                for way in (whole, shared):
                    start = time.perf_counter()
                    way()
                    seconds.append(time.perf_counter() - start)
                print(f"| {r + 1} | {seconds[0]:.3f} | {seconds[1]:.3f} | {seconds[0] / seconds[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
