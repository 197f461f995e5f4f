"""The rollout inside the RL step, on the path a run takes: concurrent ``engine.generate`` calls
from an event loop (as strop's rollout sends them), against ``generate_batch`` on the same engine.

The workload is the quickstart's rollout: 8 prompts x 8 samples, up to 48 new tokens, temperature
0.8, stopping at end-of-turn, SmolLM2-135M-Instruct. Columns, interleaved (A B C A B C):

- ``generate_batch``: one call from this thread, the engine's own loop with no event loop between
  steps (the reference);
- ``generate, engine thread``: 64 concurrent ``generate`` calls; every decode step is handed from
  the event loop to the engine's one thread (strop now);
- ``generate, pool``: the same, with every hand-off through ``asyncio.to_thread`` (strop before
  6ae8080: consecutive steps land on different threads of the loop's default pool, each with an
  OpenMP team of its own).

Each concurrent column keeps one event loop for all its repeats, as a run keeps one for all its
steps.

``--second-pool`` first measures ``generate_batch`` alone, then with a second, idle OpenMP pool
alive in another thread (what the trainer's thread holds during a rollout unless it frees it), then
after that thread freed it with ``strop.openmp.release_threads`` (what strop does now); before the
columns above run, since the pool column leaves pools of its own behind.

``--churn GB`` then allocates and frees GB of memory three times (what a training step does to
the process's heap) and measures every column again: on a VM this machine's kind, the decode
after such a churn runs slower, with idle and stolen CPU time rising (printed from /proc/stat).

    python bench/rollout_path.py [--repeats 2] [--dtype float32] [--second-pool] [--churn 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time


def cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            return list(map(int, f.readline().split()[1:]))
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--churn",
        type=float,
        default=0.0,
        metavar="GB",
        help="after the first round, allocate and free this much memory three times, then measure again",
    )
    ap.add_argument(
        "--second-pool",
        action="store_true",
        help="also measure generate_batch beside a second idle OpenMP pool, then with it freed",
    )
    args = ap.parse_args()

    import logging
    import os

    import torch

    logging.disable(logging.WARNING)
    from strop.serving.embedded import EmbeddedEngine
    from strop.models import EMBEDDED_MODEL, load_model, load_tokenizer
    from strop.types import SamplingParams

    tok = load_tokenizer(EMBEDDED_MODEL)
    model = load_model(EMBEDDED_MODEL).to(getattr(torch, args.dtype)).eval()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = EmbeddedEngine(model, pad_token_id=tok.pad_token_id, default_stop_token_ids=[eos], max_batch_size=64)

    def chat(q):
        return list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}],  # noqa: E731
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )

    prompts = [
        chat(f"A shop sells {4 + i} apples for {12 + 3 * i} dollars. How much do {7 + 2 * i} apples cost?")
        for i in range(8)
    ]
    rows = [p for p in prompts for _ in range(8)]
    own = engine._off_loop

    async def pool(fn, *a):
        return await asyncio.to_thread(fn, *a)

    def sampling(seed0):
        return [
            SamplingParams(temperature=0.8, max_new_tokens=args.new_tokens, seed=seed0 + i) for i in range(len(rows))
        ]

    def batch(seed0):
        return engine.generate_batch(rows, sampling(seed0))

    # one long-lived event loop per column, as a run has one for all its steps (a pool's threads
    # accumulate over the steps)
    loops = {own: asyncio.new_event_loop(), pool: asyncio.new_event_loop()}

    def concurrent(seed0, off_loop):
        engine._off_loop = off_loop

        async def go():
            return await asyncio.gather(*[engine.generate(p, s) for p, s in zip(rows, sampling(seed0))])

        try:
            return loops[off_loop].run_until_complete(go())
        finally:
            engine._off_loop = own

    columns = {
        "generate_batch": batch,
        "generate, engine thread": lambda s: concurrent(s, own),
        "generate, pool": lambda s: concurrent(s, pool),
    }
    batch(10_000)  # warm-up
    results: dict[str, dict[str, list]] = {}

    def measure(phase: str) -> None:
        got = results.setdefault(phase, {name: [] for name in columns})
        for rep in range(args.repeats):
            for name, fn in columns.items():
                before, t = cpu_times(), time.perf_counter()
                outs = fn(100 * rep)
                secs, after = time.perf_counter() - t, cpu_times()
                tokens = sum(len(o.token_ids) for o in outs)
                d = [(a - b) / os.sysconf("SC_CLK_TCK") for a, b in zip(after, before)] if before and after else None
                got[name].append((tokens / secs, secs, d[3] if d else float("nan"), d[7] if d else float("nan")))
                print(
                    f"  {phase} {name}: {tokens} tokens in {secs:.2f} s, {tokens / secs:.0f} tok/s"
                    + (f" (idle {d[3]:.1f} s, stolen {d[7]:.1f} s)" if d else ""),
                    flush=True,
                )

    if args.second_pool:
        import threading

        from strop.openmp import release_threads

        go_free, freed, done = threading.Event(), threading.Event(), threading.Event()

        def holder():
            torch.ones(1 << 24).add_(1).sum()  # a parallel op: this thread now holds an OpenMP pool
            go_free.wait()
            release_threads()
            freed.set()
            done.wait()

        saved = columns
        columns = {"generate_batch": batch}
        measure("one pool (this thread's)")
        t = threading.Thread(target=holder, daemon=True)
        t.start()
        time.sleep(1)
        measure("second pool alive")
        go_free.set()
        freed.wait()
        measure("second pool freed")
        columns = saved
        done.set()
        t.join()
    measure("all columns")
    if args.churn:
        for _ in range(3):
            held = [torch.ones(64 << 20) for _ in range(max(1, int(args.churn * 4)))]  # 256 MB each, touched
            del held
        measure(f"after {args.churn:g} GB churn x3")

    print(
        f"\n{args.dtype}, 8 prompts x 8 samples, up to {args.new_tokens} new tokens; mean of {args.repeats}, "
        "interleaved; CPU idle and stolen seconds of the whole machine during each rollout\n"
    )
    print("| phase | column | tok/s | seconds | idle s | stolen s | time vs the phase's first column |")
    print("|---|---|---|---|---|---|---|")
    for phase, got in results.items():
        ref = statistics.mean(r[1] for r in next(iter(got.values())))
        for name, runs in got.items():
            m = [statistics.mean(r[i] for r in runs) for i in range(4)]
            print(f"| {phase} | {name} | {m[0]:.0f} | {m[1]:.2f} | {m[2]:.1f} | {m[3]:.1f} | {m[1] / ref:.2f}x |")


if __name__ == "__main__":
    main()
