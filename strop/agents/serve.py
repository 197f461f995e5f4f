"""``strop proxy``: the agent proxy on its own, outside a training run.

In front of strop's engine in this process (a model path), or of running strop serve / SGLang /
vLLM servers (``--engine-url``, several behind strop's router). Sessions are opened and read
back with the admin token (``POST /v1/sessions``, ``GET`` / ``POST .../close``): an agent run
through it leaves its exact-token trajectory, loss masks and logprobs included, for whatever
the caller does with them (docs/agents.md).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from strop.agents.proxy import AgentProxy
from strop.agents.session import SessionLimits
from strop.engines.base import Closable
from strop.engines.router import Router
from strop.engines.sglang import SGLangEngine
from strop.engines.vllm import VLLMEngine
from strop.observe.logs import console
from strop.models import load_config, load_model, load_tokenizer, resolve_model_path
from strop.process import resolve_device
from strop.serving.embedded import EmbeddedEngine
from strop.types import SamplingParams

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def build_engine(
    model_path: str,
    urls: list[str],
    kind: str,
    token: str | None,
    *,
    device: str,
    dtype: str,
    max_batch_size: int,
    seed: int,
    model_options: dict | None = None,
):
    """(engine, tokenizer, context window, stop token ids) for the proxy. ``model_options``: strop.models' loading
    options (revision, trust_remote_code, attn_implementation)."""
    opts = dict(model_options or {})
    path = resolve_model_path(model_path, opts.get("revision"))
    tokenizer = load_tokenizer(path, **opts)
    stop = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    context = int(getattr(load_config(path, **opts), "max_position_embeddings", 2048))
    if not urls:
        model = load_model(path, dtype=getattr(torch, dtype), **opts).to(resolve_device(device)).requires_grad_(False)
        return (
            EmbeddedEngine(
                model,
                pad_token_id=tokenizer.pad_token_id,
                default_stop_token_ids=stop,
                max_batch_size=max_batch_size,
                context_window=context,
                seed=seed,
                release_idle=False,  # no trainer in this process: the packed weights stay from batch to batch
            ),
            tokenizer,
            context,
            stop,
        )
    client = VLLMEngine if kind == "vllm" else SGLangEngine
    engines = [client(u, token=token) for u in urls]
    return (engines[0] if len(engines) == 1 else Router(engines)), tokenizer, context, stop


def serve_proxy(
    model_path: str,
    *,
    urls: list[str],
    kind: str = "strop",
    engine_token: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8100,
    token: str | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    max_calls: int = 64,
    max_call_tokens: int = 1024,
    max_response_tokens: int = 8192,
    idle_timeout_s: float = 600.0,
    max_calls_in_flight: int = 64,
    describe_tools: bool = True,
    device: str = "auto",
    dtype: str = "float32",
    max_batch_size: int = 64,
    seed: int = 0,
    model_options: dict | None = None,
) -> None:
    """Serve until stopped (SIGINT / SIGTERM). ``model_options``: as :func:`build_engine`'s."""
    console()  # its lines on the terminal, unless the caller set up strop's logging
    if host not in LOOPBACK and not token:
        raise ValueError(
            f"--host {host} is reachable from other machines: pass --token, which opening and reading sessions needs"
        )
    if not token:
        raise ValueError("--token is needed: it opens sessions (POST /v1/sessions) and reads them back")
    engine, tokenizer, context, stop = build_engine(
        model_path,
        urls,
        kind,
        engine_token,
        device=device,
        dtype=dtype,
        max_batch_size=max_batch_size,
        seed=seed,
        model_options=model_options,
    )
    limits = SessionLimits(
        max_calls=max_calls,
        max_call_tokens=max_call_tokens,
        max_response_tokens=max_response_tokens,
        context_window=context,
    )
    proxy = AgentProxy(
        engine,
        tokenizer,
        limits=limits,
        max_calls_in_flight=max_calls_in_flight,
        idle_timeout_s=idle_timeout_s,
        stop_token_ids=stop,
        model_name=model_path,
        port=port,
        host=host,
        admin_token=token,
        describe_tools=describe_tools,
        sampling=SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_call_tokens, stop_token_ids=stop
        ),
    )

    async def run():
        await proxy.start()
        log.info(
            f"strop proxy: {model_path} ({'in this process' if not urls else ', '.join(urls)}) on {proxy.base_url}"
        )
        try:
            await proxy.serving
        finally:
            await proxy.close()
            close = engine.close if isinstance(engine, Closable) else None
            if close is not None:
                await close()

    asyncio.run(run())
