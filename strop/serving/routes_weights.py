"""strop serve's weight-update routes (SGLang's names and payloads), over the one
:class:`strop.serving.service.ServeService`:
  POST /update_weights_from_disk {model_path, weight_version}
  POST /pause_generation {mode}, /continue_generation, /begin_weight_update, /end_weight_update
  POST /init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group
  GET|POST /weights_checker {action: "checksum"};  GET /weights_manifest (strop's own)

A broadcast update, as SGLang 0.5.23 takes it: pause, begin, one update call per bucket (each
joins the trainer's broadcast on the group), end, continue. From begin to end no batch runs,
so no row decodes on half-updated weights. Weights load from disk only from inside ``weights_dir``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, HTTPException, Request
from pydantic import Field, StrictInt, StrictStr, model_validator

from strop.openmp import releasing
from strop.serving.embedded import EmbeddedEngine
from strop.serving.request import PAUSE_MODES, RequestError
from strop.serving.service import StrictBody, service_of
from strop.serving.transfer import check_state, load_weights_dir
from strop.wire.buckets import Bucket, first_mismatch, manifest_of
from strop.wire.digest import state_checksum
from strop.wire.errors import EngineVersionError, parse_weight_version
from strop.wire import group as wire_group  # (called through the module: tests stand in for its functions)

log = logging.getLogger("strop.serve")
router = APIRouter()

Version = Annotated[int, Field(ge=0, lt=2**63)]  # "7" is read as 7; "default" is refused


class DiskUpdateBody(StrictBody):
    model_path: str = Field(min_length=1)
    weight_version: Version | None = None
    digests: dict[str, str] | None = None  # delta form: the file holds only these tensors, each checked
    load_format: Literal["auto", "safetensors"] | None = Field(
        None, description="strop serve reads safetensors only; other formats are refused, not ignored"
    )
    flush_cache: bool = True  # strop serve keeps no KV cache between batches: there is nothing to flush
    abort_all_requests: bool = False


class GroupBody(StrictBody):
    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=4096)
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)
    backend: Literal["gloo", "nccl"] = "gloo"

    @model_validator(mode="after")
    def _rank_in_world(self):
        if self.rank_offset >= self.world_size:
            raise ValueError(f"rank_offset {self.rank_offset} must be below world_size {self.world_size}")
        return self


class GroupNameBody(StrictBody):
    group_name: str = Field("weight_update_group", min_length=1, max_length=256)


Selector = Literal["target", "draft", "all"]  # SGLang's: the main model, its speculative draft model, or both


class DistributedUpdateBody(StrictBody):
    """SGLang 0.5.23's ``UpdateWeightsFromDistributedReqInput``: one bucket of whole tensors."""

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True  # strop serve keeps no prefix cache: there is nothing to flush
    abort_all_requests: bool = False
    weight_version: StrictStr | StrictInt | None = None  # the client sends it with the last bucket only
    load_format: Literal["flattened_bucket"] | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class PauseBody(StrictBody):
    mode: Literal[PAUSE_MODES] = "abort"


class ContinueBody(StrictBody):
    torch_empty_cache: bool = True


class SessionBody(StrictBody):
    selector: Selector = "all"


