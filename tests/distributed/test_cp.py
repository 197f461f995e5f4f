"""Context parallel (all-gather, zigzag) on 2 gloo processes equals one process."""

import math

import pytest
import torch

from strop.parallel.context import zigzag_pieces
from strop.parallel.launch import run_on_ranks
from tests.distributed import BACKEND, rank_device
from tests.distributed.test_dp import ALGOS as DP_ALGOS, _full, assert_same_update

# the data-parallel cases, and one more that only context parallel needs: GSPO's sequence
# ratio and an entropy bonus see whole responses gathered across ranks; two optimizer steps
ALGOS = DP_ALGOS | {
    "gspo_entropy_2mini": {"policy_loss": "gspo", "entropy_coef": 0.01, "loss_agg": "seq_mean_token_mean"}
}
MINI_BATCHES = {"gspo_entropy_2mini": 2}
# two AdamW steps turn fp32 rounding of near-zero gradients into parameter differences of
# ~2e-5 (Adam divides by |g|); in fp64 the two layouts agree to 7e-16, so this case runs there
DTYPES = {"gspo_entropy_2mini": torch.float64}


# ---- the layout, no processes needed ------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [0, 1, 3, 7, 8, 17, 64])
def test_zigzag_pieces_cover_every_token_once_and_balance(length, cp):
    held = [sum(zigzag_pieces(length, cp, r), []) for r in range(cp)]
    assert sorted(i for h in held for i in h) == list(range(length))
    sizes = [len(h) for h in held]
    assert max(sizes) - min(sizes) <= 2  # two pieces each, pieces differ by at most one token
    if length >= 2 * cp:
        # rank 0 holds the first and the last piece: the cheapest and the dearest under a causal mask
        assert held[0][0] == 0 and held[0][-1] == length - 1


def _layouts():
    """(segment_ids, position_ids, response_positions, response_mask) for a padded and a packed batch."""
    from strop.parallel.packing import collate_packed
    from strop.train.trainer import collate
    from tests.test_trainer import make_samples

    samples = make_samples(7, seed=5)
    padded = collate(samples, pad_token_id=0)
    am = padded["attention_mask"]
    packed = collate_packed(samples)
    return {
        "padded": (am - 1, (am.cumsum(-1) - 1).clamp(min=0), padded["positions"], padded["response_mask"]),
        "packed": (packed["segment_ids"], packed["position_ids"], packed["positions"], None),
    }


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_plan_masks_and_entries(layout, cp):
    """Every rank's mask, read through its key order, is exactly "earlier or same token of the
    same sequence"; every token and every response entry belongs to exactly one rank."""
    from strop.parallel.context import ContextParallelPlan

    segment_ids, position_ids, positions, response_mask = _layouts()[layout]
    plans = [
        ContextParallelPlan(segment_ids, position_ids, positions, None, response_mask, size=cp, rank=r)
        for r in range(cp)
    ]
    B, L = segment_ids.shape
    T = positions.shape[1]
    held = torch.zeros(B, L, dtype=torch.long)
    for plan in plans:
        keys = torch.cat([p.slot_tokens for p in plans], dim=1)[:, plan.key_order]  # (B, cp*m) piece-major
        for b in range(B):
            for j in range(plan.slot_tokens.shape[1]):
                q = int(plan.slot_tokens[b, j])
                seen = sorted(int(keys[b, k]) for k in plan.attention_mask[b, 0, j].nonzero().flatten())
                if q < 0:
                    assert seen == [-1]  # a filler slot sees itself only
                    continue
                assert seen == [k for k in range(q + 1) if segment_ids[b, k] == segment_ids[b, q]], (b, j, q)
                held[b, q] += 1
    assert torch.equal(held, (segment_ids >= 0).long())  # each real token on exactly one rank, once
    # response entries: each computed one on one rank; the gathered values come back in (b, t) order
    computed = torch.ones(B, T, dtype=torch.bool) if response_mask is None else response_mask > 0
    computed[:, 0] = True
    assert all(p.counts == plans[0].counts for p in plans) and sum(plans[0].counts) == int(computed.sum())
    gathered = torch.cat([p.entry_index for p in plans])  # what each rank contributes, rank-major
    flat = torch.arange(B * T).reshape(B, T)
    assert torch.equal(gathered[plans[0].restore].reshape(B, T), torch.where(computed, flat, flat[:, :1]))


# ---- logprobs and gradients ---------------------------------------------------------------------
def _collated(packed):
    from strop.parallel.packing import collate_packed
    from strop.train.trainer import collate
    from tests.test_trainer import make_samples

    samples = make_samples(6, seed=3)
    return collate_packed(samples) if packed else collate(samples, pad_token_id=0)


