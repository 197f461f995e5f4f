"""strop serve's answers to vLLM's RL API (vLLM 0.32/0.33 with ``VLLM_SERVER_DEV_MODE=1``): the same routes,
status codes and body keys, so a client written for vLLM drives strop serve unchanged.

  POST /pause?mode=abort|wait|keep&clear_cache=   -> {"status": "paused"};  POST /resume -> {"status": "resumed"}
  GET  /is_paused -> {"is_paused"};  POST /abort_requests {request_ids?} -> {"status": "aborted", "aborted"}
  POST /reset_prefix_cache?reset_running_requests= -> {"success"}
  GET  /weight_info -> {"weight_version"};  POST /update_weight_version {new_version} -> {"success", "new_version"}
  GET  /get_world_size -> {"world_size"};  GET /server_info -> {"vllm_config", "vllm_env", "system_env"}
  POST /sleep?level=&mode=, /wake_up?tags=;  GET /is_sleeping

The weight-transfer phases and ``/weight_checker`` are in :mod:`strop.serving.routes_transfer`. Where strop
serve differs from vLLM on purpose: weight versions are integers (``new_version`` a non-negative decimal
string: strop compares versions, it never guesses them); ``/update_weight_version`` aborts in-flight
requests only when asked (``abort_all_requests``, SGLang's field); requests that arrive while paused wait
and run after ``/resume`` in every mode (vLLM 0.33 refuses them with 503 in ``abort`` and ``wait``).
Errors are 4xx with vLLM's error body, ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import platform
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import StrictStr

from strop.serving.openai import error_json
from strop.serving.service import StrictBody, service_of

router = APIRouter()
VLLM_PAUSE_MODES = Literal["abort", "wait", "keep"]


def rl_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "BadRequestError" if status == 400 else "InternalServerError" if status >= 500 else "Error"
    return error_json(status, message, kind, status, param=param)


def version_number(value: str, param: str) -> int | JSONResponse:
    """A version strop serve takes: a non-negative decimal integer string below 2**63."""
    if not (value.isascii() and value.isdigit()) or int(value) >= 2**63:
        return rl_error(
            400,
            f"weight version {value!r}: strop serve's versions are non-negative integers, as decimal strings",
            param,
        )
    return int(value)


@router.post("/pause")
async def pause(
    request: Request,
    mode: Annotated[VLLM_PAUSE_MODES, Query()] = "abort",
    clear_cache: Annotated[bool, Query()] = True,  # (strop serve keeps no KV cache between batches)
):
    """``abort``: in-flight requests end now with their tokens so far; ``wait``: returns when they have
    finished; ``keep``: they freeze and continue after /resume (recomputed if the weights changed)."""
    await service_of(request).engine.pause(mode)
    await asyncio.sleep(0.02)  # the last tokens decoded before the pause go out to their streams first (as vLLM)
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request):
    service_of(request).engine.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request):
    return {"is_paused": service_of(request).engine.paused is not None}


@router.post("/abort_requests")
async def abort_requests(request: Request):
    """End the requests named (their ``rid``), or every request in flight (an empty or missing list)."""
    engine = service_of(request).engine
    try:
        body = await request.json() if await request.body() else {}
    except ValueError:
        return rl_error(400, "Invalid JSON format", "body")
    if not isinstance(body, dict):
        return rl_error(400, "Request body must be a JSON object", "body")
    ids = body.get("request_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        return rl_error(400, "request_ids must be a list of strings", "body.request_ids")
    if ids:
        found = [rid for rid in ids if await engine.abort(rid)]
        return {"status": "aborted", "aborted": len(found)}
    n = engine.in_flight
    await engine.abort_all()
    return {"status": "aborted", "aborted": n}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    request: Request,
    reset_running_requests: Annotated[bool, Query()] = False,
    reset_external: Annotated[bool, Query()] = False,
):
    """strop serve keeps no prefix cache between batches: nothing to drop, except a kept batch's KV cache
    (``reset_running_requests``: recomputed when it resumes)."""
    if reset_running_requests:
        service_of(request).engine.forget_held_cache()
    return {"success": True}


class VersionBody(StrictBody):
    new_version: StrictStr
    abort_all_requests: bool = False  # (SGLang's field; vLLM never aborts on a relabel)


@router.post("/update_weight_version")
async def update_weight_version(body: VersionBody, request: Request):
    """Relabel the weights held (vLLM and SGLang): the version changes, the weights do not."""
    engine = service_of(request).engine
    version = version_number(body.new_version, "body.new_version")
    if isinstance(version, JSONResponse):
        return version
    if body.abort_all_requests:
        await engine.abort_all()
    engine.weight_version = version
    return {"success": True, "new_version": body.new_version}


@router.get("/weight_info")
async def weight_info(request: Request):
    """The version of the weights held, as vLLM reports it (a string): the launch version until an update."""
    return {"weight_version": str(service_of(request).engine.weight_version)}


@router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: Annotated[bool, Query()] = True):
    """The processes that receive a broadcast update besides the trainer: strop serve is one."""
    return {"world_size": 1}


@router.get("/server_info")
async def server_info(request: Request, config_format: Annotated[Literal["text", "json"], Query()] = "text"):
    """vLLM's keys; the config is strop serve's (model, device, dtype, decoder, transfer backend)."""
    svc = service_of(request)
    engine = svc.engine
    config = {
        "model": svc.model_name,
        "device": str(engine.device),
        "dtype": str(next(engine.model.parameters()).dtype).removeprefix("torch."),
        "decode_path": engine.decode_path,
        "max_batch_size": engine.max_batch_size,
        "context_window": engine.context_window,
        "weight_transfer_backend": svc.transfer.backend,
    }
    text = ", ".join(f"{k}={v!r}" for k, v in config.items())
    return {
        "vllm_config": text if config_format == "text" else config,
        "vllm_env": {},
        "system_env": {"torch_version": torch.__version__, "python_version": platform.python_version()},
    }


@router.post("/sleep")
async def sleep(
    request: Request,
    level: Annotated[int, Query(ge=0, le=2)] = 0,
    mode: Annotated[VLLM_PAUSE_MODES, Query()] = "abort",
):
    """Level 0: pause scheduling (``mode`` as /pause). Levels 1 and 2 (vLLM: weights and KV cache moved off
    the GPU) are refused: strop serve cannot give that memory back and say it did."""
    svc = service_of(request)
    if level > 0:
        return rl_error(
            400, f"sleep level {level}: strop serve sleeps at level 0 only (pause scheduling)", "query.level"
        )
    await svc.engine.pause(mode)
    svc.sleeping = True
    return {"status": "sleeping", "level": level}


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None):
    svc = service_of(request)
    unknown = sorted(set(tags or ()) - {"weights", "kv_cache", "scheduling"})
    if unknown:
        return rl_error(400, f"unknown tags {unknown}: weights, kv_cache or scheduling", "query.tags")
    if svc.sleeping:
        svc.engine.resume()
        svc.sleeping = False
    return {"status": "awake", "tags": tags}


@router.get("/is_sleeping")
async def is_sleeping(request: Request):
    return {"is_sleeping": service_of(request).sleeping}
