"""The one place the weight transport is chosen: from ``engine.sync`` ('auto' resolved against the servers)."""

from __future__ import annotations

import logging
import asyncio
import os
from pathlib import Path

from strop.config import Config
from strop.engines.launch import adapter_slots
from strop.sync.adapter import AdapterSync
from strop.sync.base import WeightSync
from strop.sync.broadcast import BroadcastSync
from strop.sync.delta import DeltaSync
from strop.sync.disk import DiskSync, WeightWriter
from strop.sync.inprocess import InProcessSync
from strop.sync.verify import VerifiedSync
from strop.wire.errors import EngineRequestError, EngineUnavailable

log = logging.getLogger(__name__)


def choose_sync(cfg: Config, clients: list, run_dir: Path, probe_ids: list[int], device=None) -> WeightSync:
    """The transport of the engines ``clients`` (the run's engine.kind): in-process for the embedded engine;
    for servers broadcast or through disk (engine.sync, 'auto' resolved here and printed with its reason).
    vLLM servers are probed first: one whose logprobs ignore the temperature is refused, and one without
    strop's worker extension cannot take a broadcast. With engine.verify_updates, the transport comes wrapped
    in the corrupt-then-restore check (strop.sync.verify)."""
    e = cfg.engine
    writer = WeightWriter(e.sync_dir or run_dir / "weights", bucket_bytes=e.sync_bucket_bytes)
    transport, name = (
        (InProcessSync(), "in-process") if e.kind == "embedded" else _remote(cfg, clients, writer, probe_ids, device)
    )
    if e.verify_updates == "off":
        return transport
    log.info(
        f"strop: engine.verify_updates={e.verify_updates}: before "
        + ("the first weight update" if e.verify_updates == "first" else "every weight update")
        + f" each engine's weights are overwritten with noise, and the {name} update must restore them bit for bit"
    )
    return VerifiedSync(
        transport,
        name,
        every=e.verify_updates == "every",
        writer=writer if e.kind != "embedded" else None,
        pause_mode=e.sync_pause,
        bucket_bytes=e.sync_bucket_bytes,
    )


def _remote(cfg: Config, clients: list, writer: WeightWriter, probe_ids: list[int], device) -> tuple[WeightSync, str]:
    """The transport of servers, and its name (engine.sync, 'auto' resolved against the servers)."""
    e = cfg.engine
    sync, why = e.sync, "engine.sync"
    if sync == "auto" and cfg.model.lora_rank:
        sync, why = "adapter", f"auto: each version's LoRA adapter alone into {e.kind} servers"

    async def probe():
        nonlocal sync, why
        try:
            if e.kind == "vllm":
                for c in clients:
                    await c.check_logprobs(cfg.rollout.temperature, probe_ids)
            if sync == "adapter" and e.kind != "strop":  # (strop serve merges each adapter; the others load them)
                for c in clients:
                    await c.check_adapters(cfg.model.lora_rank, adapter_slots(cfg.rollout))
            if sync in ("auto", "broadcast") and e.kind != "strop":  # (strop serve always takes one)
                try:
                    for c in clients:
                        await c.check_broadcast()
                except EngineRequestError as exc:
                    if sync == "broadcast":
                        raise
                    sync, why = "disk", f"auto: {exc}"
                except EngineUnavailable:  # down at start: the router takes it in when it answers; an SGLang
                    if e.kind == "vllm":  # server too old for the broadcast is named at its first update
                        raise
            if sync == "auto":
                sync, why = "broadcast", f"auto: every {e.kind} server takes a broadcast"
        finally:
            for c in clients:
                await c.close()  # connections belong to the run's event loop, made later

    asyncio.run(probe())
    log.info(f"strop: weight sync: {sync} ({why}); receipt: {weight_receipt(e.kind, sync)}")
    if sync == "broadcast":
        backend = (
            e.sync_backend
            if e.sync_backend != "auto"
            else ("nccl" if device is not None and device.type == "cuda" else "gloo")
        )
        return BroadcastSync(
            bucket_bytes=e.sync_bucket_bytes,
            backend=backend,
            timeout_s=e.timeout_s,
            pause_mode=e.sync_pause,
            dtype=e.sync_dtype,
            host=os.environ.get("STROP_NODE_IP", "127.0.0.1"),
        ), sync  # where engines reach rank 0
    if sync == "adapter":  # (every adapter a request may still use stays on disk: the server may read it again)
        return AdapterSync(writer, keep=adapter_slots(cfg.rollout)), sync
    return (DeltaSync(writer) if sync == "delta" else DiskSync(writer)), sync


def weight_receipt(kind: str, sync: str) -> str:
    """How each engine kind proves it holds the weights it was sent (printed at start)."""
    if sync == "broadcast":
        return {
            "strop": "the checksum of the tensors each server holds (/weights_checker), and the version it reports",
            "vllm": "the checksum of every byte strop's worker extension received, that every parameter was "
            "written, and the version each server reports (/weight_info)",
            "sglang": "the version each server reports (/model_info) after the update; SGLang's own checksums "
            "cover its fused tensors, which the trainer cannot reproduce, so no byte-for-byte check",
        }[kind]
    if kind == "strop":
        return {
            "disk": "the checksum of the file each server loaded, and the version it reports",
            "delta": "each changed tensor's digest, checked by the server, and the version it reports",
            "adapter": "the checksum of the weights each server merged, equal to the trainer's merged weights, and "
            "the version it reports",
        }[sync]
    if sync == "adapter":  # (vllm, sglang)
        return (
            "the adapter each server lists (/v1/models: policy-v<version>) after every load"
            + (", the adapter named in each completion" if kind == "vllm" else "")
            + f", and the logprob probe (engine.sync_probe); {kind} computes no checksum strop can compare"
        )
    route = "/model_info" if kind == "sglang" else "/weight_info"
    return (
        f"the version each server reports ({route}), read back after every load; {kind} reports no checksum "
        "strop can compare, so a load is not checked byte for byte"
    )
