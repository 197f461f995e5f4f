"""Reading blocks of safetensors tensors straight into shards (strop.parallel.loading.SafetensorsFile): equal
to the safetensors library's own slices, for row and column blocks, several read blocks, dtype changes. Loading
a model into shards (load_shards) gives the logits and buffers of from_pretrained: tied and untied embeddings,
rotary tables and Gemma's embedding scale (buffers no file holds), whole or as FSDP2 parameters."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from strop.parallel.loading import SafetensorsFile


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(13, 7, generator=g),
        "b16": torch.randn(9, 5, generator=g).bfloat16(),
        "v": torch.randn(11, generator=g),
        "s": torch.tensor(3.5),
        "i": torch.arange(12).reshape(3, 4),
    }
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    return tmp_path / "m.safetensors", tensors


@pytest.mark.parametrize(
    "key,start,shape,dtype",
    [
        ("w", (0, 0), (13, 7), torch.float32),
        ("w", (7, 0), (6, 7), torch.float32),  # whole rows: read in place
        ("w", (0, 4), (13, 3), torch.float32),
        ("w", (5, 2), (4, 3), torch.float64),  # a column block, through a buffer
        ("b16", (3, 0), (6, 5), torch.float32),
        ("b16", (0, 0), (9, 5), torch.bfloat16),  # bf16 file: cast, or not
        ("v", (6,), (5,), torch.float32),
        ("s", (), (), torch.float32),
        ("i", (1, 1), (2, 3), torch.int64),
    ],
)
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
    save_file(
        {"c": torch.zeros(2, 2, dtype=torch.float8_e4m3fn), "t": torch.zeros(4, 3, 2)}, tmp_path / "m.safetensors"
    )
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


@pytest.mark.parametrize(
    "weights,ref_mode,match",
    [
        (False, "copy", "a model on the meta device needs weights_path"),
        (True, "swap", "ref_mode='swap' cannot swap into sharded weights"),
    ],
)
def test_a_model_on_the_meta_device_without_files_or_with_a_swapped_reference_is_refused(
    tiny_model, tmp_path, weights, ref_mode, match
):
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import meta_model
    from strop.parallel.strategy import SingleProcess
    from strop.train.modules import build_modules

    tiny_model.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=match):
        build_modules(
            meta_model(str(tmp_path / "m")),
            SingleProcess(),
            AlgoConfig(kl_coef=0.1, ref_mode=ref_mode),
            TrainConfig(),
            weights_path=str(tmp_path / "m") if weights else None,
        )


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


def _tiny(kind: str):
    """Tiny random models: Llama with tied embeddings, Qwen3 with untied ones, Gemma (tied) whose embedding
    scale sqrt(hidden) is a buffer no file holds."""
    from tests.tiny import make_tiny_model, make_tiny_qwen3

    if kind == "llama-tied":
        return make_tiny_model(vocab_size=256)
    if kind == "qwen3-untied":
        return make_tiny_qwen3(vocab_size=256)
    from transformers import GemmaConfig, GemmaForCausalLM

    torch.manual_seed(0)
    model = GemmaForCausalLM(
        GemmaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=256,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (Gemma's norms scale by 1 + weight, which starts at 0)
                p.uniform_(-0.5, 0.5)
    return model


KINDS = ["llama-tied", "qwen3-untied", "gemma"]
TOKENS = torch.randint(3, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def _reference(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return ref(TOKENS).logits, dict(ref.named_buffers())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_loading_into_shards_gives_the_logits_and_buffers_of_from_pretrained(kind, dtype, tmp_path):
    from strop.models import meta_model
    from strop.parallel.loading import load_shards, unloadable

    _tiny(kind).save_pretrained(tmp_path / "m")
    logits, buffers = _reference(tmp_path / "m", dtype)
    model = meta_model(str(tmp_path / "m"), dtype=dtype)
    assert unloadable(model, tmp_path / "m") is None
    load_shards(model, tmp_path / "m", "cpu")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (kind != "qwen3-untied")
    loaded = dict(model.named_buffers())
    assert loaded.keys() == buffers.keys() and len(buffers) >= 2  # (the rotary tables, Gemma's scale)
    for name, b in buffers.items():
        assert loaded[name].dtype == b.dtype and torch.equal(loaded[name], b), name
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, logits)


def _fsdp_logits(rank, world, path):
    """One rank: the policy built on the meta device, wrapped by FSDP2 (DTensor parameters: loading makes new
    parameter objects) and loaded by the trainer's own path; its logits."""
    from strop.config import AlgoConfig, TrainConfig
    from strop.models import meta_model
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import FullyShard
    from strop.train.modules import build_modules

    dims = ParallelDims(world, dp_mode="fsdp")
    out = build_modules(
        meta_model(path), FullyShard(dims, dims.build_mesh()), AlgoConfig(), TrainConfig(), weights_path=path
    )
    out.policy.unshard()  # (the root's parameters, gathered: the layers gather their own when called)
    with torch.no_grad():
        logits = out.model(TOKENS).logits
    return logits, {k: v.clone() for k, v in out.model.named_buffers()}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("kind", KINDS)
