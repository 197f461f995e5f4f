"""``strop serve``: the embedded engine behind HTTP, speaking the subset of SGLang's native API
strop uses, plus OpenAI-compatible completions for agent code.

Routes (SGLang names and payloads, so one client serves both):
  POST /generate                {input_ids, sampling_params, return_logprob, rid}
  GET  /health, /health_generate, /get_weight_version
  POST /abort_request {rid}, /flush_cache, /update_weights_from_disk {model_path, weight_version}
  POST /v1/completions, /v1/chat/completions  (token ids and logprobs included)

Concurrent requests are batched by the engine (requests that arrive while a batch decodes
form the next batch). It binds 127.0.0.1 by default; bound elsewhere it refuses to start
without a token, and the weight and abort routes then require ``Authorization: Bearer``.
A bad request gets a 4xx with a message; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from strop.engines.embedded import EmbeddedEngine, PromptTooLongError
from strop.engines.http import state_checksum, tensor_digest
from strop.types import Completion, SamplingParams

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingBody(_Body):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)  # SGLang's "off" is -1; 0 is accepted as off too
    max_new_tokens: int = Field(128, gt=0)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None
    no_stop_trim: bool = True  # strop never trims; accepted for SGLang clients
    skip_special_tokens: bool = True


class GenerateBody(_Body):
    input_ids: list[int] = Field(min_length=1)
    sampling_params: SamplingBody = Field(default_factory=SamplingBody)
    return_logprob: bool = False
    rid: str | None = None
    stream: bool = False


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class DiskUpdateBody(_Body):
    model_path: str
    weight_version: int | str | None = None
    digests: dict[str, str] | None = None  # delta form: the file holds only these tensors, each checked
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class GroupBody(_Body):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "gloo"


class DistributedUpdateBody(_Body):
    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: int | str | None = None
    bucket_bytes: int = Field(64 << 20, ge=1 << 10)
    flush_cache: bool = True
    return_checksum: bool = False


class CompletionBody(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send many optional fields
    prompt: str | list[int]
    max_tokens: int = Field(16, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    seed: int | None = None
    logprobs: int | None = None
    model: str | None = None


class ChatBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    logprobs: bool = False
    model: str | None = None


def _sampling(temperature, top_p, top_k, max_new_tokens, stop, seed) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k, 0), max_new_tokens=max_new_tokens,
                          stop_token_ids=list(stop or []), seed=seed)


def load_weights_dir(path: str, device) -> dict:
    """Every ``*.safetensors`` file of a folder (or one file) as one state dict, on ``device``."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.exists() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path!r}")
    state = {}
    for f in files:
        state.update(load_file(str(f), device=str(device)))
    return state


