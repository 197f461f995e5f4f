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
