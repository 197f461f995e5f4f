"""Expert parallel (strop.parallel.expert) on gloo equals one process: loss, gradient norm and every gradient
after one step, the weights after three AdamW steps, with the experts split over 2 ranks (ep 2) and over a
(edp 2, ep 2) mesh of 4; each rank holds its share of the experts; whole weights for the engine; composed with
routing replay and with a critic and a reference copy (PPO with KL)."""

import pytest

from strop.parallel.launch import run_on_ranks
from tests.distributed.test_dp import ALGOS, _full, assert_same_update


def _ep_step(rank, world, algo_name, ep=1, replay=False, micro=3, mode="replicate"):
    import torch

    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy
    from strop.train.modules import build_modules
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples
    from tests.tiny import make_tiny_qwen3_moe

    strategy = SingleProcess()
    if world > 1:
        dims = ParallelDims(world, dp_mode=mode, bucket_bytes=1 << 20, ep=ep)
        strategy = make_strategy(dims, dims.build_mesh("cpu"))
    train = TrainConfig(lr=1e-3, warmup_steps=0, micro_batch_size=micro, shared_prefix=False)
    algo = AlgoConfig(**ALGOS[algo_name], routing_replay=replay)
    trainer = Trainer(
        build_modules(make_tiny_qwen3_moe(seed=2), strategy, algo, train),
        pad_token_id=0,
        train=train,
        algo=algo,
        rollout=Sampling(max_new_tokens=8),
        parallel=strategy,
    )

    def samples(seed):
        out = make_samples(10, seed=seed)
        if replay:  # routes as an engine would record them: a fixed choice per token, the last one unknown
            g = torch.Generator().manual_seed(seed)
            for s in out:
                s.routed_experts = torch.randint(0, 4, (s.total_length, 2, 2), generator=g, dtype=torch.int16)
                s.routed_experts[..., 1] = (s.routed_experts[..., 0] + 1) % 4  # two different experts
                s.routed_experts[-1] = -1
        return out

    metrics = trainer.step(samples(0))
    grads = [
        _full(trainer.optimizer.state[p]["exp_avg"]).cpu().clone() for p in trainer.optimizer.param_groups[0]["params"]
    ]
    for k in (1, 2):
        trainer.step(samples(k))
    params = [_full(p.detach()).cpu() for p in trainer.model.parameters()]
    weights = trainer.full_weights()
    experts = trainer.model.model.layers[0].mlp.experts.gate_up_proj
    local = tuple((experts.to_local() if hasattr(experts, "to_local") else experts).shape)
    return metrics, grads, params, {k: v.shape for k, v in weights.items()}, local


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "algo,replay,micro", [("grpo", False, 3), ("ppo", True, 3), ("seq_mean_kl", False, 4), ("grpo", True, 16)]
)
def test_expert_parallel_2_equals_one_process(algo, replay, micro):
    """Micro-batches of 4 (three of them) and 16 (one): a rank short of one repeats one, weighted 0, so that it
    joins every dispatch (without it the other rank waits for it forever)."""
    results = run_on_ranks(_ep_step, 2, algo, 2, replay, micro, timeout=250)
    single = _ep_step(0, 1, algo, replay=replay, micro=micro)
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert results[0][3] == single[3] and results[1][3] == {}  # rank 0 gathers whole weights, named as before
    assert single[4] == (4, 32, 32) and [r[4] for r in results] == [(2, 32, 32)] * 2  # two experts each


@pytest.mark.timeout(400)
def test_an_edp2_ep2_mesh_equals_one_process():
    """4 ranks: 0-1 and 2-3 each split the experts; 0 and 2 (1 and 3) hold the same ones and sum their gradients.
    (Loading into shards is not tried: transformers converts a Qwen3-MoE's experts at load, so strop loads the
    model whole, then splits it; strop.parallel.loading.unloadable.)"""
    results = run_on_ranks(_ep_step, 4, "grpo", 2, timeout=350)
    single = _ep_step(0, 1, "grpo")
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert [r[4] for r in results] == [(2, 32, 32)] * 4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("algo,replay", [("grpo", True), ("ppo", False)])
def test_fsdp2_times_ep2_equals_one_process(algo, replay):
    """4 ranks under FSDP2: the experts split over ep (0-1, 2-3) and sharded again over edp (0-2, 1-3), every
    other weight sharded over all four; micro-batches of 4 (three: ranks short of one repeat one)."""
    results = run_on_ranks(_ep_step, 4, algo, 2, replay, 4, "fsdp", timeout=350)
    single = _ep_step(0, 1, algo, replay=replay, micro=4)
    assert_same_update([r[:3] for r in results], single[:3], grad_tol=1e-5)
    assert results[0][3] == single[3] and all(r[3] == {} for r in results[1:])
    assert [r[4] for r in results] == [(1, 32, 32)] * 4  # one expert's slice each: 4 experts / ep 2 / edp 2


def test_expert_parallel_is_refused_where_it_is_not_built():
    from strop.parallel.dims import ParallelDims
    from tests.tiny import make_tiny_qwen3, make_tiny_qwen3_moe

    with pytest.raises(ValueError, match="with tensor or context parallel is not built"):
        ParallelDims(4, tp=2, ep=2)
    with pytest.raises(ValueError, match="with tensor or context parallel is not built"):
        ParallelDims(4, cp=2, ep=2)
    with pytest.raises(ValueError, match="needs a multiple of 4 data-parallel processes, got 2"):
        ParallelDims(2, ep=4)
    with pytest.raises(ValueError, match=r"the model \(qwen3\) has no routed experts"):
        ParallelDims(2, ep=2).check_model(make_tiny_qwen3().config)
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        ParallelDims(3, ep=3).check_model(make_tiny_qwen3_moe().config)