def _logprob_grads(rank, world, packed, empty_rank=False, dtype="float32"):
    """Logprobs, entropy and summed-over-CP-ranks gradients of a fixed loss."""
    import torch.distributed as dist

    from strop.parallel import context
    from strop.parallel.packing import unpack
    from strop.train.logprob import response_logprobs
    from tests.tiny import make_tiny_model

    model = make_tiny_model().to(getattr(torch, dtype))
    batch = _collated(packed) if not empty_rank else _long_prompt_batch()
    plan = None
    if world > 1:
        context.enable(model)
        plan = context.ContextParallelPlan.for_batch(batch, dist.group.WORLD)
    lp, ent = response_logprobs(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        batch["positions"],
        position_ids=batch.get("position_ids"),
        with_entropy=True,
        entropy_grad=True,
        chunk_size=7,
        cp=plan,
    )
    if "scatter" in batch:
        lp, ent = unpack(lp, batch), unpack(ent, batch)
    mask = batch["loss_mask"]
    weights = torch.linspace(0.5, 1.5, mask.numel()).reshape(mask.shape)  # a loss that sees every entry
    loss = (lp * weights * mask).sum() + 0.1 * (ent * mask).sum()
    loss.backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    if world > 1:
        for g in grads.values():
            dist.all_reduce(g)
    return lp.detach(), ent.detach(), loss.item(), grads, (plan.counts if plan else None)


def _long_prompt_batch():
    """One sample whose only response token is predicted from the last quarter of the row:
    with cp=2, rank 1 holds the pieces [4, 8) and [8, 12) and no response entry at all."""
    from strop.train.trainer import collate
    from strop.types import Sample, Status

    s = Sample(prompt="p", prompt_ids=list(range(10, 25)), group_id=0, index=0)  # 15 prompt tokens
    s.append([42], [-1.0])
    s.status, s.reward = Status.COMPLETED, 1.0
    return collate([s], pad_token_id=0)


def _assert_close(a, b, tol=1e-5):
    assert (a - b).abs().max().item() <= tol * max(b.abs().max().item(), 1.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-12)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_cp2_logprobs_and_gradients_equal_one_process(packed, dtype, tol):
    """In fp64 the two layouts agree to rounding (1e-12): the math is the same, only the
    order of sums differs (keys in rank-major order, gradients reduce-scattered)."""
    lp1, ent1, loss1, grads1, _ = _logprob_grads(0, 1, packed, False, dtype)
    results = run_on_ranks(_logprob_grads, 2, packed, False, dtype, timeout=90)
    for lp, ent, loss, grads, counts in results:
        assert min(counts) > 0  # both ranks really computed part of the responses
        _assert_close(lp, lp1, tol)
        _assert_close(ent, ent1, tol)
        assert math.isclose(loss, loss1, rel_tol=tol)
        for name, g in grads.items():
            _assert_close(g, grads1[name], tol)


@pytest.mark.timeout(120)
def test_cp2_rank_without_response_tokens_joins_backward():
    """Seed 004: a rank whose chunks hold no response token must still run every collective of
    the backward; otherwise the other rank waits forever in a layer's reduce-scatter."""
    lp1, _, loss1, grads1, _ = _logprob_grads(0, 1, False, True)
    results = run_on_ranks(_logprob_grads, 2, False, True, timeout=90)
    assert results[0][4] == [1, 0]  # rank 1 has no entry
    for lp, _, loss, grads, _ in results:
        _assert_close(lp, lp1)
        assert math.isclose(loss, loss1, rel_tol=1e-5)
        for name, g in grads.items():
            _assert_close(g, grads1[name])
    # rank 1's own gradient is not zero: rank 0's query attends to its keys
    assert any(g.abs().sum() > 0 for g in results[1][3].values())


# ---- the trainer ---------------------------------------------------------------------------------
def _cp_step(rank, world, algo_name, packed, mode="replicate", cp=2, samples=None):
    import torch.distributed as dist

    from strop.config import AlgoConfig, TrainConfig
    from strop.parallel.dims import ParallelDims
    from strop.parallel.strategy import SingleProcess, make_strategy
    from strop.train.trainer import Sampling, Trainer
    from tests.test_trainer import make_samples, near_policy
    from tests.tiny import make_tiny_model

    from tests.distributed.test_dp import teacher_for

    teacher = teacher_for(algo_name)
    model = make_tiny_model().to(DTYPES.get(algo_name, torch.float32))
    if samples is None and algo_name in ("icepop_opsm", "dppo"):  # corrections act on near-policy logprobs
        samples = near_policy(model, make_samples(10))
    train = TrainConfig(
        lr=1e-3,
        warmup_steps=0,
        micro_batch_size=3,
        mini_batches=MINI_BATCHES.get(algo_name, 1),
        max_tokens_per_micro_batch=20 if packed else None,
    )
    device, strategy = rank_device(rank, world), SingleProcess(rank_device(rank, world))
    if world > 1:
        dims = ParallelDims(world, cp=cp, dp_mode=mode, bucket_bytes=1 << 20)
        strategy = make_strategy(dims, dims.build_mesh(torch.device(device).type), device)
    trainer = Trainer(
        model,
        pad_token_id=0,
        train=train,
        algo=AlgoConfig(**ALGOS[algo_name]),
        rollout=Sampling(max_new_tokens=8),
        parallel=strategy,
        teacher=teacher,
    )
    samples = samples or make_samples(10)
    counts = trainer._collate(samples)["cp"].counts if trainer.cp_size > 1 else None
    metrics = trainer.step(samples)
    metrics["entries_per_cp_rank"] = counts
    grads = [_full(trainer.optimizer.state[p]["exp_avg"]).cpu() for p in trainer.optimizer.param_groups[0]["params"]]
    params = [_full(p.detach()).cpu() for p in trainer.model.parameters()]
    if trainer.critic is not None:  # PPO: the value model trained under CP too
        params += [_full(p.detach()).cpu() for p in trainer.critic.parameters()]
    trainer.full_weights()  # a collective under FSDP
    if dist.is_initialized():
        dist.barrier()
    return metrics, grads, params


