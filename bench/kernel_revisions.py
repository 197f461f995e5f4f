"""strop's decode-attention C kernel (strop.serving.attention_kernel) of an earlier git revision against the working
tree's, side by side on this CPU: alone (SmolLM2-135M's shape, 64 rows x 3 kv heads of 3 query heads, 30 layers of a
cache as a decode step passes them, both libraries loaded in one process and called in turn, A B then B A) and in the
engine (bench/engine.py's batch of 64 rows and its GRPO case, 128 new tokens, ``engine.compile_step``; a graph is
compiled once per process, so one process per side, alternated).

    python bench/kernel_revisions.py --old REV [--dtype float32 bfloat16] [--keys 110 200] [--rounds 8] [--pairs 2]
        [--skip-engine]

Prints the CPU, then per length: each side's best and median ms per 30 layers, their ratios and the largest
difference between their outputs; then one line per engine process: its side and tokens per second per case and round.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def source_at(rev: str) -> str:
    """The kernel's C source at ``rev``: attention_kernel.c, or before it had a file of its own, the SOURCE string of
    attention_kernel.py (with a ``strop_attend_lanes`` that says 0, which the module now asks a library for)."""

    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True)

    c = show("strop/serving/attention_kernel.c")
    if c.returncode == 0:
        return c.stdout
    ns: dict = {}
    text = show("strop/serving/attention_kernel.py")
    text.check_returncode()
    exec(compile(text.stdout, f"attention_kernel@{rev}", "exec"), ns)  # (only its SOURCE string is used)
    return ns["SOURCE"] + "\nint strop_attend_lanes(void) { return 0; }\n"


def library(source: str):
    from strop.serving import attention_kernel as ak

    ak.SOURCE, ak._state = source, {}
    if ak.why_unavailable():
        raise SystemExit(f"the kernel cannot be built here: {ak.why_unavailable()}")
    return ak._state["lib"]


def alone(old_source: str, tree: str, keys: list[int], rounds: int, dtype: torch.dtype) -> None:
    from strop.serving import attention_kernel as ak

    libs = {"new": library(tree), "old": library(old_source)}
    L, B, KV, G, D, capacity = 30, 64, 3, 3, 64, 320
    for T in keys:
        g = torch.Generator().manual_seed(T)
        kc, vc = (torch.randn(L, B + 8, KV, capacity, D, generator=g).to(dtype)[:, :B] for _ in "kv")
        q, kn, vn = torch.randn(B, KV, G, D, generator=g), *torch.randn(2, B, KV, D, generator=g)
        bias = torch.zeros(B, T + 1)

        def run(side):
            ak._state["lib"] = libs[side]
            start = time.perf_counter()
            outs = [ak.attend(q, kc[i, :, :, 3 : 3 + T], vc[i, :, :, 3 : 3 + T], bias, kn, vn, 0.125) for i in range(L)]
            return time.perf_counter() - start, outs

        times = {"old": [], "new": []}
        for r in range(rounds):
            for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                times[side].append(run(side)[0])
        diff = max((a - b).abs().max().item() for a, b in zip(run("old")[1], run("new")[1]))
        best = {s: min(t) for s, t in times.items()}
        med = {s: sorted(t)[len(t) // 2] for s, t in times.items()}
        print(
            f"| {str(dtype)[6:]} | {T} | {best['old'] * 1e3:.1f} / {med['old'] * 1e3:.1f} | {best['new'] * 1e3:.1f} / "
            f"{med['new'] * 1e3:.1f} | {best['old'] / best['new']:.2f} | {med['old'] / med['new']:.2f} | {diff:.1e} |",
            flush=True,
        )


def engine_side(side: str, old_rev: str, dtype: str) -> None:
    """One process of the engine comparison: the kernel of ``old_rev`` (side 'old') or the tree's."""
    import logging

    sys.path.insert(0, str(HERE))
    from engine import case_rates, make_cases, strop_generate

    from strop.models import load_model, load_tokenizer
    from strop.serving import attention_kernel as ak
    from strop.serving.embedded import EmbeddedEngine

    if side == "old":
        ak.SOURCE, ak._state = source_at(old_rev), {}
    logging.disable(logging.WARNING)
    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    fixed, cases = make_cases(tok, argparse.Namespace(batch=[64], new_tokens=128, rows=64))
    model = load_model("embedded:smollm2-135m-instruct").to(getattr(torch, dtype)).eval()
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, max_batch_size=64, compile_step=True)
    strop_generate(engine, fixed, 8, eos=None)
    cells = case_rates(engine, cases)
    print(f"| {dtype} | {side} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the git revision whose kernel is compared with the tree's")
    ap.add_argument("--keys", type=int, nargs="+", default=[110, 200])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--engine-side", choices=["old", "new"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine_side:
        return engine_side(args.engine_side, args.old, args.dtype[0])
    from limits import cpu_line

    print(f"{cpu_line()}; torch {torch.__version__}, {torch.get_num_threads()} threads; old = {args.old}")
    print(
        "| dtype | keys | old ms, best / median | new ms, best / median | old / new, best | median | largest difference |"
    )
    print("|---|---|---|---|---|---|---|")
    from strop.serving import attention_kernel

    tree = attention_kernel.SOURCE  # (library() replaces it)
    for dtype in args.dtype:
        alone(source_at(args.old), tree, args.keys, args.rounds, getattr(torch, dtype))
    if args.skip_engine:
        return
    print("| dtype | side | batch 64 tok/s (round 1, 2) | | GRPO 8 x 8 tok/s (round 1, 2) | |")
    print("|---|---|---|---|---|---|")
    for dtype in args.dtype:
        for p in range(args.pairs):
            for side in ("old", "new") if p % 2 == 0 else ("new", "old"):
                cmd = [sys.executable, __file__, "--old", args.old, "--dtype", dtype, "--engine-side", side]
                subprocess.run(cmd, check=True, cwd=HERE)


if __name__ == "__main__":
    main()
