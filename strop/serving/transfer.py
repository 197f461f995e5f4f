"""strop serve's side of vLLM's four-phase weight transfer: ``init`` once (a backend joins the trainer),
then each round ``start``, one or more ``update`` calls, ``finish`` (with the new version).

Received tensors are staged apart from the model and copied into it only at ``finish``, between two
batches: generation goes on, on the old weights, while an update arrives; no request ever decodes on
half-updated weights; and an update that fails midway (a broadcast that breaks, a bad chunk) is
dropped whole, leaving the previous weights serving and the version unchanged. The staging costs the
memory of the tensors an update carries until ``finish``.

Backends (``strop serve --weight-transfer-backend``):

- ``gloo`` (default; ``nccl`` on a GPU): strop's broadcast. ``init_info``: ``master_address``,
  ``master_port``, ``rank_offset``, ``world_size`` (vLLM's NCCL fields) and strop's ``group_name`` and
  ``timeout_s``. ``update_info``: ``names``, ``dtype_names``, ``shapes`` (vLLM's), received one
  broadcast per tensor in order, or, with ``packed: true``, one broadcast of their bytes concatenated
  (strop's flattened bucket).
- ``disk``: ``update_info`` ``{"path", "digests"?}``: safetensors inside ``--weights-dir`` (with
  ``digests``, strop's delta form: only those tensors, each checked).
- ``checkpoint``: ``update_info`` ``{"safetensors_b64"}``: the tensors in the body, a base64 safetensors
  file; for small models and tests.

Errors are :class:`TransferError`: the HTTP status, the field it concerns (``body.update_info.names``)
and a message; the route answers them in vLLM's error shape.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file

from strop.serving.receipt import ReceiptSession
from strop.wire import group as wire_group  # (called through the module: tests stand in for its functions)
from strop.wire.buckets import Bucket, manifest_of
from strop.wire.digest import tensor_digest

BACKENDS = ("gloo", "nccl", "disk", "checkpoint")


class TransferError(Exception):
    """A transfer call refused or failed: ``status`` (409 out of order, 400 a bad field, 403 a path outside
    the weights folder, 500 the transfer itself failed), ``param`` (the field, or None) and the message."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def _bad(message: str, param: str) -> TransferError:
    return TransferError(400, message, param)