class CheckerBody(StrictBody):
    action: str = "checksum"


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: DiskUpdateBody, request: Request):
    """Read, check and (after loading) checksum the weights in threads: requests in flight keep
    decoding while a large file loads."""
    svc = service_of(request)
    engine, weights_dir = svc.engine, svc.weights_dir
    if weights_dir is None:
        raise HTTPException(
            status_code=403,
            detail="update_weights_from_disk is off: start strop serve with "
            "--weights-dir DIR (the folder the trainer writes weights to)",
        )
    own = engine.model.state_dict()
    try:
        state = await asyncio.to_thread(releasing(load_weights_dir), body.model_path, engine.device, weights_dir)
        await asyncio.to_thread(releasing(check_state), state, own, body.digests)
    except PermissionError as exc:
        raise HTTPException(status_code=403, detail=f"update_weights_from_disk: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise HTTPException(status_code=400, detail=f"update_weights_from_disk: {exc}") from exc
    if body.abort_all_requests:
        await engine.abort_all()
    version = await engine.update_weights(state, version=body.weight_version, strict=body.digests is None)
    svc.weights_replaced()
    return {
        "success": True,
        "message": "weights loaded",
        "weight_version": version,
        "checksum": await asyncio.to_thread(releasing(state_checksum), state),
    }


@router.post("/init_weights_update_group")
async def init_group(body: GroupBody, request: Request):
    """Join the trainer's weight-sync group as rank ``rank_offset`` (returns once every rank
    joined), built as SGLang builds it. Groups joined before are torn down: one trainer, one
    live group (a reconnect); a weight-update session the previous trainer left open ends
    too (its buckets came through the old group), while a pause stays until /continue_generation."""
    svc = service_of(request)
    engine, groups = svc.engine, svc.groups
    for name in list(groups):
        await svc.destroy_group(name)
    if engine.updating:
        log.warning("strop serve: a new weight update group ends the session the previous trainer left open")
        try:
            engine.end_update()
        except RequestError:  # still opening (a batch is finishing): the new trainer's begin is refused
            pass
    try:
        group = await asyncio.to_thread(
            wire_group.make_group,
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.backend,
            name=body.group_name,
        )
    except (RuntimeError, ValueError, OSError) as exc:
        raise HTTPException(status_code=400, detail=f"init_weights_update_group: {exc}") from exc
    groups[body.group_name] = group
    return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}


@router.post("/destroy_weights_update_group")
async def destroy_group(body: GroupNameBody, request: Request):
    """Tear down a weight-sync group (the trainer's reconnect); no such group is no error."""
    found = await service_of(request).destroy_group(body.group_name)
    return {"success": True, "message": f"{'destroyed' if found else 'no'} group {body.group_name}"}


def version_of(value, where: str) -> int:
    try:
        return parse_weight_version(value, where)
    except EngineVersionError as exc:
        raise HTTPException(status_code=400, detail=str(exc)) from exc


def only_target(selector: str, where: str) -> None:
    if selector == "draft":
        raise HTTPException(status_code=400, detail=f"{where}: selector 'draft': strop serve has no draft model")


def empty_cache(engine: EmbeddedEngine, asked: bool) -> None:
    if asked and engine.device.type == "cuda":
        torch.cuda.empty_cache()


