"""Weight sync through disk: each version written once, atomically, and loaded by every engine that serves.

The engines load the file (``/update_weights_from_disk``; vLLM: ``reload_weights``); receipt is the
checksum of the file each engine loaded, where it reports one, and the version it reports."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import torch

from strop.engines.health import HEALTHY
from strop.sync.base import Receipt, WeightSync
from strop.wire.errors import EngineRequestError, EngineUnavailable
from strop.wire.weights import write_safetensors


class WeightWriter:
    """Writes each weight version once, atomically, for engines to load from disk.

    ``dir/v<version>/model.safetensors`` is written under a temporary name and renamed into
    place, so a reader never sees half a file; only the newest ``keep`` versions stay.
    """

    def __init__(self, directory: str | Path, keep: int = 2, bucket_bytes: int = 64 << 20):
        """``bucket_bytes``: the most of the weights read at once while writing (sharded: gathered)."""
        # absolute: servers resolve a relative path against their own folders (strop serve: its --weights-dir)
        self.dir, self.keep, self.bucket_bytes = Path(directory).resolve(), keep, bucket_bytes  # dir: at first write

    def write(
        self,
        state: dict[str, torch.Tensor],
        version: int,
        tag: str = "",
        filename: str = "model.safetensors",
        beside: dict[str, str] | None = None,
    ) -> tuple[Path, str]:
        """Write ``state`` as version ``version`` (``tag`` tells apart several files of one version:
        the delta form writes one per set of changed tensors) into ``filename``, and each text of ``beside``
        (``{file name: text}``) next to it. Returns the folder and the checksum.
        Read a bucket at a time (sharded weights are never gathered whole: strop.wire.weights)."""
        final = self.dir / f"v{version}{tag}"
        tmp = self.dir / f".tmp-v{version}{tag}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)  # (and self.dir with it)
        checksum = write_safetensors(state, tmp / filename, self.bucket_bytes)  # (tied tensors under each name)
        for name, text in (beside or {}).items():
            (tmp / name).write_text(text)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        versions = sorted({int(p.name[1:].split("-")[0]) for p in self.dir.glob("v*")})
        for old in self.dir.glob("v*"):
            if int(old.name[1:].split("-")[0]) in versions[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return final, checksum


class DiskSync(WeightSync):
    """Write the weights once (``writer``), load them into every healthy engine (a failure marks it down);
    each stays healthy only if it then reports the version. An engine that returns lagging loads the
    newest weights before it is re-admitted."""

    def __init__(self, writer: WeightWriter):
        self.writer = writer
        self.latest: tuple[Path, str, int] | None = None  # the current weights on disk: folder, checksum, version

    async def update(self, weights, version: int) -> Receipt:
        pool = self.pool
        path, checksum = await asyncio.to_thread(self.writer.write, weights, version)  # off the event loop
        self.latest, pool.weight_version = (path, checksum, version), version  # together: no await between
        await asyncio.gather(*(self.load(i) for i in pool.members(HEALTHY)))
        return Receipt(version)

    async def load(self, i: int) -> None:
        """Load the current weights into engine ``i``; healthy afterwards only at the version it reports."""
        pool = self.pool
        path, checksum, version = self.latest
        before = pool.state[i]
        try:
            held = await pool.engines[i].load_weights(path, version, checksum)
        except (EngineUnavailable, EngineRequestError) as exc:
            pool.mark_down(i, f"weight load of version {version} failed: {exc}")
            return
        if pool.state[i] == before:  # (a request that failed on it meanwhile leaves it to the health loop)
            pool.move(i, HEALTHY, "loaded the current weights", held)

    async def catch_up(self, i: int) -> bool:
        if self.latest is None:
            return False
        await self.load(i)
        return True
