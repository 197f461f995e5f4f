"""Data parallel (replicate mode) on 2 gloo processes equals one process: loss, grad norm, update."""

import math

import pytest
import torch

from strop.parallel.launch import run_on_ranks
from tests.distributed import BACKEND, rank_device

ALGOS = {
    "grpo": {},
    "ppo": {"estimator": "ppo", "kl_in_reward_coef": 0.01},
    "seq_mean_kl": {"loss_agg": "seq_mean_token_mean", "kl_coef": 0.1},
    "icepop_opsm": {"off_policy_correction": "icepop", "opsm_delta": 0.01},
    "dppo": {"policy_loss": "dppo", "dppo_mask_low": 1e-8, "dppo_mask_high": 1e-8, "overlong_buffer": 4},
    "distill": {"distill_teacher": "tiny seed 1", "distill_coef": 0.5},
}  # (the tests pass the teacher module)


def teacher_for(algo_name):
    """on-policy distillation's teacher for ``algo_name`` (another random tiny model), or None"""
    from tests.tiny import make_tiny_model

    return make_tiny_model(seed=1) if "distill_teacher" in ALGOS.get(algo_name, {}) else None


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _strategy(rank, world, mode, bucket_bytes=1 << 30):
    """The data-parallel strategy of ``world`` ranks (one process when 1) on this rank's device."""
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy

    device = rank_device(rank, world)
    if world == 1:
        return SingleProcess(device)
    dims = ParallelDims(world, dp_mode=mode, bucket_bytes=bucket_bytes)
    return make_strategy(dims, dims.build_mesh(torch.device(device).type), device)


def _step(rank, world, algo_name, packed, mode="replicate", shared=False):
    from strop.config import AlgoConfig, TrainConfig
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples, near_policy
    from tests.tiny import make_tiny_model

    teacher = teacher_for(algo_name)
    model = make_tiny_model()
    samples = make_samples(10)
    if shared:  # groups with one prompt each: rows share it (train.shared_prefix)
        from tests.test_shared_prefix import grouped_samples

        samples = grouped_samples()
    if algo_name in ("icepop_opsm", "dppo"):  # the corrections act on rollout logprobs near the model's own
        samples = near_policy(model, samples)
    train = TrainConfig(
        lr=1e-3,
        warmup_steps=0,
        micro_batch_size=3,
        max_tokens_per_micro_batch=20 if packed else None,
        shared_prefix=shared,
    )
    trainer = Trainer(
        model,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(**ALGOS[algo_name]),
        rollout=Sampling(max_new_tokens=8),
        parallel=_strategy(rank, world, mode, bucket_bytes=1 << 20),
        teacher=teacher,
    )
    metrics = trainer.step(samples)
    grads = [_full(trainer.optimizer.state[p]["exp_avg"]).cpu() for p in trainer.optimizer.param_groups[0]["params"]]
    params = [_full(p.detach()).cpu() for p in trainer.model.parameters()]
    trainer.full_weights()  # the full-weights gather is a collective: every rank joins
    return metrics, grads, params


# the first three algorithms in every layout and mode; the later ones (their losses differ from GRPO's only
# in per-token terms the layouts do not touch) in two of the four, so both layouts and both modes are seen
_EVERY = ("grpo", "ppo", "seq_mean_kl")
DP_CASES = [
    (a, p, m)
    for a in sorted(ALGOS)
    for p in (False, True)
    for m in ("replicate", "fsdp")
    if a in _EVERY or (p, m) in ((False, "replicate"), (True, "fsdp"))
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "algo,packed,mode", DP_CASES, ids=[f"{a}-{'packed' if p else 'padded'}-{m}" for a, p, m in DP_CASES]
)
def test_two_ranks_equal_one_process(algo, packed, mode):
    assert_same_update(
        run_on_ranks(_step, 2, algo, packed, mode, timeout=150, backend=BACKEND), _step(0, 1, algo, packed)
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo,mode", [("grpo", "replicate"), ("ppo", "fsdp"), ("seq_mean_kl", "fsdp")])
def test_two_ranks_equal_one_process_with_shared_prefix_rows(algo, mode):
    """Each rank forwards its micro-batches' groups as shared-prefix rows; the update is one process's
    (itself checked equal to the padded path in tests/test_shared_prefix.py)."""
    assert_same_update(
        run_on_ranks(_step, 2, algo, False, mode, True, timeout=150, backend=BACKEND),
        _step(0, 1, algo, False, shared=True),
    )


def assert_same_update(results, single, grad_tol=1e-5):
    """Every rank's (metrics, grads, params) equals one process's: loss, grad norm and updated
    parameters within 1e-5, gradients (AdamW's exp_avg) within ``grad_tol`` of each tensor's
    largest entry; and every rank holds the same weights after the step."""
    single_metrics, single_grads, single_params = single
    for metrics, grads, params in results:
        assert math.isclose(metrics["loss"], single_metrics["loss"], rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(metrics["grad_norm"], single_metrics["grad_norm"], rel_tol=1e-5)
        assert metrics["trained_samples"] == single_metrics["trained_samples"]
        for g, ref in zip(grads, single_grads):
            assert (g - ref).abs().max().item() <= grad_tol * ref.abs().max().item() + 1e-12
        for p, ref, g_ref in zip(params, single_params, single_grads):
            # AdamW moves each parameter by ~lr * g / (|g| + 1e-8), whatever |g| is: an entry whose gradient
            # is at the kernels' noise level (~1e-9 on some CPUs; its sign can flip between layouts that sum
            # in another order) moves by up to lr either way. Entries whose gradient the check above pins
            # down (well above the tolerance) must agree to 1e-5; the rest only within one step's size.
            firm = g_ref.abs() > 10 * grad_tol * g_ref.abs().max() + 1e-7
            assert (p - ref)[firm].abs().max().item() <= 1e-5 if firm.any() else True
            assert (p - ref).abs().max().item() <= 5e-3
    for other in results[1:]:
        for a, b in zip(results[0][2], other[2]):
            assert torch.equal(a, b)


def _param_bytes(rank, world, mode):
    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.fsdp import local_parameter_bytes
    from strop.train.trainer import Trainer
    from tests.tiny import make_tiny_model

    algo = AlgoConfig(estimator="ppo", kl_coef=0.1)  # policy + reference + critic
    trainer = Trainer(
        make_tiny_model(), pad_token_id=0, train=TrainConfig(), algo=algo, parallel=_strategy(rank, world, mode)
    )
    parts = {
        "policy": local_parameter_bytes(trainer.model),
        "reference": local_parameter_bytes(trainer.ref),
        "critic": local_parameter_bytes(trainer.critic),
    }
    return parts


@pytest.mark.timeout(120)
def test_fsdp_shards_policy_reference_and_critic():
    replicate = run_on_ranks(_param_bytes, 2, "replicate", timeout=100, backend=BACKEND)
    fsdp = run_on_ranks(_param_bytes, 2, "fsdp", timeout=100, backend=BACKEND)
    for rank in range(2):
        for part in ("policy", "reference", "critic"):
            ratio = fsdp[rank][part] / replicate[rank][part]
            assert 0.45 <= ratio <= 0.55, (rank, part, ratio)  # each rank holds about half of each model
    print(
        "\nper-rank parameter bytes (replicate -> fsdp):",
        {p: (replicate[0][p], fsdp[0][p]) for p in ("policy", "reference", "critic")},
    )
