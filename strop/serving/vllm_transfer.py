"""strop's broadcast as a weight-transfer backend of vLLM (``--weight-transfer-config '{"backend": "gloo"}'``):
vLLM's own routes (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) drive it, as they drive vLLM's NCCL backend, over a torch.distributed group of
strop's (gloo on CPU, where vLLM has no backend; NCCL on a GPU). strop serve answers the same routes with
the same fields (:mod:`strop.serving.transfer`), so one client drives both.

``init_info``: ``master_address``, ``master_port``, ``rank_offset``, ``world_size`` (vLLM's NCCL names), and
strop's ``group_name``, ``backend`` (gloo|nccl), ``timeout_s``; each worker joins as rank
``rank_offset + its rank``. ``update_info``: ``names``, ``dtype_names``, ``shapes`` and ``packed`` (one
broadcast of the tensors' bytes concatenated, else one per tensor).

Weights load as vLLM's native transfer loads them: the round opens with ``initialize_layerwise_reload``
and closes with ``finalize_layerwise_reload``, which re-runs each layer's ``process_weights_after_loading``
(on CPU it repacks every linear weight for oneDNN: a plain copy into the parameters would change nothing
the model computes with). Each round's receipt (:class:`strop.serving.receipt.ReceiptSession`: the digest
of every byte received, the tensors written) is read through the worker extension's ``strop_receipt``.

Registered with vLLM's ``WeightTransferEngineFactory`` when :mod:`strop.serving.vllm_worker` is imported
(vLLM imports it into every worker for ``--worker-extension-cls``), before the worker builds its backend.
Imports vLLM at module level: only vLLM's workers import this module.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vllm.config import set_current_vllm_config
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from strop.serving.receipt import ReceiptSession
from strop.wire.buckets import Bucket
from strop.wire.group import close_group, make_group, receive_bucket


@dataclass
class GlooInitInfo:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    names: list
    dtype_names: list
    shapes: list
    packed: bool = False


class StropGlooTransfer(WeightTransferEngine):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.session: ReceiptSession | None = None  # the open round
        self.last: dict | None = None  # the last round's receipt

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        if self.session is not None:
            raise RuntimeError("a weight update is open: finish it before joining a new trainer")
        self.shutdown()
        parallel = self.parallel_config
        rank = int(init_info.rank_offset) + parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = make_group(
            init_info.master_address,
            int(init_info.master_port),
            rank,
            int(init_info.world_size),
            init_info.backend,
            float(init_info.timeout_s),
            name=init_info.group_name,
        )

    def start_weight_update(self) -> None:
        expected = {name for name, _ in self.model.named_parameters()}
        tied = _tied_parameters(self.model)  # read before the round puts every layer's tensors on the meta device
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model)
        self.session = ReceiptSession(expected, tied)

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call /init_weight_transfer_engine first")
        if self.session is None:
            raise RuntimeError("start_weight_update must be called before update_weights")
        info = update_info
        if info.packed:
            buckets = [Bucket.from_payload(info.names, info.dtype_names, info.shapes, "flattened_bucket")]
        else:
            buckets = [
                Bucket.from_payload([n], [d], [s], None) for n, d, s in zip(info.names, info.dtype_names, info.shapes)
            ]
        for bucket in buckets:
            t0 = time.perf_counter()
            tensors = receive_bucket(self.group, bucket, self.device, digest=self.session.digest)
            t1 = time.perf_counter()
            with set_current_vllm_config(self.vllm_config), disable_mtp_completeness_check():  # partial by design
                loaded = self.model.load_weights(tensors)
            self.session.seconds["receive"] += t1 - t0
            self.session.seconds["load"] += time.perf_counter() - t1
            self.session.bucket(loaded, bucket.nbytes)

    def finish_weight_update(self) -> None:
        """Process the loaded layers (a layer nothing was sent for keeps its old tensors); redo a tied layer
        whose source was written (on CPU the packed copy of a tied lm_head would keep the old values)."""
        session, self.session = self.session, None
        if session is None:
            return
        t0 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model, self.model_config)
            for alias, source in session.tied.items():
                layer = self.model.get_submodule(alias.rpartition(".")[0])
                if source in session.loaded and getattr(layer, "quant_method", None) is not None:
                    layer.quant_method.process_weights_after_loading(layer)
        session.seconds["finish"] = time.perf_counter() - t0
        self.last = session.receipt(open_=False)

    def receipt(self) -> dict | None:
        return self.session.receipt(open_=True) if self.session is not None else self.last

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            close_group(group)


def _tied_parameters(model) -> dict[str, str]:
    """Each parameter name that aliases an earlier one, with that one's name (lm_head.weight ->
    model.embed_tokens.weight when the embeddings are tied)."""
    first, tied = {}, {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied[name] = first[id(param)] if id(param) in first else None
        first.setdefault(id(param), name)
    return {alias: source for alias, source in tied.items() if source is not None}
