"""``strop serve``: the embedded engine behind HTTP, speaking vLLM's RL API (:mod:`strop.serving.routes_rl`,
:mod:`strop.serving.routes_transfer`: pause modes, the weight-transfer phases, versions, the weight checker),
the subset of SGLang's native API strop uses, and OpenAI-compatible completions for agent code.

SGLang's routes (its names and payloads, so an SGLang client drives strop serve too):
  POST /generate                {text | input_ids, sampling_params, return_logprob, rid}
  GET  /health, /health_generate, /get_weight_version, /model_info, /v1/models
  POST /abort_request {rid}, /flush_cache, /update_weights_from_disk {model_path, weight_version}
  POST /pause_generation {mode}, /continue_generation, /begin_weight_update, /end_weight_update
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  GET|POST /weights_checker {action: "checksum"}
  GET  /weights_manifest  (strop's own: the names, dtypes and shapes an update must carry)
  POST /tokenize {prompt, add_special_tokens}  (as SGLang and vLLM: {tokens, count, max_model_len})
  POST /v1/completions, /v1/chat/completions  (token ids, logprobs and up to 20 top logprobs included;
                                              echo; stream (a chunk per decoded token), stop, n)

The routes live in :mod:`strop.serving.routes_generate`, :mod:`strop.serving.routes_weights`,
:mod:`strop.serving.routes_rl`, :mod:`strop.serving.routes_transfer`, :mod:`strop.serving.routes_lora` and
:mod:`strop.serving.routes_openai`, over one :class:`strop.serving.service.ServeService`; this module
builds the app (errors, authorisation, the body limit) and runs the process (:func:`serve`).

Concurrent requests are batched by the engine. Access: open on 127.0.0.1 without a token;
with a token every route, /health included, needs ``Authorization: Bearer <token>`` (generation
routes and /health stay open with ``public_generate``); bound elsewhere it refuses to start without one.
Weights load from disk only from inside ``weights_dir``. A bad request gets a 4xx with a
message and fails alone (requests batched with it are answered); the server keeps serving. A
request body over ``max_body_bytes`` (16 MiB) is refused with 413 before any of it is parsed.
"""

from __future__ import annotations

import logging

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from strop.process import resolve_device
from strop.observe.logs import console
from strop.models import load_model, load_tokenizer, resolve_model_path
from strop.openmp import release_threads
from strop.serving import (
    routes_generate,
    routes_lora,
    routes_openai,
    routes_rl,
    routes_transfer,
    routes_weights,
)
from strop.serving.embedded import EmbeddedEngine
from strop.serving.openai import MAX_BODY_BYTES, BodyLimit, error
from strop.serving.service import ServeService
from strop.wire.auth import bearer_token_matches

LOOPBACK = ("127.0.0.1", "localhost", "::1")
GENERATION_ROUTES = (
    "/generate",
    "/health_generate",
    "/get_weight_version",
    "/model_info",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
)  # opened to all by public_generate
log = logging.getLogger("strop.serve")


