"""strop serve's LoRA route: a run that trains adapters (``model.lora_rank``, ``engine.sync='adapter'``) sends
each version's adapter alone, a few megabytes, and the server merges it into the weights it decodes.

``POST /load_lora_adapter`` takes SGLang's two fields, ``lora_name`` and ``lora_path`` (a peft adapter folder,
or a file or folder of ``<module>.lora_A`` / ``<module>.lora_B`` tensors, inside ``--weights-dir``,
strop.wire.lora), and strop's own: ``scaling`` (``lora_alpha / lora_rank``; else from the folder's
``adapter_config.json``) and ``weight_version``. Each adapted weight becomes ``base + scaling
B A`` (strop.wire.lora.merge, the trainer's own formula), where ``base`` is that weight as it was before the
first adapter was merged (a full weight update resets it). The answer carries the checksum of the merged
weights: the trainer compares it with its own, and ``loaded_adapters`` (SGLang's answer). Requests need not name
the adapter: every request decodes the newest merged weights, whose version each completion reports. A client
speaking SGLang's runtime adapters gets their answers: ``/generate`` takes ``lora_path`` naming the merged adapter
(another name is refused: one adapter at a time), ``/v1/models`` lists it, and ``POST /unload_lora_adapter``
forgets any other (the merged one stays until the next replaces it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from pydantic import Field

from strop.openmp import releasing
from strop.serving.routes_weights import Version, load_weights_dir
from strop.serving.service import StrictBody, service_of
from strop.wire.digest import state_checksum
from strop.wire.lora import CONFIG_FILE, adapter_pairs, config_scaling, merge

router = APIRouter()


class AdapterBody(StrictBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    scaling: float | None = Field(None, gt=0, allow_inf_nan=False)
    weight_version: Version | None = None
    pinned: bool = False  # (SGLang's: keep it loaded; the merged adapter stays until the next one)


class UnloadBody(StrictBody):
    lora_name: str = Field(min_length=1)


def merged_state(svc, state: dict, scaling: float) -> dict:
    """The adapter's weights merged over their base (recorded here the first time a module is adapted)."""
    own = svc.engine.model.state_dict()
    pairs = adapter_pairs(state)
    unknown = sorted(m for m in pairs if f"{m}.weight" not in own)
    if unknown:
        raise ValueError(f"the model has no linear weights {unknown[:5]}")
    out = {}
    for module, (a, b) in pairs.items():
        name = f"{module}.weight"
        base = svc.lora_base.get(name)
        if base is None:
            base = svc.lora_base[name] = own[name].detach().clone()
        out[name] = merge(base, a.to(base.device), b.to(base.device), scaling)
    return out


def folder_scaling(path: str, root: str) -> float | None:
    """The scale in the ``adapter_config.json`` of the folder ``path`` (inside ``root``, links followed)."""
    folder = Path(root, path)
    if not (folder / CONFIG_FILE).resolve().is_relative_to(Path(root).resolve()):
        raise PermissionError(f"{path!r}/{CONFIG_FILE} is outside the weights folder {root}")
    return config_scaling(folder)


@router.post("/load_lora_adapter")
async def load_lora_adapter(body: AdapterBody, request: Request):
    svc = service_of(request)
    engine, where = svc.engine, "load_lora_adapter"
    if svc.weights_dir is None:
        raise HTTPException(
            status_code=403, detail=f"{where} is off: start strop serve with --weights-dir DIR (the trainer's folder)"
        )
    try:
        state = await asyncio.to_thread(releasing(load_weights_dir), body.lora_path, engine.device, svc.weights_dir)
        scaling = body.scaling or await asyncio.to_thread(folder_scaling, body.lora_path, svc.weights_dir)
        if scaling is None:
            raise ValueError(f"no scaling given and no adapter_config.json at {body.lora_path!r} to read it from")
        merged = await asyncio.to_thread(releasing(merged_state), svc, state, scaling)
    except PermissionError as exc:
        raise HTTPException(status_code=403, detail=f"{where}: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise HTTPException(status_code=400, detail=f"{where}: {exc}") from exc
    version = await engine.update_weights(merged, version=body.weight_version, strict=False)
    svc.lora_name = body.lora_name
    return {
        "success": True,
        "message": f"adapter {body.lora_name} merged into {len(merged)} weights",
        "loaded_adapters": {body.lora_name: body.lora_path},  # (SGLang's answer: what requests may name)
        "weight_version": version,
        "checksum": await asyncio.to_thread(releasing(state_checksum), merged),
    }


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadBody, request: Request):
    """SGLang's: forget an adapter. strop serve holds one, merged, until the next: any other name is not held (a
    success, as SGLang answers for one it unloads), and the merged one stays until another replaces it."""
    svc = service_of(request)
    if body.lora_name == svc.lora_name:
        raise HTTPException(
            status_code=400,
            detail=f"{body.lora_name[:100]!r} is merged into the weights this server decodes: load the next adapter "
            "(or full weights) to replace it",
        )
    held = {svc.lora_name: "merged"} if svc.lora_name else {}
    return {"success": True, "error_message": None, "loaded_adapters": held}
