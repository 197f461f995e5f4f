"""Sandbox start-up latency per call, per isolation, and 32 calls at once.

python bench/sandbox.py [--calls 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from strop.tools.sandbox import Sandbox, SandboxUnavailable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    print(
        "| isolation | seconds per trivial call (median of %d, one at a time) | 32 calls at once, 8 running: wall s |"
        % args.calls
    )
    print("|---|---|---|")
    for mode in ("bwrap", "namespaces", "none"):
        try:
            box = Sandbox(isolation=mode)
        except SandboxUnavailable as exc:
            print(f"| {mode} | unavailable: {exc} | |")
            continue

        async def one():
            t = time.perf_counter()
            r = await box.run_python("print(1 + 1)")
            assert r.output.strip() == "2", r.message()
            return time.perf_counter() - t

        async def run():
            single = [await one() for _ in range(args.calls)]
            t = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(32)))
            return single, time.perf_counter() - t

        single, burst = asyncio.run(run())
        print(f"| {mode} | {statistics.median(single):.3f} | {burst:.2f} |", flush=True)


if __name__ == "__main__":
    main()