def test_loading_into_fsdp_shards_on_one_rank_gives_the_logits_of_from_pretrained(kind, tmp_path):
    from strop.parallel.launch import run_on_ranks

    _tiny(kind).save_pretrained(tmp_path / "m")
    logits, buffers = _reference(tmp_path / "m")
    [(got, got_buffers)] = run_on_ranks(_fsdp_logits, 1, str(tmp_path / "m"), timeout=180)
    assert got_buffers.keys() == buffers.keys() and all(torch.equal(got_buffers[k], b) for k, b in buffers.items())
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-6)


def test_a_stored_buffer_is_read_and_one_nothing_computes_is_refused_by_name(tmp_path):
    """A persistent buffer the files hold is read from them; a buffer that neither the files hold nor the
    model's own initialisation computes is named (by unloadable, and by load_shards) instead of left garbage."""
    from strop.models import meta_model
    from strop.parallel.loading import load_shards, unloadable

    model = _tiny("llama-tied")
    model.model.register_buffer("offsets", torch.arange(5.0) * 3)  # persistent: save_pretrained stores it
    model.save_pretrained(tmp_path / "m")

    def skeleton(extra: bool):
        meta = meta_model(str(tmp_path / "m"))
        meta.model.register_buffer("offsets", torch.empty(5, device="meta"))
        if extra:
            meta.model.layers[1].mlp.register_buffer("window", torch.empty(3, device="meta"), persistent=False)
        return meta

    meta = skeleton(False)
    assert unloadable(meta, tmp_path / "m") is None
    load_shards(meta, tmp_path / "m", "cpu")
    assert torch.equal(meta.model.offsets, torch.tensor([0.0, 3.0, 6.0, 9.0, 12.0]))
    meta = skeleton(True)
    why = "buffer 'model.layers.1.mlp.window' is not in the files and the model's own initialisation does not compute"
    assert why in unloadable(meta, tmp_path / "m")
    with pytest.raises(ValueError, match=why):
        load_shards(meta, tmp_path / "m", "cpu")


def test_two_conversions_of_the_embedded_model_finishing_together_keep_the_first_whole(tmp_path):
    """Two processes converting the embedded model at once (two test workers, two runs started together):
    the one that finishes second drops its copy and never removes the folder the first put in place
    (a reader may hold it); an incomplete folder left by a killed conversion is replaced."""
    from strop.models import _install_converted

    def converted(name, marker):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(marker)
        (path / "model.safetensors").write_text(marker)
        return path

    target = tmp_path / "smollm2"
    _install_converted(converted(".convert-a", "a"), target)  # the first: moved into place
    held = (target / "model.safetensors").open()  # a reader of the first conversion
    second = converted(".convert-b", "b")
    _install_converted(second, target)
    assert (target / "config.json").read_text() == "a" and held.read() == "a"
    held.close()
    shutil.rmtree(second)

    incomplete = tmp_path / "left"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("half")  # no weights: a conversion killed midway
    _install_converted(converted(".convert-c", "c"), incomplete)
    assert (incomplete / "model.safetensors").read_text() == "c"