def create_app(
    engine: EmbeddedEngine,
    *,
    tokenizer=None,
    token: str | None = None,
    model_name: str = "strop",
    public_generate: bool = False,
    weights_dir: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    weight_transfer: str = "gloo",
    return_routes: bool = False,
):
    """The FastAPI application around ``engine``. ``token``: needed on every route, /health included
    (generation routes and /health stay open with ``public_generate``). ``weights_dir``: the only folder
    /update_weights_from_disk reads (None: that route is refused). ``max_body_bytes``: a longer
    request body gets 413 on every route. ``weight_transfer``: the backend of vLLM's transfer phases
    (:mod:`strop.serving.transfer`). ``return_routes``: completion choices carry their routed experts (vLLM's
    --enable-return-routed-experts)."""
    app = FastAPI(title="strop serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = ServeService(
        engine, tokenizer=tokenizer, model_name=model_name, weights_dir=weights_dir, weight_transfer=weight_transfer
    )
    app.state.service.return_routes = return_routes
    vllm_routes = {route.path for r in (routes_rl, routes_transfer) for route in r.router.routes}

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
        if request.url.path in vllm_routes:  # vLLM's dialect: 400, the first field named as "param"
            return routes_rl.rl_error(400, where, param)
        return error(400 if "json_invalid" in str(errors) else 422, where)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _engine_error(request: Request, exc: Exception):  # a bug or an engine fault, never the caller's
        log.exception("strop serve: %s failed", request.url.path)
        return error(500, f"{type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def _authorise(request: Request, call_next):
        path = request.url.path
        # /health too: it tells the weight version and whether an update runs (public_generate opens it with
        # the generation routes)
        if token is None or (public_generate and (path in GENERATION_ROUTES or path == "/health")):
            return await call_next(request)
        if not bearer_token_matches(request.headers.get("authorization", ""), token):
            return error(401, f"{path} needs the server's token: 'Authorization: Bearer <token>'")
        return await call_next(request)

    for routes in (routes_generate, routes_weights, routes_rl, routes_transfer, routes_lora, routes_openai):
        app.include_router(routes.router)
    # outermost: a body over the limit is refused before anything (authorisation included) reads it
    app.add_middleware(BodyLimit, limit=lambda: max_body_bytes, error=error)
    return app


def serve(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    token: str | None = None,
    public_generate: bool = False,
    weights_dir: str | None = None,
    max_batch_size: int = 64,
    seed: int = 0,
    device: str = "auto",
    dtype: str = "float32",
    batch_wait_ms: float = 5.0,
    fast_decode: bool = True,
    batch_invariant: bool = False,
    decoder: dict | None = None,
    return_routes: bool = False,
    model_options: dict | None = None,
    weight_transfer: str = "gloo",
    weight_version: int = 0,
) -> None:
    """Load the model and serve until stopped (SIGINT / SIGTERM). ``model_options``: strop.models' loading options
    (revision, trust_remote_code, attn_implementation), as a run's ``model`` section gives them. ``weight_transfer``:
    the backend of vLLM's transfer phases; ``weight_version``: the version the weights start as. ``batch_invariant``
    and ``decoder`` (its speculative, cpu_kernels, compile_attention, compile_step): the engine's
    (strop.serving.embedded); ``return_routes``: vLLM's --enable-return-routed-experts."""
    if weight_version < 0 or weight_version >= 2**63:
        raise ValueError(f"--weight-version {weight_version}: a non-negative integer below 2**63")
    console()  # its lines on the terminal, unless the caller set up strop's logging
    if host not in LOOPBACK and not token:
        raise ValueError(
            f"--host {host} is reachable from other machines: pass --token (or STROP_SERVE_TOKEN) so "
            "every route needs it"
        )
    if public_generate and not token:
        raise ValueError("--public-generate needs --token (without one every route is open already)")
    opts = dict(model_options or {})
    path = resolve_model_path(model_path, opts.get("revision"))
    tokenizer = load_tokenizer(path, **opts)
    model = load_model(path, dtype=getattr(torch, dtype), **opts).to(resolve_device(device)).requires_grad_(False)
    stop = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    context = int(getattr(model.config, "max_position_embeddings", 2048))
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=stop,
        max_batch_size=max_batch_size,
        context_window=context,
        seed=seed,
        batch_wait_s=batch_wait_ms / 1000,
        fast_decode=fast_decode,
        batch_invariant=batch_invariant,
        release_idle=False,  # no trainer here: the packed weights stay from batch to batch until the next update
        **(decoder or {}),
    )
    engine.weight_version = weight_version
    if return_routes and not engine.records_routes:
        raise ValueError(
            f"--enable-return-routed-experts: {model_path} records no routed experts here ({engine.decode_path}); "
            "a routed-experts model (Qwen3-MoE) on the fast decoder records them"
        )
    app = create_app(
        engine,
        tokenizer=tokenizer,
        token=token,
        model_name=model_path,
        public_generate=public_generate,
        weights_dir=weights_dir,
        weight_transfer=weight_transfer,
        return_routes=return_routes,
    )
    log.info(
        f"strop serve: {model_path} on http://{host}:{port} (device {engine.device}; {engine.decode_path}; "
        f"weight transfer: {weight_transfer}; weight version {weight_version})"
    )
    release_threads()  # this thread runs the event loop from here on; the engine's thread decodes (strop.openmp)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
