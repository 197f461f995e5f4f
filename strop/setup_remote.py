"""A run's remote engine (engine.kind strop, vllm or sglang; strop.setup assembles it): the servers launched for
the run (engine.launch), or those at engine.urls, and the router over them with the weight transport it uses."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from strop.config import Config
from strop.observe.run_dir import ENGINE_LOGS
from strop.parallel.dims import ParallelDims
from strop.sync.choose import choose_sync

log = logging.getLogger(__name__)


def remote_engine(cfg: Config, model_path: str, run_dir: Path, probe_ids: list[int], device=None):
    """A router over HTTP engines (launched here, or at engine.urls) and the servers it launched.
    Launched servers require engine.token, or a token made for this run when none is set; they are
    stopped again if anything after their start fails."""
    import secrets

    from strop.engines.launch import engine_flags, launch_servers, model_flags

    e = cfg.engine
    if e.launch and "STROP_ENGINE_URLS" in os.environ:  # the Ray launcher's engine actors (strop.cluster), not ours
        return _router(
            cfg, json.loads(os.environ["STROP_ENGINE_URLS"]), e.token.get_secret_value(), run_dir, probe_ids, device
        ), []
    token = e.token.get_secret_value() if e.token else secrets.token_urlsafe(32) if e.launch else None
    weights_dir = Path(e.sync_dir or run_dir / "weights").resolve()  # the only folder the servers may load from
    servers = (
        launch_servers(
            e.launch,
            model_path,
            args=[*model_flags("strop", cfg.model), *engine_flags(e), *e.launch_args, f"--weights-dir={weights_dir}"],
            token=token,
            log_dir=run_dir / ENGINE_LOGS,
        )
        if e.launch
        else []
    )
    if servers:
        log.info("strop: launched %d strop serve (their output: %s)", len(servers), run_dir / ENGINE_LOGS)
    try:
        return _router(cfg, [s.url for s in servers] or e.urls, token, run_dir, probe_ids, device), servers
    except BaseException:
        for server in servers:
            server.stop()
        raise


def _router(cfg: Config, urls: list[str], token: str | None, run_dir: Path, probe_ids: list[int], device=None):
    """The router over the servers at ``urls``; weights reach them through the transport
    :func:`strop.sync.choose.choose_sync` picks (and probes the servers for)."""
    from strop.engines.router import Router
    from strop.engines.sglang import SGLangEngine
    from strop.engines.vllm import VLLMEngine

    e = cfg.engine
    kind = VLLMEngine if e.kind == "vllm" else SGLangEngine
    clients = [
        kind(
            u,
            timeout_s=e.timeout_s,
            retries=e.retries,
            token=token,
            require_checksum=e.kind == "strop",
            routes=cfg.algo.routing_replay,
        )
        for u in urls
    ]
    sync = choose_sync(cfg, clients, run_dir, probe_ids, device)
    router = Router(
        clients, sync=sync, health_interval_s=e.health_interval_s, affinity=e.affinity, drain_timeout_s=e.timeout_s
    )
    sharded = ParallelDims.from_config(cfg.parallel).sharded
    if e.sync_probe and sharded:  # the trainer's forward is a collective of every rank there, the probe rank 0's
        log.info(
            "strop: weight probe: off under parallel.dp_mode=fsdp and tensor parallel (receipt: versions and checksums)"
        )
    router.probe_ids = list(probe_ids[:PROBE_TOKENS]) if e.sync_probe and not sharded else None
    router.probe_tolerance = e.sync_probe_tolerance
    return router


PROBE_TOKENS = 16  # tokens of the first training prompt scored by the weight probe
