"""Split one module over the run's mesh before the trainer sees it (torchtitan's ``parallelize_llama``):
tensor parallel over the mesh's ``tp`` dimension first, then FSDP2 over the data-parallel ranks (all ranks, or
the ``dp`` dimension of a (dp, tp) mesh). Context parallel changes no weights: its attention is switched on in
the model (:func:`strop.parallel.context.enable`) before the reference and critic are copied from it
(:func:`strop.train.modules.build_modules`), so each copy has it too."""

from __future__ import annotations

from torch import nn

from strop.parallel.dims import ParallelDims
from strop.parallel.expert import expert_modules, expert_parallel, shard_experts
from strop.parallel.fsdp import mixed_precision_policy, shard
from strop.parallel.tensor import tensor_parallel


def parallelize(module: nn.Module, dims: ParallelDims, mesh, device_type: str = "cpu", expert_mesh=None) -> nn.Module:
    """Split ``module`` in place as ``dims`` says over ``mesh`` (:meth:`ParallelDims.build_mesh`), its experts over
    ``expert_mesh`` (:meth:`ParallelDims.build_expert_mesh`); returns it. Without a mesh (one process:
    strop.parallel.strategy.SingleProcess) it stays whole."""
    if mesh is None:
        return module
    if expert_mesh is not None and expert_modules(module):  # (a critic's backbone has them too)
        expert_parallel(module, expert_mesh, fsdp=dims.dp_mode == "fsdp")
    if dims.tp > 1:
        tensor_parallel(module, mesh["tp"], dims.sequence_parallel)
    if dims.dp_mode == "fsdp":  # over every rank, or over the data-parallel dimension of a (dp, tp) mesh
        if expert_mesh is not None:
            shard_experts(module, expert_mesh, mixed_precision_policy(dims.fsdp_mixed_precision))
        shard(
            module,
            device_type=device_type,
            mixed_precision=dims.fsdp_mixed_precision,
            mesh=mesh["dp"] if dims.tp > 1 else None,
        )
    return module
