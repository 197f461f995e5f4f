"""Embedded engine vs Hugging Face ``generate``: same model, batch, prompts and lengths.

Both sample at temperature 1 with the same max_new_tokens and no early stop
(stop tokens disabled), so both produce exactly batch x max_new_tokens tokens.

    python bench/engine.py [--batch 8 32] [--new-tokens 128] [--repeats 2]
"""

from __future__ import annotations

import argparse
import logging
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from strop.engines.embedded import EmbeddedEngine
    from strop.train.model import load_model, load_tokenizer
    from strop.types import SamplingParams

    tok = load_tokenizer(args.model)
    model = load_model(args.model).eval()
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=max(args.batch))
    questions = [f"What is {3 + 7 * i} plus {11 + 13 * i}? Explain step by step." for i in range(max(args.batch))]
    print("| batch | new tokens | HF generate tok/s | strop engine tok/s | ratio (strop / HF) |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False) for q in questions[:batch]]
        hf_best, strop_best = 0.0, 0.0
        for rep in range(args.repeats):
            # Hugging Face generate, left-padded batch
            tok.padding_side = "left"
            enc = tok.pad({"input_ids": prompts}, return_tensors="pt")
            torch.manual_seed(rep)
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                     max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     pad_token_id=tok.pad_token_id)
            hf = (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0] / (time.perf_counter() - t)
            # strop's engine
            sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[-1])
            t = time.perf_counter()
            outs = engine.generate_batch(prompts, sp)
            st = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)
            hf_best, strop_best = max(hf_best, hf), max(strop_best, st)
        print(f"| {batch} | {args.new_tokens} | {hf_best:.1f} | {strop_best:.1f} | {strop_best / hf_best:.2f} |", flush=True)


if __name__ == "__main__":
    main()
