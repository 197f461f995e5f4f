"""strop.parallel.dims.ParallelDims: every layout refusal fires with its message; the sizes, the sharded flag and
the named mesh (dp, cp) or (dp, tp) it builds."""

import pytest

from strop.config import build_config
from strop.parallel.dims import ParallelDims


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(world=3, cp=2), "parallel.context_parallel_size=2 needs a multiple of 2 processes, got 3"),
        (
            dict(world=1, tp=2),
            r"parallel.tensor_parallel_size=2 needs a multiple of 2 processes, got 1 \(run with --nproc N\)",
        ),
        (dict(world=4, cp=2, tp=2), "tensor parallel with context parallel is not supported: use one of them"),
        (dict(world=2, dp_mode="zero3"), "parallel.dp_mode must be 'replicate' or 'fsdp', got 'zero3'"),
    ],
)
def test_a_layout_that_does_not_divide_or_compose_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_the_sizes_come_from_the_config_section_and_the_world():
    cfg = build_config(overrides={"parallel": {"tensor_parallel_size": 2, "dp_mode": "fsdp"}})
    dims = ParallelDims.from_config(cfg.parallel, 8)
    assert (dims.world, dims.dp, dims.cp, dims.tp, dims.sharded) == (8, 4, 1, 2, True)
    assert ParallelDims.from_config(cfg.parallel.model_copy(update={"tensor_parallel_size": 1}), 1).sharded is False
    assert ParallelDims(2).sharded is False and ParallelDims(2, dp_mode="fsdp").sharded


def test_a_model_whose_heads_do_not_divide_is_refused_by_the_dims():
    from transformers import LlamaConfig

    llama = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    ParallelDims(3, tp=3).check_model(llama)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's 9 attention heads"):
        ParallelDims(2, tp=2).check_model(llama)


def test_the_mesh_is_named_and_covers_every_process():
    import torch.distributed as dist
    from torch.distributed import HashStore

    assert ParallelDims().build_mesh() is None  # no process group: one process, no mesh
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        assert ParallelDims(1).build_mesh().mesh_dim_names == ("dp", "cp")
        with pytest.raises(
            ValueError,
            match=r"data parallel \(1\) x context parallel \(2\) x tensor parallel \(1\) "
            "must cover all 1 processes",
        ):
            ParallelDims(2, cp=2).build_mesh()
    finally:
        dist.destroy_process_group()