class WeightTransfer:
    """One server's transfer state: the backend, its group (broadcast backends), and the open round's
    staged tensors. The caller (strop.serving.routes_transfer) serialises the calls."""

    def __init__(self, backend: str = "gloo", weights_dir: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"weight transfer backend {backend!r}: one of {', '.join(BACKENDS)}")
        self.backend, self.weights_dir = backend, weights_dir
        self.group = None  # the broadcast backends' group, once init joined it
        self.staged: dict[str, torch.Tensor] | None = None  # the open round's tensors (None: no round open)
        self.receipt: ReceiptSession | None = None  # every byte the open round received, in order
        self.last_receipt: dict | None = None  # the last finished round's receipt (ReceiptSession.receipt)

    @property
    def broadcast(self) -> bool:
        return self.backend in ("gloo", "nccl")

    # --- the phases ---

    def init(self, init_info: dict[str, Any]) -> None:
        """Join the trainer (broadcast backends; a group joined before is left first). The other backends
        take no init fields."""
        if not self.broadcast:
            if init_info:
                raise _bad(
                    f"the {self.backend} backend takes no init_info fields, got {sorted(init_info)}", "body.init_info"
                )
            return
        if self.staged is not None:
            raise TransferError(409, "a weight update is open: finish it before joining a new trainer")
        fields = _group_fields(init_info)
        if init_info.get("backend", self.backend) != self.backend:
            raise _bad(
                f"backend {init_info['backend']!r}: this server's transfer backend is {self.backend!r} "
                "(strop serve --weight-transfer-backend)",
                "body.init_info.backend",
            )
        self.shutdown()
        try:
            self.group = wire_group.make_group(*fields[:4], self.backend, fields[5], name=fields[4])
        except (RuntimeError, ValueError, OSError) as exc:
            raise TransferError(500, f"joining the trainer's group failed: {type(exc).__name__}: {exc}") from exc

    def shutdown(self) -> None:
        if self.staged is not None:
            raise TransferError(409, "Cannot release a trainer connection during a weight update")
        group, self.group = self.group, None
        if group is not None:
            wire_group.close_group(group)

    def start(self, expected: set[str]) -> None:
        """Open a round; ``expected``: the names a complete update writes (the receipt says which were)."""
        if self.staged is not None:
            raise TransferError(
                409, "start_weight_update called while a weight update is already active: finish_weight_update first"
            )
        self.staged, self.receipt = {}, ReceiptSession(expected)

    def update(self, update_info: Any, own: dict[str, torch.Tensor], device) -> list[str]:
        """Stage one chunk, checked against the model's tensors ``own`` before any byte moves (a refused
        chunk leaves the round open and unchanged). A broadcast that fails ends the round (500): what it
        staged is dropped. Returns the names staged."""
        if self.staged is None:
            raise TransferError(409, "start_weight_update must be called before update_weights")
        if not isinstance(update_info, dict):
            raise _bad("update_info must be an object (strop serve runs one worker)", "body.update_info")
        if self.broadcast:
            received = self._broadcast(update_info, own, device)
        elif self.backend == "disk":
            received = self._disk(update_info, own, device)
        else:
            received = self._checkpoint(update_info, own, device)
        self.staged.update(received)
        self.receipt.bucket(list(received), sum(t.numel() * t.element_size() for t in received.values()))
        return list(received)

    def finish(self) -> dict[str, torch.Tensor]:
        """Close the round; returns its staged tensors (the caller loads them into the model)."""
        if self.staged is None:
            raise TransferError(409, "finish_weight_update called without a matching start_weight_update")
        staged, self.staged = self.staged, None
        self.last_receipt, self.receipt = self.receipt.receipt(open_=False), None
        return staged

    def receipt_now(self) -> dict | None:
        """The open round's receipt (``loaded`` false), else the last finished round's, else None."""
        return self.receipt.receipt(open_=True) if self.receipt is not None else self.last_receipt

    def drop(self) -> None:
        """End the open round without loading anything (a failed transfer)."""
        self.staged, self.receipt = None, None

    # --- the backends ---

    def _broadcast(self, info: dict, own: dict, device) -> dict[str, torch.Tensor]:
        _only(info, {"names", "dtype_names", "shapes", "packed"})
        if self.group is None:
            raise TransferError(409, "weight transfer not initialized: call /init_weight_transfer_engine first")
        names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
            raise _bad("names, dtype_names and shapes must be lists", "body.update_info")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise _bad(
                f"names, dtype_names and shapes must be as long and not empty ({len(names)}, {len(dtypes)}, "
                f"{len(shapes)})",
                "body.update_info.names",
            )
        packed = info.get("packed", False)
        if not isinstance(packed, bool):
            raise _bad("packed must be true or false", "body.update_info.packed")
        try:
            buckets = (
                [Bucket.from_payload(names, dtypes, shapes, "flattened_bucket")]
                if packed
                else [Bucket.from_payload([n], [d], [s], None) for n, d, s in zip(names, dtypes, shapes)]
            )
        except (ValueError, TypeError) as exc:
            raise _bad(str(exc), "body.update_info") from exc
        _check_manifest([m for b in buckets for m in zip(b.names, b.dtypes, b.shapes)], own)
        out = {}
        try:
            for bucket in buckets:
                for name, t in wire_group.receive_bucket(self.group, bucket, device, digest=self.receipt.digest):
                    out[name] = t
        except Exception as exc:  # the collective failed: a peer is gone or the group timed out
            self.drop()
            raise TransferError(
                500,
                f"the broadcast failed ({type(exc).__name__}: {exc}); the update is dropped, the previous weights "
                "keep serving: start_weight_update again",
            ) from exc
        return out

    def _disk(self, info: dict, own: dict, device) -> dict[str, torch.Tensor]:
        _only(info, {"path", "digests"})
        path, digests = info.get("path"), info.get("digests")
        if not isinstance(path, str) or not path:
            raise _bad("path must be a non-empty string", "body.update_info.path")
        if digests is not None and not (
            isinstance(digests, dict) and all(isinstance(v, str) for v in digests.values())
        ):
            raise _bad("digests must map tensor names to checksums", "body.update_info.digests")
        if self.weights_dir is None:
            raise TransferError(403, "the disk backend reads only from --weights-dir, and none was given")
        try:
            state = load_weights_dir(path, device, self.weights_dir)
            check_state(state, own, digests)
        except PermissionError as exc:
            raise TransferError(403, str(exc), "body.update_info.path") from exc
        except (OSError, ValueError) as exc:
            raise _bad(str(exc), "body.update_info.path") from exc
        for t in state.values():
            self.receipt.digest.update(t)
        return state

    def _checkpoint(self, info: dict, own: dict, device) -> dict[str, torch.Tensor]:
        _only(info, {"safetensors_b64"})
        blob = info.get("safetensors_b64")
        if not isinstance(blob, str) or not blob:
            raise _bad("safetensors_b64 must be a base64 safetensors file", "body.update_info.safetensors_b64")
        try:
            state = load_safetensors(base64.b64decode(blob, validate=True))
        except Exception as exc:  # binascii.Error, safetensors' own errors
            raise _bad(f"not a base64 safetensors file: {exc}", "body.update_info.safetensors_b64") from exc
        if not state:
            raise _bad("the safetensors file holds no tensor", "body.update_info.safetensors_b64")
        _check_manifest(manifest_of(state), own)
        for t in state.values():
            self.receipt.digest.update(t)
        return {n: t.to(device) for n, t in state.items()}


