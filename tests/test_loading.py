"""Reading blocks of safetensors tensors straight into shards (strop.parallel.loading.SafetensorsFile): equal
to the safetensors library's own slices, for row and column blocks, several read blocks, dtype changes."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from strop.parallel.loading import SafetensorsFile


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(13, 7, generator=g), "b16": torch.randn(9, 5, generator=g).bfloat16(),
               "v": torch.randn(11, generator=g), "s": torch.tensor(3.5), "i": torch.arange(12).reshape(3, 4)}
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    return tmp_path / "m.safetensors", tensors


@pytest.mark.parametrize("key,start,shape,dtype", [
    ("w", (0, 0), (13, 7), torch.float32), ("w", (7, 0), (6, 7), torch.float32),  # whole rows: read in place
    ("w", (0, 4), (13, 3), torch.float32), ("w", (5, 2), (4, 3), torch.float64),  # a column block, through a buffer
    ("b16", (3, 0), (6, 5), torch.float32), ("b16", (0, 0), (9, 5), torch.bfloat16),  # bf16 file: cast, or not
    ("v", (6, ), (5, ), torch.float32), ("s", (), (), torch.float32), ("i", (1, 1), (2, 3), torch.int64)])
@pytest.mark.parametrize("block_bytes", [1 << 20, 40])  # one read, or a read per row or two
def test_a_block_read_into_a_shard_is_the_librarys_slice(stored, key, start, shape, dtype, block_bytes):
    path, tensors = stored
    f = SafetensorsFile(path, block_bytes=block_bytes)
    out = torch.full(shape, -7.0, dtype=dtype) if dtype.is_floating_point else torch.full(shape, -7, dtype=dtype)
    f.read_into(key, start, out, expect=tuple(tensors[key].shape))
    f.close()
    with safe_open(path, "pt") as lib:
        whole = lib.get_tensor(key)
    expected = whole[tuple(slice(s, s + n) for s, n in zip(start, shape))] if shape else whole
    assert torch.equal(out, expected.to(dtype))


def test_a_shape_that_differs_from_the_model_is_named(stored):
    path, _ = stored
    f = SafetensorsFile(path)
    with pytest.raises(ValueError, match=r"'w' has shape \[13, 7\], the model's 'lm.w' \[13, 8\]"):
        f.read_into("w", (0, 0), torch.empty(13, 8), expect=(13, 8), what="lm.w")
    f.close()


def test_a_stored_dtype_it_cannot_read_a_short_file_and_a_split_third_dimension_are_refused(tmp_path):
    save_file({"c": torch.zeros(2, 2, dtype=torch.float8_e4m3fn), "t": torch.zeros(4, 3, 2)}, tmp_path / "m.safetensors")
    f = SafetensorsFile(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="'c' is stored as F8_E4M3, which strop cannot load"):
        f.read_into("c", (0, 0), torch.empty(2, 2), expect=(2, 2))
    with pytest.raises(ValueError, match="only the first two dimensions"):
        f.read_into("t", (0, 0, 1), torch.empty(4, 3, 1), expect=(4, 3, 2))
    f.read_into("t", (2, 0, 0), torch.empty(2, 3, 2), expect=(4, 3, 2))  # (rows of it: fine)
    f.close()
    save_file({"t": torch.zeros(4, 3, 2)}, tmp_path / "one.safetensors")
    (tmp_path / "short.safetensors").write_bytes((tmp_path / "one.safetensors").read_bytes()[:-8])  # 8 bytes lost
    f = SafetensorsFile(tmp_path / "short.safetensors")
    with pytest.raises(ValueError, match=r"'t' ends early \(read 88 of 96 bytes\)"):
        f.read_into("t", (0, 0, 0), torch.empty(4, 3, 2), expect=(4, 3, 2))
    f.close()


@pytest.mark.parametrize("weights,ref_mode,match", [
    (False, "copy", "a model on the meta device needs weights_path"),
    (True, "swap", "ref_mode='swap' cannot swap into sharded weights")])
def test_a_model_on_the_meta_device_without_files_or_with_a_swapped_reference_is_refused(
        tiny_model, tmp_path, weights, ref_mode, match):
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import meta_model
    from strop.train.trainer import Trainer

    tiny_model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=match):
        Trainer(meta_model(str(tmp_path / "m")), pad_token_id=0, train=TrainConfig(),
                algo=AlgoConfig(kl_coef=0.1, ref_mode=ref_mode), weights_path=str(tmp_path / "m") if weights else None)


def _guards(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from strop.parallel.strategy import clip_sharded
    from strop.parallel.tensor import vocab_slice

    mesh = init_device_mesh("cpu", (world,))
    out = []
    try:
        vocab_slice(distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)]))  # split by columns, not vocabulary rows
    except ValueError as exc:
        out.append(str(exc))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Replicate()]))
    p.grad = DTensor.from_local(torch.ones(4, 6), mesh, [Partial()])  # a gradient nobody reduced
    try:
        clip_sharded([p], 1.0)
    except ValueError as exc:
        out.append(str(exc))
    dist.barrier()
    return out


@pytest.mark.timeout(120)
def test_an_output_projection_split_by_columns_and_an_unreduced_gradient_are_refused():
    from strop.parallel.launch import run_on_ranks

    found = run_on_ranks(_guards, 2, timeout=100)
    for messages in found:
        assert len(messages) == 2
        assert "laid out as (Shard(dim=1),)" in messages[0] and "vocabulary split (Shard(0))" in messages[0]
        assert "a gradient with a Partial placement has not been reduced" in messages[1]
