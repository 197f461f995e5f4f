"""strop's vLLM worker extension: what strop asks of each vLLM worker besides vLLM's own routes.

Loaded into every vLLM worker with ``--worker-extension-cls strop.serving.vllm_worker.StropWorkerExtension``
(vLLM adds it to the worker's bases) and called through ``POST /collective_rpc`` (needs
``VLLM_SERVER_DEV_MODE=1``) by :class:`strop.engines.vllm.VLLMEngine`: ``strop_info`` (the probe: is the
extension there, which transfer backend runs), ``strop_manifest`` (the tensors an update must carry),
``strop_receipt`` (what the last update received) and ``strop_memory``. strop serve answers the same
methods (:mod:`strop.serving.routes_transfer`).

Importing this module also registers strop's broadcast as vLLM's weight-transfer backend ``gloo``
(:mod:`strop.serving.vllm_transfer`; vLLM has no CPU backend of its own), which vLLM's transfer routes
then drive: start the server with ``--weight-transfer-config '{"backend": "gloo"}'``.

Over HTTP, vLLM passes every argument as a string and returns a method's dict or list as JSON (vLLM
0.32: ``vllm/entrypoints/serve/dev/rpc/api_router.py``). A method runs in the worker process, as the
worker: ``self`` is vLLM's worker (``self.model_runner``, ``self.vllm_config``, ``self.device``). On CPU
the worker is a process of its own (the multiprocessing executor), so ``/proc/self`` is the worker's.

Imports at module level: the standard library and strop.serving.receipt only (this runs inside vLLM's
worker; vLLM itself is imported where it is used).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from strop.serving.receipt import no_receipt


class StropWorkerExtension:
    """Methods vLLM adds to its worker for strop (all prefixed ``strop_``: vLLM refuses an extension whose
    names clash with the worker's)."""

    def strop_info(self) -> dict:
        """Who answers: the extension is loaded (the client's probe), and where it runs."""
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "device": str(self.device),
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "transfer_backend": type(getattr(self, "weight_transfer_engine", None)).__name__,
        }

    def strop_manifest(self) -> dict:
        """The tensors the trainer must send: names and shapes from the safetensors headers of the model's
        checkpoint (only the headers are read: on CPU the loaded linear weights are repacked and their
        parameters empty), in the dtype the model runs in. A tied lm_head is dropped, as the trainer's
        manifest drops it: vLLM's model holds one tensor for both."""
        config = self.vllm_config.model_config
        tied = bool(getattr(config.hf_text_config, "tie_word_embeddings", False))
        dtype = str(config.dtype).removeprefix("torch.")
        names, shapes = [], []
        for path in _checkpoint_files(config.model, config.revision, self.vllm_config.load_config.download_dir):
            for name, entry in _safetensors_header(path).items():
                if name == "__metadata__" or (tied and name.startswith("lm_head.")):
                    continue
                names.append(name)
                shapes.append(list(entry["shape"]))
        return {"names": names, "dtypes": [dtype] * len(names), "shapes": shapes}

    def strop_receipt(self) -> dict:
        """The last round's receipt (strop's gloo backend, :mod:`strop.serving.vllm_transfer`): the digest of
        the bytes it received (in order) and whether every model parameter was written (by load_weights'
        own report); a round still open reports ``loaded: false``. ``seconds``: the worker's time in
        receiving, in loading (vLLM's ``load_weights``, which processes each layer once it is complete),
        and in closing the round."""
        backend = getattr(self, "weight_transfer_engine", None)
        receipt = backend.receipt() if hasattr(backend, "receipt") else None
        return receipt or no_receipt()

    def strop_memory(self, reset: str = "0") -> dict:
        """This worker process's resident memory and its peak, in MiB (``/proc/self/status``: VmRSS,
        VmHWM). ``reset="1"``: after reading, restart the peak from the current size (write 5 to
        ``/proc/self/clear_refs``)."""
        status = Path("/proc/self/status").read_text().splitlines()
        kib = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
        out = {"pid": os.getpid(), "rss_mib": kib["VmRSS"] / 1024, "peak_mib": kib["VmHWM"] / 1024}
        if reset.strip().lower() in ("1", "true", "yes"):
            Path("/proc/self/clear_refs").write_text("5")
        return out


def _checkpoint_files(model: str, revision: str | None, download_dir: str | None) -> list[Path]:
    """The safetensors files vLLM loads the model from: those the index names, else every one in the folder
    (a hub id resolves to its local snapshot: vLLM downloaded it at start)."""
    folder = Path(model)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(
            snapshot_download(
                model,
                revision=revision,
                cache_dir=download_dir,
                local_files_only=True,
                allow_patterns=["*.safetensors", "*.safetensors.index.json"],
            )
        )
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"strop_manifest: no safetensors checkpoint in {folder}")
    return files


def _safetensors_header(path: Path) -> dict:
    """A safetensors file's header (8 bytes little-endian length, then JSON): names, dtypes, shapes."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def register_transfer_backend() -> bool:
    """Make strop's broadcast vLLM's weight-transfer backend ``gloo`` (:mod:`strop.serving.vllm_transfer`), in
    this process. vLLM imports this module into each worker (``--worker-extension-cls``) before the worker
    builds its backend. Returns whether vLLM's factory is there (not in strop's own environment)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    if TRANSFER_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            TRANSFER_BACKEND, "strop.serving.vllm_transfer", "StropGlooTransfer"
        )
    return True


TRANSFER_BACKEND = "gloo"
register_transfer_backend()
