"""Reading weights a bucket at a time (strop.wire.weights): the streamed safetensors file, buckets, subsets."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file

from strop.wire.digest import state_checksum
from strop.wire.weights import Subset, in_buckets, write_safetensors


class Counting(dict):
    """A state dict that counts gathers, as sharded weights would make them."""

    reads: list

    def gather(self, names):
        self.reads.append(list(names))
        return {n: self[n] for n in names}


def _state():
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(7, 3, generator=g)
    return Counting(
        {
            "b.weight": torch.randn(4, 5, generator=g).to(torch.bfloat16),
            "a.bias": torch.randn(5, generator=g),
            "emb.weight": shared,
            "head.weight": shared,
            "count": torch.arange(6, dtype=torch.int64),
            "empty": torch.zeros(0, 2),
        }
    )


def test_the_streamed_file_is_a_safetensors_file_of_every_tensor(tmp_path):
    state = _state()
    state.reads = []
    checksum = write_safetensors(state, tmp_path / "m.safetensors", bucket_bytes=64)
    back = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(back) == sorted(state)  # tied names each written
    assert all(torch.equal(back[n], state[n]) and back[n].dtype == state[n].dtype for n in state)
    assert checksum == state_checksum(state)
    raw = (tmp_path / "m.safetensors").read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    assert size % 8 == 0 and json.loads(raw[8 : 8 + size])["__metadata__"] == {"format": "pt"}
    # read in name order, at most 64 bytes a bucket unless a tensor is larger on its own
    assert [n for r in state.reads for n in r] == sorted(state)
    assert all(len(r) == 1 or sum(state[n].numel() * state[n].element_size() for n in r) <= 64 for r in state.reads)
    assert len(state.reads) > 2


def test_buckets_keep_order_and_bound_and_a_subset_reads_only_its_names():
    state = _state()
    state.reads = []
    names = list(state)
    parts = list(in_buckets(state, names, 100))
    assert [n for p in parts for n in p] == names
    sizes = [sum(t.numel() * t.element_size() for t in p.values()) for p in parts]
    assert all(s <= 100 or len(p) == 1 for s, p in zip(sizes, parts)) and len(parts) == len(state.reads) > 1
    state.reads = []
    sub = Subset(state, ["count", "a.bias"])
    assert sorted(sub) == ["a.bias", "count"] and len(sub) == 2
    with pytest.raises(KeyError):
        sub["b.weight"]
    write_safetensors(sub, "/dev/null")
    assert sorted(n for r in state.reads for n in r) == ["a.bias", "count"]


def test_a_dtype_safetensors_cannot_hold_is_refused_before_writing(tmp_path):
    with pytest.raises(ValueError, match="x: dtype torch.complex64"):
        write_safetensors({"x": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "m.safetensors")
    assert not (tmp_path / "m.safetensors").exists()


def test_sharded_weights_of_one_process_name_ties_once(tiny_model):
    from strop.parallel.gather import ShardedWeights, whole

    weights = ShardedWeights(tiny_model)
    tied = tiny_model.config.tie_word_embeddings
    names = [n for n, _, _ in weights.manifest()]
    assert ("lm_head.weight" in names) != tied and len(names) == len(weights) - tied
    got = weights.gather(["lm_head.weight", "model.embed_tokens.weight"])
    assert (got["lm_head.weight"] is got["model.embed_tokens.weight"]) == tied
    full = whole(weights)
    assert all(torch.equal(full[n], t) for n, t in tiny_model.state_dict().items())
    assert full["model.norm.weight"].data_ptr() != tiny_model.model.norm.weight.data_ptr()  # copies, not the live ones


class Lying(Counting):
    """Describes every tensor as fp32, whatever it holds."""

    def meta(self, name):
        return torch.float32, tuple(self[name].shape)


def test_a_tensor_read_other_than_described_stops_the_write(tmp_path):
    state = Lying({"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.bfloat16)})
    state.reads = []
    with pytest.raises(RuntimeError, match=r"b: read as torch.bfloat16 \(2,\), described as"):
        write_safetensors(state, tmp_path / "m.safetensors")


def test_sharded_weights_that_miss_a_tensor_leave_the_engine_as_it_was(tiny_model):
    import asyncio
    import copy

    from strop.serving.embedded import EmbeddedEngine

    engine = EmbeddedEngine(copy.deepcopy(tiny_model), pad_token_id=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    given = Counting({k: v + 1 for k, v in tiny_model.state_dict().items() if k != "model.norm.weight"})
    given.reads = []
    with pytest.raises(RuntimeError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
        asyncio.run(engine.update_weights(given, version=1))
    assert not given.reads and all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