@router.post("/pause_generation")
async def pause_generation(request: Request, body: PauseBody | None = None):
    """SGLang's pause: no batch runs until /continue_generation, new requests wait. Only
    /continue_generation ends it (no deadline: see :meth:`EmbeddedEngine.pause`)."""
    engine = service_of(request).engine
    mode = (body or PauseBody()).mode
    await engine.pause(mode)
    return {"message": f"generation paused ({mode})", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(request: Request, body: ContinueBody | None = None):
    engine = service_of(request).engine
    engine.resume()
    empty_cache(engine, (body or ContinueBody()).torch_empty_cache)
    return {"message": "generation continued", "status": "ok"}


@router.post("/begin_weight_update")
async def begin_weight_update(request: Request, body: SessionBody | None = None):
    """Open a weight-update session: from now to /end_weight_update no batch runs (a batch
    running unpaused finishes first). One session at a time: a second begin is refused."""
    engine = service_of(request).engine
    only_target((body or SessionBody()).selector, "begin_weight_update")
    try:
        await engine.begin_update()
    except RequestError as exc:
        raise HTTPException(status_code=400, detail=f"begin_weight_update: {exc}") from exc
    return {"success": True, "message": "weight update begun"}


@router.post("/end_weight_update")
async def end_weight_update(request: Request, body: SessionBody | None = None):
    svc = service_of(request)
    engine = svc.engine
    try:
        digest = engine.end_update()
    except RequestError as exc:
        raise HTTPException(status_code=400, detail=f"end_weight_update: {exc}") from exc
    svc.weights_replaced()
    # (strop's own field, the session's receipt: a digest of every byte received, in order)
    return {"success": True, "message": "weight update ended", "checksum": digest}


@router.post("/update_weights_from_distributed")
async def update_from_distributed(body: DistributedUpdateBody, request: Request):
    """Receive one bucket the trainer broadcasts, inside a session. Everything is checked
    (session, names, dtypes, shapes, version, group) before the broadcast is joined: a refused
    bucket moves no byte. A broadcast that fails (the trainer died, the group timed out)
    answers 500 with the cause; the bucket's tensors may then be partly written, the version
    is unchanged and the session stays open until /end_weight_update (or a new group)."""
    svc = service_of(request)
    engine = svc.engine
    where = "update_weights_from_distributed"
    if not engine.updating:
        raise HTTPException(
            status_code=400, detail=f"{where} must run between begin_weight_update() and end_weight_update()"
        )
    only_target(body.selector, where)
    try:
        bucket = Bucket.from_payload(body.names, body.dtypes, body.shapes, body.load_format)
    except ValueError as exc:
        raise HTTPException(status_code=400, detail=f"{where}: {exc}") from exc
    sent = list(zip(bucket.names, bucket.dtypes, bucket.shapes))
    held = [m for m in manifest_of(engine.model.state_dict()) if m[0] in bucket.names]
    wrong = first_mismatch(sent, held, "strop serve")
    if wrong is not None:
        raise HTTPException(status_code=400, detail=f"{where}: {wrong}; nothing was received")
    version = None if body.weight_version is None else version_of(body.weight_version, where)
    group = svc.groups.get(body.group_name)
    if group is None:
        raise HTTPException(
            status_code=400,
            detail=f"{where}: no weight update group {body.group_name!r}: call /init_weights_update_group first",
        )
    if body.abort_all_requests:
        await engine.abort_all()
    try:
        await engine.receive_bucket(group, bucket)
    except RequestError as exc:
        raise HTTPException(status_code=400, detail=f"{where}: {exc}") from exc
    except Exception as exc:  # the collective failed: a peer is gone or the group timed out
        log.warning("strop serve: broadcast on %s failed: %s", body.group_name, exc)
        raise HTTPException(
            status_code=500,
            detail=f"{where}: the broadcast on group {body.group_name!r} "
            f"failed ({type(exc).__name__}: {exc}); the weights may be partly updated, the "
            f"version is still {engine.weight_version}",
        ) from exc
    out = {"success": True, "message": f"received {len(bucket.names)} tensors"}
    if version is not None:
        engine.weight_version = out["weight_version"] = version
    empty_cache(engine, body.torch_empty_cache)
    return out


@router.get("/weights_manifest")
async def weights_manifest(request: Request):
    """The model's tensors, each once (aliases dropped): a trainer compares its own before it
    sends anything."""
    engine = service_of(request).engine
    manifest = manifest_of(engine.model.state_dict())
    return {
        "names": [n for n, _, _ in manifest],
        "dtypes": [d for _, d, _ in manifest],
        "shapes": [list(s) for _, _, s in manifest],
    }


@router.api_route("/weights_checker", methods=["GET", "POST"])
async def weights_checker(request: Request, body: CheckerBody | None = None):
    """The checksum of the weights held (state_checksum over the manifest's tensors), to
    compare with the trainer's of what it sent."""
    engine = service_of(request).engine
    action = (body or CheckerBody()).action
    if action != "checksum":
        raise HTTPException(
            status_code=400,
            detail=f"weights_checker: action {action!r} is not supported by strop serve (only 'checksum')",
        )
    return {"success": True, "checksum": await engine.weights_checksum(), "weight_version": engine.weight_version}
