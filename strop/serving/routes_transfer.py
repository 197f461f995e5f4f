"""strop serve's answers to vLLM's weight-transfer phases and weight checker, over
:class:`strop.serving.transfer.WeightTransfer` (the backends, the staging):

  POST /init_weight_transfer_engine {init_info}  -> {"message"}   (once per trainer; again to reconnect)
  POST /start_weight_update                       -> {"message"}
  POST /update_weights {update_info}              -> {"message"}   (one or more)
  POST /finish_weight_update {weight_version?}    -> {"message"}   (the staged tensors load here, between batches)
  POST /shutdown_weight_transfer_engine           -> {"message"}
  POST /weight_checker {action: checksum|reset|compare, baseline?}

Out of order (an update or finish without a start, a second start, a shutdown during an update) is 409
with the reason, and the server keeps serving; vLLM answers these with 500 from its worker. A chunk with
a field the model cannot take (a name it lacks, another shape or dtype) is 400 naming the field, nothing
staged, the round still open. A transfer that fails midway drops the round: the previous weights keep
serving, the version unchanged.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Request
from pydantic import StrictStr

from strop.openmp import releasing
from strop.serving.routes_rl import rl_error, version_number
from strop.serving.service import StrictBody, service_of
from strop.serving.receipt import no_receipt
from strop.serving.transfer import TransferError, check_state, load_weights_dir
from strop.wire.buckets import manifest_of

router = APIRouter()


def _refused(exc: TransferError):
    return rl_error(exc.status, str(exc), exc.param)


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request, init_info: Annotated[dict[str, Any], Body(embed=True)]):
    svc = service_of(request)
    try:
        async with svc.transfer_lock:
            await asyncio.to_thread(svc.transfer.init, init_info)
    except TransferError as exc:
        return _refused(exc)
    return {"message": "Weight transfer initialized"}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request):
    svc = service_of(request)
    try:
        async with svc.transfer_lock:
            await asyncio.to_thread(svc.transfer.shutdown)
    except TransferError as exc:
        return _refused(exc)
    return {"message": "Weight transfer shut down"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request):
    svc = service_of(request)
    try:
        svc.transfer.start(set(svc.engine.weights()))
    except TransferError as exc:
        return _refused(exc)
    return {"message": "Weight update started"}


@router.post("/update_weights")
async def update_weights(request: Request, update_info: Annotated[Any, Body(embed=True)]):
    """Stage one chunk (received in a thread: generation goes on meanwhile, on the old weights)."""
    svc = service_of(request)
    engine = svc.engine
    own = dict(engine.model.state_dict())
    try:
        async with svc.transfer_lock:  # chunks pair with the trainer's sends, in order: one at a time
            await asyncio.to_thread(releasing(svc.transfer.update), update_info, own, engine.device)
    except TransferError as exc:
        return _refused(exc)
    return {"message": "Weights updated"}


@router.post("/finish_weight_update")
async def finish_weight_update(request: Request, weight_version: Annotated[StrictStr | None, Body(embed=True)] = None):
    """Load the round's tensors into the model between two batches and take ``weight_version`` (unchanged
    without one). A bad version is refused before anything loads, the round still open."""
    svc = service_of(request)
    engine, transfer = svc.engine, svc.transfer
    version = engine.weight_version
    if weight_version is not None:
        version = version_number(weight_version, "body.weight_version")
        if not isinstance(version, int):
            return version
    async with svc.transfer_lock:
        try:
            staged = transfer.finish()
        except TransferError as exc:
            return _refused(exc)
        if staged:
            await engine.update_weights(staged, version=version, strict=False)
            svc.weights_replaced()
        engine.weight_version = version
    return {"message": "Weight update finished"}


class CheckerBody(StrictBody):
    action: Literal["checksum", "reset", "compare"]
    baseline: dict[str, str] | None = None


@router.post("/weight_checker")
async def weight_checker(body: CheckerBody, request: Request):
    """vLLM's checker. ``checksum``: a digest per tensor held, keyed as vLLM keys its one worker's
    (``{"checksums": {"dp0:pp0:pcp0:tp0:" + name: digest}}``);
    ``compare``: against ``baseline`` (``{"match", "mismatches"}``); ``reset``: zero every weight, the
    start of a corrupt-then-restore check (the next full update must restore them all)."""
    engine = service_of(request).engine
    if body.action == "compare" and body.baseline is None:
        return rl_error(400, "action='compare' requires a 'baseline' object", "body.baseline")
    if body.action == "reset":
        await engine.zero_weights()
        return {"status": "reset"}
    checksums = await engine.tensor_digests()
    if body.action == "checksum":
        return {"checksums": checksums}
    mismatches = sorted(k for k in checksums.keys() | body.baseline.keys() if checksums.get(k) != body.baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


class RpcBody(StrictBody):
    method: str
    args: list = []
    kwargs: dict[str, str] = {}
    timeout: float | None = None


@router.post("/collective_rpc")
async def collective_rpc(body: RpcBody, request: Request):
    """The methods strop's vLLM worker extension answers (:mod:`strop.serving.vllm_worker`), and vLLM's
    ``reload_weights``, answered as vLLM answers: ``{"results": [one per worker]}`` (strop serve is one)."""
    svc = service_of(request)
    engine, method = svc.engine, body.method
    if method == "strop_info":
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        info = {"pid": os.getpid(), "rank": 0, "device": str(engine.device), "dtype": dtype}
        return {"results": [{**info, "transfer_backend": f"strop serve ({svc.transfer.backend})"}]}
    if method == "strop_manifest":
        manifest = manifest_of(engine.model.state_dict())
        names, dtypes, shapes = ([m[i] for m in manifest] for i in range(3))
        return {"results": [{"names": names, "dtypes": dtypes, "shapes": [list(s) for s in shapes]}]}
    if method == "strop_receipt":
        return {"results": [svc.transfer.receipt_now() or no_receipt()]}
    if method == "reload_weights":
        return await _reload(svc, body.kwargs)
    return rl_error(501, f"Method {method!r} is not implemented by strop serve", "body.method")


async def _reload(svc, kwargs: dict):
    """vLLM's disk reload: every tensor of the model from ``weights_path`` (inside ``--weights-dir``)."""
    engine, where = svc.engine, "body.kwargs.weights_path"
    if svc.weights_dir is None:
        return rl_error(403, "reload_weights reads only from --weights-dir, and none was given", where)
    try:
        state = await asyncio.to_thread(
            releasing(load_weights_dir), kwargs.get("weights_path", ""), engine.device, svc.weights_dir
        )
        await asyncio.to_thread(releasing(check_state), state, engine.model.state_dict(), None)
    except PermissionError as exc:
        return rl_error(403, str(exc), where)
    except (OSError, ValueError) as exc:
        return rl_error(400, str(exc), where)
    await engine.update_weights(state, version=engine.weight_version)
    svc.weights_replaced()
    return {"results": [None]}
