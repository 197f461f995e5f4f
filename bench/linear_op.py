"""What a call of the compiled step's linear-layer op costs beyond the layer itself: ``strop::packed_linear``
(an op defined with ``torch.library.Library`` and a CPU kernel, :mod:`strop.serving.compiled_step`) against the same
body behind ``torch.library.custom_op``, and the layer called directly, each three calls deep in a compiled graph,
interleaved rounds.

    python bench/linear_op.py [--rounds 3] [--calls 5000] [--width 8] [--rows 1]

A tiny layer (8 -> 8, one row) by default, so that the call, not the matmul, is what is timed. Prints microseconds a
call.
"""

from __future__ import annotations

import argparse
import time

import torch

from strop.serving import compiled_step
from strop.serving.linear import PackedLinear


@torch.library.custom_op("strop_bench::via_custom_op", mutates_args=())
def via_custom_op(x: torch.Tensor, handle: str) -> torch.Tensor:
    return compiled_step._packed_linear(x, handle)


@via_custom_op.register_fake
def _(x, handle):
    return x.new_empty(*x.shape[:-1], int(handle.split(":")[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    layer = PackedLinear([torch.nn.Linear(args.width, args.width, bias=False)])
    layer.kernel = "onednn"
    layer.refresh()
    layer.pack(args.rows)

    class Decoder:
        linears = [layer]

    compiled_step._RUNNING.decoder = Decoder
    x, h = torch.randn(args.rows, args.width), f"0:{args.width}"
    ours, theirs = compiled_step.packed_linear, torch.ops.strop_bench.via_custom_op.default
    ways = {
        "direct (no graph)": lambda: layer(layer(layer(x))),
        "Library op in a graph": torch.compile(lambda: ours(ours(ours(x, h), h), h)),
        "custom_op in a graph": torch.compile(lambda: theirs(theirs(theirs(x, h), h), h)),
    }
    for fn in ways.values():
        fn()
    print("| round | " + " | ".join(f"{w}, us a call" for w in ways) + " |")
    print("|---|" + "---|" * len(ways))
    for r in range(args.rounds):
        cells = []
        for fn in ways.values():
            for _ in range(200):
                fn()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            cells.append(f"{(time.perf_counter() - start) / args.calls / 3 * 1e6:.1f}")
        print(f"| {r + 1} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