def _assert_same_update(results, single):
    # fp32: one process runs SDPA's causal kernel, CP masked blocks over keys in another order;
    # single gradient tensors then differ by ~1.5e-5 of their largest entry (the fp64 logprob
    # test above shows the math itself is the same to 1e-12)
    assert_same_update(results, single, grad_tol=5e-5)


# every algorithm in both layouts with replicate; FSDP (sharded over the CP ranks) on a subset
CASES = [(algo, packed, "replicate") for algo in sorted(ALGOS) for packed in (False, True)]
CASES += [("grpo", True, "fsdp"), ("ppo", False, "fsdp"), ("gspo_entropy_2mini", True, "fsdp")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algo,packed,mode", CASES, ids=[f"{a}-{'packed' if p else 'padded'}-{m}" for a, p, m in CASES])
def test_cp2_step_equals_one_process(algo, packed, mode):
    single = _cp_step(0, 1, algo, packed)
    _assert_same_update(run_on_ranks(_cp_step, 2, algo, packed, mode, timeout=150, backend=BACKEND), single)


def _long_prompt_samples():
    """Prompts of 15 tokens and 1-token answers: in every 16-token row the answer is predicted at
    position 14, in the last zigzag piece, which CP rank 0 holds; rank 1 holds no response token."""
    from strop.types import Sample, Status

    out = []
    for i in range(6):
        s = Sample(prompt="p", prompt_ids=[10 + (7 * i + j) % 400 for j in range(15)], group_id=i // 3, index=i % 3)
        s.append([100 + i], [-2.0 - 0.1 * i])
        s.status, s.reward = Status.COMPLETED, float(i % 3 == 0)
        out.append(s)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["replicate", "fsdp"])
def test_cp2_step_with_a_rank_holding_no_response_tokens(mode):
    """Seed 004 at the trainer level: the step finishes on both ranks (a hang fails on the
    timeout) and its update equals one process's."""
    samples = _long_prompt_samples()
    single = _cp_step(0, 1, "grpo", False, samples=samples)
    results = run_on_ranks(_cp_step, 2, "grpo", False, mode, 2, samples, timeout=90, backend=BACKEND)
    assert [r[0]["entries_per_cp_rank"] for r in results] == [[6, 0], [6, 0]]  # every answer on rank 0
    _assert_same_update(results, single)


@pytest.mark.timeout(240)
def test_dp2_cp2_mesh_step_equals_one_process():
    """Four processes as a 2 x 2 (dp, cp) mesh: micro-batches dealt over DP, tokens split over CP;
    two mini-batches, so the old-policy pre-pass is split over DP and reassembled too."""
    single = _cp_step(0, 1, "gspo_entropy_2mini", True)
    _assert_same_update(run_on_ranks(_cp_step, 4, "gspo_entropy_2mini", True, "replicate", 2, timeout=200), single)


def _bf16_logprobs(rank, world):
    """bf16 weights: the additive masks are built in bf16 (finfo.min, no fully masked row)."""
    import torch.distributed as dist

    from strop.parallel import context
    from strop.train.logprob import response_logprobs
    from tests.tiny import make_tiny_model

    model = make_tiny_model().to(torch.bfloat16)
    batch = _collated(False)
    plan = None
    if world > 1:
        context.enable(model)
        plan = context.ContextParallelPlan.for_batch(batch, dist.group.WORLD)
    lp, _ = response_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["positions"], cp=plan)
    (lp * batch["loss_mask"]).sum().backward()
    grad = model.model.layers[0].self_attn.k_proj.weight.grad.float()
    if world > 1:
        dist.all_reduce(grad)
    return lp.detach() * batch["loss_mask"], grad


@pytest.mark.timeout(120)
def test_cp2_bf16_matches_one_process_to_bf16_precision():
    lp1, grad1 = _bf16_logprobs(0, 1)
    for lp, grad in run_on_ranks(_bf16_logprobs, 2, timeout=90):
        assert torch.isfinite(lp).all() and torch.isfinite(grad).all()
        assert (lp - lp1).abs().max().item() <= 0.05 * lp1.abs().max().item()
        assert (grad - grad1).abs().max().item() <= 0.05 * grad1.abs().max().item()
