"""Tensor parallel (DTensor, strop.parallel.tensor) on gloo equals one process: loss, gradient norm and every
gradient after one step, the weights after three AdamW steps, alone (tp 2) and on a (dp 2, tp 2) mesh with
replicate or FSDP2; loading into shards; the vocabulary-parallel logprob kernel."""

import pytest

from strop.parallel.launch import run_on_ranks
from tests.distributed.test_dp import ALGOS, _full, assert_same_update


def _model(kind):
    from tests.tiny import make_tiny_model, make_tiny_qwen3, make_tiny_qwen3_moe

    return {"llama": make_tiny_model, "qwen3": make_tiny_qwen3, "qwen3_moe": make_tiny_qwen3_moe}[kind]()


def _tp_step(
    rank, world, algo_name, kind, tp=1, mode="replicate", path=None, checkpointing=False, sequence=True, shared=False
):
    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy
    from strop.train.modules import build_modules
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples

    strategy = SingleProcess()
    if world > 1:
        dims = ParallelDims(world, tp=tp, dp_mode=mode, sequence_parallel=sequence, bucket_bytes=1 << 20)
        strategy = make_strategy(dims, dims.build_mesh("cpu"))
    train = TrainConfig(
        lr=1e-3, warmup_steps=0, micro_batch_size=3, activation_checkpointing=checkpointing, shared_prefix=shared
    )
    if path is not None:  # built on the meta device; each rank reads its own slices of the saved model
        from strop.models import meta_model

        model = meta_model(path)
    else:
        model = _model(kind)
    algo = AlgoConfig(**ALGOS[algo_name])
    trainer = Trainer(
        build_modules(model, strategy, algo, train, weights_path=path),
        pad_token_id=0,
        train=train,
        algo=algo,
        rollout=Sampling(max_new_tokens=8),
        parallel=strategy,
    )
    rows = []  # (tokens in the residual stream after layer 0, tokens after the final norm) per forward
    backbone = trainer.model.model
    backbone.layers[0].register_forward_hook(lambda m, a, out: rows.append([_local(out).shape[1]]))
    backbone.norm.register_forward_hook(lambda m, a, out: rows[-1].append(_local(out).shape[1]))
    if shared:  # groups with one prompt each, their rows sharing it: a (1, 1, L, L) mask, padded for SP
        from tests.test_shared_prefix import grouped_samples

        make_samples = lambda n, seed=0: grouped_samples(seed=seed)  # noqa: E731
    metrics = trainer.step(make_samples(10))
    grads = [
        _full(trainer.optimizer.state[p]["exp_avg"]).cpu().clone()  # (a copy: the next steps change it)
        for p in trainer.optimizer.param_groups[0]["params"]
    ]
    for k in (1, 2):  # parameters compared after three AdamW steps
        trainer.step(make_samples(10, seed=k))
    params = [_full(p.detach()).cpu() for p in trainer.model.parameters()]
    weights = trainer.full_weights()  # a collective: every rank joins, rank 0 keeps the whole weights
    q = trainer.model.model.layers[0].self_attn.q_proj.weight  # (32 rows: 4 heads of 8)
    local = tuple((q.to_local() if hasattr(q, "to_local") else q).shape)  # this rank's rows of q_proj
    return metrics, grads, params, {k: v.shape for k, v in weights.items()}, local, rows


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "kind,algo,sequence,shared",
    [("llama", "seq_mean_kl", True, False), ("qwen3", "grpo", True, True), ("qwen3", "grpo", False, False)],
    ids=["llama-sp", "qwen3-sp-shared-prefix", "qwen3-no-sp"],
)
def test_tensor_parallel_2_equals_one_process(kind, algo, sequence, shared):
    """(PPO: the checkpointing test.) With sequence parallel each rank's residual stream holds half the tokens
    (an odd count padded by one), all of them again after the final norm; without it, all of them throughout.
    Shared-prefix rows: their (1, 1, L, L) mask is padded with the tokens."""
    results = run_on_ranks(_tp_step, 2, algo, kind, 2, "replicate", None, False, sequence, shared, timeout=250)
    single = _tp_step(0, 1, algo, kind, shared=shared)
    rows = results[0][5]
    assert rows == results[1][5] and all(b == (2 * a if sequence else a) for a, b in rows)
    assert rows and (not sequence or any(n % 2 for n, _ in single[5]))  # (one took the padding)
    # the contractions over heads and MLP width are summed in another order (two halves, then all-reduced):
    # gradients agree within 1e-5 of each tensor's largest entry (measured: 5.5e-6 at most; 6e-7 absolute)
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert results[0][3] == single[3] and results[1][3] == {}  # rank 0 gathers whole weights, named as before
    assert single[4] == (32, 32) and [r[4] for r in results] == [(16, 32)] * 2  # each rank holds half the heads


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_a_dp2_tp2_mesh_equals_one_process(mode, tmp_path):
    """4 ranks as (dp 2, tp 2): ranks 0-1 and 2-3 each split the model; FSDP2 shards over dp on top (2-D), and
    there each rank reads only its slices of the saved model (loading into shards on a 2-D mesh)."""
    path = None
    if mode == "fsdp":
        _model("qwen3").save_pretrained(tmp_path / "model")
        path = str(tmp_path / "model")
    results = run_on_ranks(_tp_step, 4, "grpo", "qwen3", 2, mode, path, timeout=350)
    single = _tp_step(0, 1, "grpo", "qwen3")
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert results[0][3] == single[3] and all(r[3] == {} for r in results[1:])
    assert [r[4] for r in results] == [(16, 32) if mode == "replicate" else (8, 32)] * 4  # FSDP halves it again


