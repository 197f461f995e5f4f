"""Scored samples on disk: what ``strop rollout`` writes and ``strop train --data.samples=FILE`` trains on.

JSON lines. The first line is a header ``{"strop_samples": 1, "rollout": {...}}`` with the rollout
settings that shaped the logprobs (the temperature above all). Every other line is one sample of
one step: ``step``, ``group_id``, ``index``, ``prompt_ids``, ``response_ids``, ``rollout_logprobs``,
``loss_mask``, ``weight_versions``, ``reward``, ``status``, ``label``, ``metadata``, and for a routed-experts
(MoE) model ``routed_experts``: ``{"shape": [tokens, layers, top_k], "int16": base64}``, the engine's routes as
little-endian int16 (what routing replay needs; JSON lists would be three times the size). Floats are written
with Python's shortest round-trip form, so logprobs read back bit for bit.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import torch

from strop.data.sources import DataError
from strop.types import Sample, Status

FORMAT = 1
KEYS = ("prompt_ids", "response_ids", "rollout_logprobs", "loss_mask", "weight_versions", "reward", "status")


def write_header(path: Path, rollout: dict) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"strop_samples": FORMAT, "rollout": rollout}) + "\n")


def write_samples(path: Path, samples: list[Sample], step: int) -> None:
    with open(path, "a") as f:
        for s in samples:
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "group_id": s.group_id,
                        "index": s.index,
                        "prompt": s.prompt,
                        "prompt_ids": s.prompt_ids,
                        "response_ids": s.response_ids,
                        "rollout_logprobs": s.rollout_logprobs,
                        "loss_mask": s.loss_mask,
                        "weight_versions": s.weight_versions,
                        "reward": s.reward,
                        "status": s.status.value,
                        "label": s.label,
                        "metadata": s.metadata,
                        **({} if s.routed_experts is None else {"routed_experts": routes_record(s.routed_experts)}),
                    },
                    default=str,
                )
                + "\n"
            )


def routes_record(routes: torch.Tensor) -> dict:
    data = routes.to(torch.int16).contiguous().numpy().astype("<i2").tobytes()
    return {"shape": list(routes.shape), "int16": base64.b64encode(data).decode("ascii")}


def read_routes(rec) -> torch.Tensor:
    """A sample's ``routed_experts`` record back as an int16 tensor; a malformed one raises ValueError."""
    if not isinstance(rec, dict) or not isinstance(rec.get("shape"), list) or not isinstance(rec.get("int16"), str):
        raise ValueError('routed_experts must be {"shape": [tokens, layers, top_k], "int16": base64}')
    shape = rec["shape"]
    if len(shape) != 3 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"routed_experts shape {shape} is not [tokens, layers, top_k]")
    try:
        data = base64.b64decode(rec["int16"], validate=True)
    except ValueError:
        raise ValueError("routed_experts int16 is not base64") from None
    if len(data) != 2 * shape[0] * shape[1] * shape[2]:
        raise ValueError(f"routed_experts holds {len(data)} bytes, but shape {shape} needs {2 * np.prod(shape)}")
    return torch.from_numpy(np.frombuffer(data, dtype="<i2").astype(np.int16).reshape(shape))


def read_samples(path: str | Path) -> tuple[dict, dict[int, list[Sample]]]:
    """The header's rollout settings and the samples of each step. A bad line names file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.samples={str(path)!r}: no such file (write one with `strop rollout`)")
    steps: dict[int, list[Sample]] = {}
    header = None
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if n == 1:
                if not isinstance(rec, dict) or rec.get("strop_samples") != FORMAT:
                    raise DataError(
                        f"{path}:1: not a strop samples file (no header "
                        f'{{"strop_samples": {FORMAT}, ...}}; write one with `strop rollout`)'
                    )
                header = rec
                continue
            missing = [k for k in ("step", *KEYS) if k not in rec]
            if missing:
                raise DataError(f"{path}:{n}: missing {', '.join(missing)}")
            s = Sample(
                prompt=rec.get("prompt", ""),
                prompt_ids=rec["prompt_ids"],
                label=rec.get("label"),
                group_id=rec.get("group_id", 0),
                index=rec.get("index", 0),
                metadata=rec.get("metadata") or {},
            )
            s.response_ids, s.rollout_logprobs = list(rec["response_ids"]), [float(x) for x in rec["rollout_logprobs"]]
            s.loss_mask, s.weight_versions = list(rec["loss_mask"]), list(rec["weight_versions"])
            s.reward, s.status = rec["reward"], Status(rec["status"])
            try:
                if rec.get("routed_experts") is not None:
                    s.routed_experts = read_routes(rec["routed_experts"])
                s.check()
            except ValueError as exc:
                raise DataError(f"{path}:{n}: {exc}") from None
            steps.setdefault(int(rec["step"]), []).append(s)
    if header is None or not steps:
        raise DataError(f"{path}: no samples")
    return header["rollout"], steps