def load_weights_dir(path: str, device, root: str | None = None) -> dict:
    """Every ``*.safetensors`` file of a folder (or one file) as one state dict, on ``device``.
    With ``root``, every file must resolve (symlinks and ``..`` followed) inside it."""

    def inside(f: Path) -> bool:
        return root is None or f.resolve().is_relative_to(Path(root).resolve())

    p = Path(root or ".", path).resolve()
    files = sorted(p.glob("*.safetensors")) if inside(p) and p.is_dir() else [p]
    if not all(inside(f) for f in files):
        raise PermissionError(f"{path!r} is outside the weights folder {root} (strop serve --weights-dir)")
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path!r}")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f), device=str(device)))
        except Exception as exc:  # safetensors' own error for a file that is not one
            raise ValueError(f"{f} is not a safetensors file: {exc}") from exc
    return state


def check_state(state: dict, own: dict, digests: dict | None) -> None:
    """Names, shapes (and, delta form, digests) before anything is copied: a rejected load leaves
    the model as it was. Without ``digests`` every tensor of the model must be there."""
    unknown = [n for n in state if n not in own]
    shapes = [n for n in state if n in own and tuple(state[n].shape) != tuple(own[n].shape)]
    missing = sorted(set(digests) ^ set(state)) if digests is not None else sorted(set(own) - set(state))
    changed = [n for n in state if digests and n in digests and tensor_digest(state[n]) != digests[n]]
    for what, names in (
        ("unknown tensors", unknown),
        ("wrong shapes", shapes),
        ("missing tensors", missing),
        ("tensors not matching their checksum", changed),
    ):
        if names:
            raise ValueError(f"{what}: {names[:5]}")


def _only(info: dict, known: set[str]) -> None:
    unknown = sorted(set(info) - known)
    if unknown:
        raise _bad(f"unknown fields {unknown} (this backend takes {sorted(known)})", f"body.update_info.{unknown[0]}")


def _check_manifest(sent, own: dict[str, torch.Tensor]) -> None:
    """Every tensor a chunk names exists in the model with that shape and dtype (400 naming the first
    that does not, and where it is in the chunk)."""
    for i, (name, dtype, shape) in enumerate(sent):
        held = own.get(name)
        if held is None:
            raise _bad(f"the model has no tensor {name!r}", f"body.update_info.names[{i}]")
        if tuple(held.shape) != tuple(shape):
            raise _bad(
                f"{name!r}: shape {list(shape)}, the model's is {list(held.shape)}", f"body.update_info.shapes[{i}]"
            )
        if str(held.dtype).removeprefix("torch.") != dtype:
            raise _bad(f"{name!r}: dtype {dtype}, the model holds {held.dtype}", f"body.update_info.dtype_names[{i}]")


def _group_fields(info: dict) -> tuple:
    """(address, port, rank, world, group name, timeout) from vLLM's NCCL ``init_info`` fields and strop's
    ``group_name`` and ``timeout_s`` (how long a broadcast may wait for the trainer: 600 s unless given)."""
    _only_init(
        info, {"master_address", "master_port", "rank_offset", "world_size", "group_name", "timeout_s", "backend"}
    )
    timeout = info.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise _bad(f"timeout_s must be a number of seconds in (0, 86400], got {timeout!r}", "body.init_info.timeout_s")
    address, port = info.get("master_address"), info.get("master_port")
    rank, world = info.get("rank_offset"), info.get("world_size")
    name = info.get("group_name", "weight_update_group")
    if not isinstance(address, str) or not address:
        raise _bad("master_address must be a host name or address", "body.init_info.master_address")
    for key, value, low, high in (("master_port", port, 1, 65535), ("world_size", world, 2, 4096)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise _bad(f"{key} must be an integer in [{low}, {high}], got {value!r}", f"body.init_info.{key}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank < world:
        raise _bad(f"rank_offset must be an integer in [1, world_size), got {rank!r}", "body.init_info.rank_offset")
    if not isinstance(name, str) or not name or len(name) > 256:
        raise _bad("group_name must be a short non-empty string", "body.init_info.group_name")
    return address, port, rank, world, name, float(timeout)


def _only_init(info: dict, known: set[str]) -> None:
    unknown = sorted(set(info) - known)
    if unknown:
        raise _bad(
            f"unknown fields {unknown} (the broadcast backend takes {sorted(known)})", f"body.init_info.{unknown[0]}"
        )