def _vocab_parallel(rank, world, temperature, chunk):
    import torch
    import torch.distributed as dist

    from strop.train.chunked_logprob import chunked_logprobs, naive_logprobs

    torch.manual_seed(0)
    n, h, v = 7, 5, 11  # 11 rows split 6 / 5, as DTensor splits them
    hidden, weight = torch.randn(n, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    targets = torch.tensor([0, 5, 6, 10, 3, 6, 9])  # on both sides of the split
    a, b = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    rows = torch.arange(v).chunk(world)[rank]
    out = []
    for kind in ("whole", "split"):
        hid = hidden.clone().requires_grad_()
        w = (weight if kind == "whole" else weight[rows]).clone().requires_grad_()
        if kind == "whole":
            lp, ent = naive_logprobs(hid, w, targets, temperature=temperature)
        else:
            lp, ent = chunked_logprobs(
                hid,
                w,
                targets,
                temperature=temperature,
                chunk_size=chunk,
                group=dist.group.WORLD,
                vocab_start=int(rows[0]),
            )
        ((lp * a).sum() + (ent * b).sum()).backward()
        out.append((lp.detach(), ent.detach(), hid.grad, w.grad if kind == "split" else w.grad[rows]))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature,chunk", [(1.0, 3), (0.7, 100)])
def test_vocabulary_parallel_logprobs_equal_the_whole_vocabulary(temperature, chunk):
    """Logprobs, entropy and both gradients of the vocabulary-split kernel on 2 ranks (an uneven split,
    targets on both sides, chunks smaller and larger than N) equal full-vocabulary log_softmax in fp64."""
    import torch

    for whole, split in run_on_ranks(_vocab_parallel, 2, temperature, chunk, timeout=100):
        for x, y in zip(whole, split):
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-12)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind,layout", [("qwen3", "tp2"), ("llama", "dp2-fsdp")])  # 2-D: the mesh test above
def test_loading_into_shards_equals_loading_the_whole_model(kind, layout, tmp_path):
    """The model built on the meta device, split, then each rank reads only its slices from the safetensors
    files (tied embeddings tied again, rotary tables recomputed, PPO's critic and the reference loaded the same
    way): the step equals one process that loaded the whole model."""
    _model(kind).save_pretrained(tmp_path / "model")
    world, tp, mode = {"tp2": (2, 2, "replicate"), "dp2-fsdp-tp2": (4, 2, "fsdp"), "dp2-fsdp": (2, 1, "fsdp")}[layout]
    algo = "ppo" if kind == "qwen3" else "seq_mean_kl"
    results = run_on_ranks(_tp_step, world, algo, kind, tp, mode, str(tmp_path / "model"), timeout=350)
    single = _tp_step(0, 1, algo, kind)
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert results[0][3] == single[3]
    rows = 32 // (world if mode == "fsdp" else tp)
    assert [r[4] for r in results] == [(rows, 32)] * world


@pytest.mark.timeout(300)
def test_activation_checkpointing_under_fsdp_and_tensor_parallel_changes_nothing(tmp_path):
    """Loaded into shards, split by (dp 1, tp 2) with FSDP2 on top, each layer recomputed in backward: the same
    update as one process without any of it."""
    _model("qwen3").save_pretrained(tmp_path / "model")
    results = run_on_ranks(_tp_step, 2, "ppo", "qwen3", 2, "fsdp", str(tmp_path / "model"), True, timeout=250)
    single = _tp_step(0, 1, "ppo", "qwen3")
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)


@pytest.mark.timeout(300)
def test_a_mixture_of_experts_model_trains_under_fsdp_as_in_one_process(tmp_path):
    """Qwen3-MoE (4 experts, 2 per token; some experts get no token in a micro-batch): FSDP2 over 2 ranks
    gives one process's update. Its files store each expert apart while the model holds them fused, so loading
    into shards says why it cannot (and strop train then loads the whole model); tensor parallel refuses it
    by name (no plan for experts); the embedded engine's fast decoder runs it."""
    from transformers import AutoConfig

    from strop.serving import kvdecode
    from strop.models import meta_model
    from strop.parallel.loading import unloadable
    from strop.parallel.dims import check_tensor_parallel

    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path / "model")
    assert "transformers converts them at load" in unloadable(meta_model(str(tmp_path / "model")), tmp_path / "model")
    results = run_on_ranks(_tp_step, 2, "grpo", "qwen3_moe", 1, "fsdp", timeout=250)
    single = _tp_step(0, 1, "grpo", "qwen3_moe")
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    with pytest.raises(ValueError, match="model type 'qwen3_moe' has no tensor-parallel plan"):
        check_tensor_parallel(AutoConfig.from_pretrained(tmp_path / "model"), 2)
    assert kvdecode.unsupported_reason(model) is None  # (the fast decoder runs its routed experts)
