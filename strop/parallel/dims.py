"""The layout of a run's processes, in one object: :class:`ParallelDims` (torchtitan's ``ParallelDims``).

Built from the ``parallel`` config section and the number of processes, it holds every layout rule (what must
divide what, which model types tensor parallel can split, what does not compose) and builds the named device
mesh the strategy (:mod:`strop.parallel.strategy`) and :func:`strop.parallel.parallelize.parallelize` read
their groups from. Ranks are laid out row-major: the context- or tensor-parallel ranks of one data-parallel
rank are neighbours (0-1, 2-3, ...: on one node under any launcher that numbers a node's ranks together), and
rank 0, the controller, is DP 0 of every dimension. Config-only rules (those that need no process count) are
the config's (strop.config).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from strop.parallel.collectives import DEFAULT_BUCKET_BYTES

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # model types with a tensor-parallel plan (strop.parallel.tensor)


def parallel_layout(world: int, context_parallel_size: int, tensor_parallel_size: int = 1) -> tuple[int, int]:
    """(data-parallel size, context-parallel size) for ``world`` processes, or a ValueError that says why not."""
    cp, tp = context_parallel_size, tensor_parallel_size
    hint = " (run with --nproc N)" if world == 1 else ""
    if world % cp:
        raise ValueError(f"parallel.context_parallel_size={cp} needs a multiple of {cp} processes, got {world}{hint}")
    if world % tp:
        raise ValueError(f"parallel.tensor_parallel_size={tp} needs a multiple of {tp} processes, got {world}{hint}")
    return world // (cp * tp), cp


def check_tensor_parallel(config, size: int) -> None:
    """A ValueError naming what does not divide (or the model type) when ``config`` (a transformers config)
    cannot be split over ``size`` ranks; nothing is loaded to find out."""
    if size == 1:
        return
    kind = getattr(config, "model_type", type(config).__name__)
    if kind not in SUPPORTED:
        raise ValueError(
            f"parallel.tensor_parallel_size={size}: model type {kind!r} has no tensor-parallel plan "
            f"in strop (supported: {', '.join(SUPPORTED)})"
        )
    heads = config.num_attention_heads
    counts = {
        "attention heads": heads,
        "KV heads": getattr(config, "num_key_value_heads", None) or heads,
        "MLP width (intermediate_size)": config.intermediate_size,
    }
    bad = [f"{n} {name}" for name, n in counts.items() if n % size]
    if bad:
        raise ValueError(
            f"parallel.tensor_parallel_size={size} must divide the model's {' and '.join(bad)} "
            f"({kind}): choose a size that divides {', '.join(str(n) for n in counts.values())}"
        )


@dataclass(frozen=True)
class ParallelDims:
    """``world`` processes as data parallel x context parallel (``cp``) x tensor parallel (``tp``), refused at
    construction when they do not divide or do not compose; with how the data-parallel dimension holds the
    weights (``dp_mode``), tensor parallel's ``sequence_parallel``, FSDP's ``fsdp_mixed_precision`` and the
    gradient all-reduce's ``bucket_bytes``."""

    world: int = 1
    cp: int = 1
    tp: int = 1
    dp_mode: str = "replicate"
    sequence_parallel: bool = True
    fsdp_mixed_precision: bool = False
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ep: int = 1  # expert parallel: ranks of the data-parallel ones that split each layer's experts

    def __post_init__(self):
        parallel_layout(self.world, self.cp, self.tp)
        if self.tp > 1 and self.cp > 1:
            raise ValueError("tensor parallel with context parallel is not supported: use one of them")
        if self.ep > 1 and self.world > 1 and (self.tp > 1 or self.cp > 1):
            raise ValueError(
                "parallel.expert_parallel_size > 1 with tensor or context parallel is not built: each splits a "
                "sequence or a layer, expert parallel the experts over the data-parallel ranks"
            )
        if self.ep > 1 and self.dp % self.ep:
            raise ValueError(
                f"parallel.expert_parallel_size={self.ep} needs a multiple of {self.ep} data-parallel processes, "
                f"got {self.dp}"
            )
        if self.world > 1 and self.dp_mode not in ("fsdp", "replicate"):
            raise ValueError(f"parallel.dp_mode must be 'replicate' or 'fsdp', got {self.dp_mode!r}")

    @classmethod
    def from_config(
        cls, parallel, world: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> "ParallelDims":
        """The dims of the ``parallel`` section (ParallelConfig) over ``world`` processes (default: this
        process group's, or 1 without one); ``bucket_bytes``: the resolved all-reduce budget
        (strop.parallel.collectives.resolve_bucket_bytes)."""
        if world is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
        return cls(
            world,
            parallel.context_parallel_size,
            parallel.tensor_parallel_size,
            parallel.dp_mode,
            parallel.sequence_parallel,
            parallel.fsdp_mixed_precision,
            bucket_bytes,
            parallel.expert_parallel_size,
        )

    @property
    def dp(self) -> int:
        """The data-parallel size: the processes that see other micro-batches."""
        return self.world // (self.cp * self.tp)

    @property
    def sharded(self) -> bool:
        """Whether the trainer's weights are split over ranks (FSDP over several ranks, tensor or expert parallel)."""
        return self.world > 1 and (self.dp_mode == "fsdp" or self.tp > 1 or self.ep > 1)

    def check_model(self, config) -> None:
        """Refuse a model (its transformers config) that tensor parallel cannot split over ``tp`` ranks, or whose
        experts expert parallel cannot split over ``ep``."""
        from strop.parallel.expert import check_experts

        check_tensor_parallel(config, self.tp)
        check_experts(config, self.ep)

    def build_mesh(self, device_type: str = "cpu"):
        """The named device mesh over this process group: (dp, tp) under tensor parallel, else (dp, cp); None
        without a process group. A collective: every rank calls it, in the same order."""
        if not dist.is_initialized():
            return None
        if self.world != dist.get_world_size():
            raise ValueError(
                f"data parallel ({self.dp}) x context parallel ({self.cp}) x tensor parallel "
                f"({self.tp}) must cover all {dist.get_world_size()} processes"
            )
        if self.tp > 1:
            return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        return init_device_mesh(device_type, (self.dp, self.cp), mesh_dim_names=("dp", "cp"))

    def build_expert_mesh(self, device_type: str = "cpu"):
        """Expert parallel's (edp, ep) mesh over the data-parallel ranks (strop.parallel.expert); None without
        it. A collective, as :meth:`build_mesh`."""
        if self.ep == 1 or not dist.is_initialized():
            return None
        return init_device_mesh(device_type, (self.dp // self.ep, self.ep), mesh_dim_names=("edp", "ep"))
