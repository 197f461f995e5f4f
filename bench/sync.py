"""Weight sync to a `strop serve` process, three forms side by side, on the same model.

For each form (disk, delta, broadcast) a fresh server and a fresh trainer-side process:
the trainer side loads the policy, syncs version 1 (the initial weights), takes one real
GRPO step on synthetic samples, then syncs version 2. Reported per form, for the second
sync: seconds, bytes that reached the engine (and the fraction of a full sync), and the
rise of peak RSS on both sides during it (VmHWM after, against VmRSS before, the peak reset
just before the sync with ``5 > /proc/PID/clear_refs``). The trainer side's figure does not
count the weights copy it syncs from (``Trainer.full_weights``, made before the sync).
Also reported: the longest the trainer side's event loop (the rollout loop in a run) went
without running a 5 ms heartbeat during the sync: what an in-flight request waits.
The code measured is whichever ``strop`` is imported: ``PYTHONPATH=<old checkout>`` measures
an earlier revision with this same script.

    python bench/sync.py [--model embedded:smollm2-135m-instruct] [--bucket-mib 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _status_kib(pid, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak(pid) -> int:
    """Reset a process's peak RSS (VmHWM) to its current RSS (Linux: 5 > clear_refs); returns that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS")


async def _longest_stall(coroutine) -> float:
    """Await ``coroutine`` beside a 5 ms heartbeat; return the longest gap between beats, in seconds."""
    import asyncio

    gaps, done = [0.0], asyncio.Event()

    async def beat():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    heartbeat = asyncio.ensure_future(beat())
    await asyncio.sleep(0)  # the heartbeat runs first: work the coroutine does before its first await counts too
    try:
        await coroutine
    finally:
        done.set()
        await heartbeat
    return max(gaps)


def child(form: str, model: str, url: str, pid: int, bucket: int, work: str) -> dict:
    import asyncio
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # large buffers are returned when freed
    from strop.config import AlgoConfig, TrainConfig
    from strop.engines.http import SGLangEngine, WeightWriter
    from strop.engines.router import Router
    from strop.engines.sync import BroadcastSync
    from strop.train.model import load_model
    from strop.train.trainer import Trainer
    from common import synthetic_samples

    writer = WeightWriter(Path(work) / "weights")
    router = Router([SGLangEngine(url, writer=writer, timeout_s=600)], writer=writer, delta=form == "delta",
                    broadcast=BroadcastSync(bucket_bytes=bucket) if form == "broadcast" else None)
    trainer = Trainer(load_model(model), pad_token_id=0, train=TrainConfig(micro_batch_size=8), algo=AlgoConfig(),
                      max_new_tokens=16)
    samples = synthetic_samples()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(router.update_weights(trainer.full_weights(), version=1))
    trainer.step(samples)
    weights = trainer.full_weights()
    for t in weights.values():
        t.add_(0)
    server_before, own_before = _reset_peak(pid), _reset_peak("self")
    t0 = time.perf_counter()
    stall = loop.run_until_complete(_longest_stall(router.update_weights(weights, version=2)))
    seconds = time.perf_counter() - t0
    full = sum(t.numel() * t.element_size() for n, t in weights.items() if n != "lm_head.weight")
    sent = router.bytes_sent if form != "disk" else full
    loop.run_until_complete(router.close())
    return {"form": form, "seconds": seconds, "bytes": sent, "full": full, "stall_ms": stall * 1000,
            "server_extra_mib": (_status_kib(pid, "VmHWM") - server_before) / 1024,
            "trainer_extra_mib": (_status_kib("self", "VmHWM") - own_before) / 1024}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--forms", nargs="+", default=["disk", "delta", "broadcast"])
    ap.add_argument("--child", nargs=4, metavar=("FORM", "URL", "PID", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        form, url, pid, work = args.child
        print(json.dumps(child(form, args.model, url, int(pid), args.bucket_mib << 20, work)))
        return
    from strop.engines.launch import launch_servers

    print(f"model {args.model}, broadcast bucket {args.bucket_mib} MiB; second sync (after one GRPO step)")
    print("| form | seconds | bytes to the engine | of a full sync | server peak extra MiB | trainer peak extra MiB | "
          "trainer loop stall ms |")
    print("|---|---|---|---|---|---|---|")
    import inspect

    from strop.engines.server import serve

    for form in args.forms:
        with tempfile.TemporaryDirectory(prefix="strop-sync-") as work:
            # strop serve loads weights only from its --weights-dir (earlier revisions have no such flag)
            extra = [f"--weights-dir={work}"] if "weights_dir" in inspect.signature(serve).parameters else []
            server = launch_servers(1, args.model, args=["--threads=1", *extra])[0]
            try:
                out = subprocess.run([sys.executable, __file__, "--model", args.model, "--bucket-mib",
                                      str(args.bucket_mib), "--child", form, server.url, str(server.proc.pid), work],
                                     capture_output=True, text=True, check=True)
            finally:
                server.stop()
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {form} | {r['seconds']:.2f} | {r['bytes'] / 2**20:.1f} MiB | {r['bytes'] / r['full']:.2f} | "
              f"{r['server_extra_mib']:.0f} | {r['trainer_extra_mib']:.0f} | {r['stall_ms']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