def create_app(engine: EmbeddedEngine, *, tokenizer=None, token: str | None = None, model_name: str = "strop"):
    """The FastAPI application around ``engine`` (``token``: required on weight and abort routes)."""
    app = FastAPI(title="strop serve", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        where = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse(status_code=400 if "json_invalid" in str(exc.errors()) else 422,
                            content={"error": {"message": where, "type": "invalid_request"}})

    def authorise(request: Request) -> None:
        if token is None:
            return
        sent = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(sent, token):
            raise HTTPException(status_code=401, detail="this route needs 'Authorization: Bearer <token>'")

    async def run(prompt_ids: list[int], sampling: SamplingParams, rid: str) -> Completion:
        try:
            return await engine.generate(prompt_ids, sampling, request_id=rid)
        except PromptTooLongError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from None

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    @app.get("/health")
    async def health():
        return {"status": "ok", "weight_version": engine.weight_version}

    @app.get("/health_generate")
    async def health_generate():
        out = await engine.generate([engine.pad_token_id], SamplingParams(temperature=0, max_new_tokens=1))
        return {"status": "ok", "tokens": len(out.token_ids)}

    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": engine.weight_version}

    @app.post("/generate")
    async def generate(body: GenerateBody):
        if body.stream:
            raise HTTPException(status_code=400, detail="stream=true is not supported by strop serve")
        sp = body.sampling_params
        rid = body.rid or uuid.uuid4().hex
        out = await run(body.input_ids, _sampling(sp.temperature, sp.top_p, sp.top_k, sp.max_new_tokens,
                                                  sp.stop_token_ids, sp.sampling_seed), rid)
        meta = {"id": rid, "finish_reason": {"type": out.finish_reason}, "prompt_tokens": len(body.input_ids),
                "completion_tokens": len(out.token_ids), "weight_version": out.weight_version}
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs or [], out.token_ids)]
        return {"text": decode(out.token_ids), "output_ids": out.token_ids, "meta_info": meta}

    @app.post("/abort_request")
    async def abort_request(body: AbortBody, request: Request):
        authorise(request)
        if body.abort_all:
            await engine.abort_all()
        elif body.rid:
            await engine.abort(body.rid)
        return {"success": True}

    @app.post("/flush_cache")
    async def flush_cache(request: Request):
        authorise(request)
        return {"success": True}  # the embedded engine keeps no KV cache between batches

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskUpdateBody, request: Request):
        authorise(request)
        try:
            state = load_weights_dir(body.model_path, engine.device)
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"update_weights_from_disk: {exc}") from None
        if body.abort_all_requests:
            await engine.abort_all()
        strict = body.digests is None
        if body.digests is not None:  # the delta form: exactly the announced tensors, each as sent
            own = engine.model.state_dict()
            bad = sorted(set(body.digests) ^ set(state)) + [n for n in state if n not in own]
            bad += [n for n in state if n in body.digests and tensor_digest(state[n]) != body.digests[n]]
            if bad:
                raise HTTPException(status_code=400, detail=f"update_weights_from_disk: delta tensors missing, unknown "
                                    f"or not matching their checksum: {bad[:5]}")
        try:
            version = await engine.update_weights(state, version=_int_version(body.weight_version), strict=strict)
        except RuntimeError as exc:  # load_state_dict: missing / unexpected keys, wrong shapes
            raise HTTPException(status_code=400, detail=f"update_weights_from_disk: {exc}") from None
        return {"success": True, "message": "weights loaded", "weight_version": version,
                "checksum": state_checksum(state)}

    groups: dict[str, Any] = {}

    @app.post("/init_weights_update_group")
    async def init_group(body: GroupBody, request: Request):
        """Join the trainer's weight-sync group as rank ``rank_offset`` (returns once every rank joined)."""
        authorise(request)
        from strop.engines.sync import make_group

        try:
            groups[body.group_name] = await asyncio.to_thread(
                make_group, body.master_address, body.master_port, body.rank_offset, body.world_size, body.backend)
        except (RuntimeError, ValueError) as exc:
            raise HTTPException(status_code=400, detail=f"init_weights_update_group: {exc}") from None
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: DistributedUpdateBody, request: Request):
        """Receive the weights broadcast by the trainer, one bucket at a time, into the model in place."""
        authorise(request)
        from strop.engines.sync import bucket_plan

        group = groups.get(body.group_name)
        if group is None:
            raise HTTPException(status_code=400, detail=f"no weight update group {body.group_name!r}: call "
                                "/init_weights_update_group first")
        params = engine.model.state_dict(keep_vars=False)
        unknown = [n for n in body.names if n not in params]
        if unknown or len(body.dtypes) != len(body.names) or len(body.shapes) != len(body.names):
            raise HTTPException(status_code=400, detail=f"update_weights_from_distributed: unknown names {unknown[:5]} "
                                "or names / dtypes / shapes of different lengths")
        wrong = [n for n, s in zip(body.names, body.shapes) if tuple(params[n].shape) != tuple(s)]
        if wrong:
            raise HTTPException(status_code=400, detail=f"update_weights_from_distributed: shape mismatch for {wrong[:5]}")
        plan = bucket_plan(list(zip(body.names, body.dtypes, [tuple(s) for s in body.shapes])), body.bucket_bytes)
        version = await engine.receive_weights(group, params, plan, version=_int_version(body.weight_version))
        out = {"success": True, "weight_version": version}
        if body.return_checksum:
            out["checksum"] = state_checksum({n: params[n] for n in body.names})
        return out

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        ids = body.prompt if isinstance(body.prompt, list) else _encode(tokenizer, body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        out = await run(ids, _sampling(body.temperature, body.top_p, body.top_k, body.max_tokens, None, body.seed), rid)
        choice = {"index": 0, "text": decode(out.token_ids), "finish_reason": out.finish_reason,
                  "token_ids": out.token_ids, "prompt_token_ids": ids}
        if body.logprobs is not None:
            choice["logprobs"] = {"token_logprobs": out.logprobs, "tokens": [str(t) for t in out.token_ids]}
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": _usage(ids, out)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        if tokenizer is None:
            raise HTTPException(status_code=400, detail="chat completions need a tokenizer (start with a model folder)")
        try:
            ids = list(tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        except Exception as exc:  # the template rejected the messages: the caller's input
            raise HTTPException(status_code=400, detail=f"messages: {exc}") from None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        limit = body.max_completion_tokens or body.max_tokens or 128
        out = await run(ids, _sampling(body.temperature, body.top_p, -1, limit, None, body.seed), rid)
        choice = {"index": 0, "message": {"role": "assistant", "content": decode(out.token_ids)},
                  "finish_reason": out.finish_reason, "token_ids": out.token_ids, "prompt_token_ids": ids}
        if body.logprobs:
            choice["logprobs"] = {"content": [{"token": str(t), "token_id": t, "logprob": lp}
                                              for t, lp in zip(out.token_ids, out.logprobs or [])]}
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                "choices": [choice], "usage": _usage(ids, out)}

    return app


def _int_version(v) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"weight_version must be an integer, got {v!r}") from None


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise HTTPException(status_code=400, detail="a text prompt needs a tokenizer; send token ids")
    return tokenizer(text, add_special_tokens=True)["input_ids"]


def _usage(ids, out: Completion) -> dict:
    return {"prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
            "total_tokens": len(ids) + len(out.token_ids)}


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 30000, token: str | None = None,
          max_batch_size: int = 64, seed: int = 0, device: str = "auto", dtype: str = "float32",
          batch_wait_ms: float = 5.0, fast_decode: bool = True) -> None:
    """Load the model and serve until stopped (SIGINT / SIGTERM)."""
    import torch
    import uvicorn

    from strop.parallel.runtime import resolve_device
    from strop.train.model import load_model, load_tokenizer, resolve_model_path

    if host not in LOOPBACK and not token:
        raise ValueError(f"--host {host} is reachable from other machines: pass --token (or STROP_SERVE_TOKEN) so "
                         "weight and abort routes need it")
    path = resolve_model_path(model_path)
    tokenizer = load_tokenizer(path)
    model = load_model(path, dtype=getattr(torch, dtype)).to(resolve_device(device)).requires_grad_(False)
    stop = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id} - {None})
    context = int(getattr(model.config, "max_position_embeddings", 2048))
    engine = EmbeddedEngine(model, pad_token_id=tokenizer.pad_token_id, default_stop_token_ids=stop,
                            max_batch_size=max_batch_size, context_window=context, seed=seed,
                            batch_wait_s=batch_wait_ms / 1000, fast_decode=fast_decode)
    app = create_app(engine, tokenizer=tokenizer, token=token, model_name=model_path)
    print(f"strop serve: {model_path} on http://{host}:{port} (device {engine.device}; "
          f"{engine.decode_path})", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
