"""Routing replay (strop.train.routing_replay): the trainer's forward takes the engine's experts, with gate weights
and gradients from its live router."""

import copy

import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.train.routing_replay import RoutingReplay, routers
from strop.types import SamplingParams
from tests.tiny import make_tiny_qwen3_moe


def chosen_by(model, ids, replay=None, routes=None):
    """The experts every router used in a forward of ``ids`` (tokens, layers, top_k), and the logits."""
    seen = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in routers(model)]
    ctx = replay.replaying(routes) if replay is not None else torch.no_grad()
    try:
        with ctx:
            logits = model(ids).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1), logits


def test_with_replay_the_trainer_routes_every_token_as_the_engine_did_after_the_weights_moved():
    engine_model = make_tiny_qwen3_moe(seed=5)
    trainer_model = copy.deepcopy(engine_model)
    with torch.no_grad():  # the trainer's weights moved since the rollout (an off-policy step)
        for p in trainer_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = EmbeddedEngine(engine_model, pad_token_id=0).generate_batch(
        [[5, 17, 230, 9, 5, 17]], SamplingParams(temperature=1.0, max_new_tokens=24, seed=3, stop_token_ids=[-1])
    )[0]
    ids = torch.tensor([[5, 17, 230, 9, 5, 17] + out.token_ids[:-1]])
    live, _ = chosen_by(trainer_model, ids)
    replay = RoutingReplay(trainer_model)
    assert not torch.equal(live.to(torch.int16), out.routed_experts)  # the live router disagrees somewhere
    replayed, _ = chosen_by(trainer_model, ids, replay, out.routed_experts.unsqueeze(0))
    assert torch.equal(replayed.to(torch.int16), out.routed_experts)  # 100 % of tokens and layers
    metrics = replay.take_metrics()
    assert 0 < metrics["routing_disagreement"] < 1 and {
        "routing_disagreement_layer0",
        "routing_disagreement_layer1",
    } <= set(metrics)
    assert replay.take_metrics() == {}  # counted anew


def test_a_replayed_expert_the_live_top_k_would_not_pick_gets_weight_and_gradient():
    model = make_tiny_qwen3_moe(seed=1)
    replay = RoutingReplay(model)
    ids = torch.tensor([[7, 8, 9, 10]])
    live, _ = chosen_by(model, ids)
    n_experts = model.config.num_experts
    # for every token and layer the experts the live router ranks last: none of them in its top-k
    unpicked = torch.stack(
        [torch.tensor([e for e in range(n_experts) if e not in row][:2]) for row in live.reshape(-1, 2).tolist()]
    ).reshape(live.shape)
    model.zero_grad()
    with replay.replaying(unpicked.unsqueeze(0)):
        logits = model(ids).logits
    logits.float().pow(2).mean().backward()
    router = routers(model)[0]
    for expert in unpicked[:, 0].unique().tolist():
        assert router.weight.grad[expert].abs().sum() > 0  # the gradient reaches the replayed expert's router row
    used = model.model.layers[0].mlp.experts.gate_up_proj.grad
    assert all(used[e].abs().sum() > 0 for e in unpicked[:, 0].unique().tolist())
    assert replay.take_metrics()["routing_disagreement"] == 1.0  # every replayed decision differs from the live one


def test_tokens_without_routes_keep_the_live_choice_and_wrong_shapes_are_refused():
    model = make_tiny_qwen3_moe(seed=2)
    replay = RoutingReplay(model)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    live, want = chosen_by(model, ids)
    none = torch.full((1, 5, 2, 2), -1, dtype=torch.int16)
    same, got = chosen_by(model, ids, replay, none)
    assert torch.equal(same, live) and torch.allclose(got, want, atol=1e-6)
    assert replay.take_metrics() == {}
    with pytest.raises(ValueError, match="routes for 3 routed-experts layers, but the model has 2"):
        with replay.replaying(torch.zeros(1, 5, 3, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="routes for 4 tokens, but the router saw 5"):
        chosen_by(model, ids, replay, torch.zeros(1, 4, 2, 2, dtype=torch.int16))


# ---- the trainer replays the engine's routes: every layout, a two-turn sample, a resume across an update ----


def _perturbed(model, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model


def _rollout(engine_model):
    """Samples from the real embedded engine: a group of three, a two-turn sample (the multi-turn generate's
    bookkeeping: the tool's tokens appended, the next turn prompted with every token so far) beside a plain one,
    and a sample resumed after a weight update (rollout.partial=resume) beside one sampled after it."""
    import asyncio

    from strop.types import Sample, Status

    engine = EmbeddedEngine(engine_model, pad_token_id=0)
    sp = lambda n, seed: SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed, stop_token_ids=[-1])  # noqa: E731
    out = []
    p0, p1, p2 = [5, 17, 230, 9], [44, 45, 46, 47, 48], [300, 301, 302]
    for i, c in enumerate(engine.generate_batch([p0] * 3, [sp(8, i) for i in range(3)])):
        out.append(Sample(prompt="a", prompt_ids=list(p0), group_id=0, index=i))
        out[-1].apply_completion(c)
    turns, plain = (
        Sample(prompt="b", prompt_ids=list(p1), group_id=1),
        Sample(prompt="b", prompt_ids=list(p1), group_id=1, index=1),
    )
    turns.apply_completion(engine.generate_batch([p1], sp(5, 7))[0])
    turns.append([40, 41, 42], trainable=False)  # a tool's answer
    prompt = turns.prompt_ids + turns.response_ids
    second = engine.generate_batch([prompt], sp(5, 8))[0]
    turns.append(second.token_ids, second.logprobs)
    turns.take_routes(second.routed_experts, prompt + second.token_ids)
    plain.apply_completion(engine.generate_batch([p1], sp(9, 9))[0])
    out += [turns, plain]
    resumed = Sample(prompt="c", prompt_ids=list(p2), group_id=2)
    resumed.apply_completion(engine.generate_batch([p2], sp(4, 10))[0])
    before = resumed.routed_experts.clone()
    asyncio.run(engine.update_weights(_perturbed(copy.deepcopy(engine_model), 0.05, 1).state_dict()))
    resumed.apply_completion(engine.generate_batch([resumed.prompt_ids + resumed.response_ids], sp(4, 11))[0])
    after_update = Sample(prompt="c", prompt_ids=list(p2), group_id=2, index=1)
    after_update.apply_completion(engine.generate_batch([p2], sp(6, 12))[0])
    out += [resumed, after_update]
    # the resumed sample's routes are its last call's, one forward on the new weights (they moved: not the first's)
    assert not torch.equal(resumed.routed_experts[: len(before)], before)
    for s in out:  # no advantage is zero: every sample's update forward runs
        s.status, s.reward = Status.COMPLETED, float(s.index == 0)
    assert (turns.routed_experts[:-1] >= 0).all() and (turns.routed_experts[-1] == -1).all()
    return out, engine_model


def _used(model, forwards_of):
    """Run ``forwards_of()`` and return, per sequence of tokens, the experts every layer used for each of its tokens
    in each forward, read from the experts' own inputs and the rows' position ids (layout-blind: a padded row, a
    packed row whose sequences restart at position 0, a shared row whose samples continue after their prefix)."""
    layers, calls, choices = routers(model), [], []
    blocks = [m.experts for m in model.modules() if getattr(m, "gate", None) in layers]
    hooks = [b.register_forward_pre_hook(lambda m, args: choices.append(args[1].detach().clone())) for b in blocks]
    backbone = model.model

    def seen(m, args, kwargs):
        calls.append((kwargs["input_ids"].clone(), kwargs["attention_mask"], kwargs["position_ids"].clone()))

    hooks.append(backbone.register_forward_pre_hook(seen, with_kwargs=True))
    try:
        forwards_of()
    finally:
        for h in hooks:
            h.remove()
    n = len(layers)
    used: dict[tuple, list[torch.Tensor]] = {}
    for f, (ids, att, pos) in enumerate(calls):
        B, L = ids.shape
        ch = torch.stack(choices[f * n : (f + 1) * n], dim=1).reshape(B, L, n, -1)
        for b in range(B):
            cols = att[b].nonzero().flatten().tolist() if att is not None and att.dim() == 2 else list(range(L))
            head = None
            runs, start = [], cols[0]
            for prev, c in zip(cols, cols[1:] + [None]):
                if c is None or pos[b, c] != pos[b, prev] + 1:
                    runs.append((start, prev + 1))
                    start = c
            for a, z in runs:
                toks, got = ids[b, a:z].tolist(), ch[b, a:z]
                if int(pos[b, a]) == 0:
                    head = (toks, got)
                else:  # a shared row: the prefix's columns are this sample's first tokens
                    S = int(pos[b, a])
                    toks, got = head[0][:S] + toks, torch.cat([head[1][:S], got])
                used.setdefault(tuple(toks), []).append(got)
    return used


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_a_training_step_routes_every_token_of_every_layout_as_the_engine_did(layout):
    from strop.algo.config import AlgoConfig
    from strop.parallel.strategy import SingleProcess
    from strop.train.config import TrainConfig
    from strop.train.trainer import Sampling, Trainer

    samples, engine_model = _rollout(make_tiny_qwen3_moe(seed=5))
    assert len({tuple(s.prompt_ids + s.response_ids) for s in samples}) == len(samples)
    train = {
        "padded": dict(shared_prefix=False, micro_batch_size=3),
        "packed": dict(shared_prefix=False, max_tokens_per_micro_batch=48),
        "shared": dict(shared_prefix=True, micro_batch_size=4),
    }[layout]

    def step(replay: bool):
        trainer = Trainer(
            _perturbed(copy.deepcopy(engine_model), 0.05, 2),  # the trainer's weights moved since the rollout
            pad_token_id=0,
            train=TrainConfig(mini_batches=2, **train),  # two optimizer steps: the old-logprob pass runs too
            algo=AlgoConfig(routing_replay=replay),
            rollout=Sampling(max_new_tokens=16),
            parallel=SingleProcess("cpu"),
        )
        metrics = {}
        used = _used(trainer.model, lambda: metrics.update(trainer.step([copy.deepcopy(s) for s in samples])))
        return used, metrics

    def agreement(used):
        same = total = 0
        for s in samples:
            runs = used[tuple(s.prompt_ids + s.response_ids)]
            assert len(runs) >= 2  # the old-logprob pass and the update's forward
            known = (s.routed_experts >= 0).all(-1)
            for got in runs:
                same += int((got.to(torch.int16) == s.routed_experts).all(-1)[known].sum())
                total += int(known.sum())
        return same, total

    used, metrics = step(replay=True)
    same, total = agreement(used)
    assert total > 100 and same == total  # 100 % of the recorded tokens and layers
    assert 0 < metrics["routing_disagreement"] < 1  # the live router would have chosen otherwise
    assert {"routing_disagreement_layer0", "routing_disagreement_layer1"} <= set(metrics)
    used, metrics = step(replay=False)
    same, total = agreement(used)
    # without replay the routes differ, and the step says by how much
    assert same < total and 0 < metrics["routing_disagreement"] < 1


def test_replay_is_refused_where_it_would_not_replay():
    from strop.algo.config import AlgoConfig
    from strop.config import ConfigError, build_config
    from strop.parallel.strategy import SingleProcess
    from strop.train.config import TrainConfig
    from strop.train.trainer import Sampling, Trainer
    from strop.types import Sample, Status
    from tests.tiny import make_tiny_qwen3

    def trainer(model):
        return Trainer(
            model,
            pad_token_id=0,
            train=TrainConfig(),
            algo=AlgoConfig(routing_replay=True),
            rollout=Sampling(max_new_tokens=8),
            parallel=SingleProcess("cpu"),
        )

    with pytest.raises(ValueError, match=r"the model \(qwen3\) has no routed-experts layers"):
        trainer(make_tiny_qwen3())
    t = trainer(make_tiny_qwen3_moe(seed=3))
    bare = Sample(prompt="p", prompt_ids=[5, 6], group_id=4, index=1)  # from an engine that recorded nothing
    bare.append([7, 8], [-0.5, -0.5])
    bare.status, bare.reward = Status.COMPLETED, 1.0
    with pytest.raises(ValueError, match="sample group=4 index=1 carries no routed experts"):
        t.step([bare])
    bare.routed_experts = torch.zeros(4, 3, 2, dtype=torch.int16)  # another model's routes
    with pytest.raises(ValueError, match="routes for 3 routed-experts layers, but the model has 2"):
        t.step([bare])
    for overrides, said in (
        ({"engine": {"kind": "strop", "launch": 1, "fast_decode": False}}, "fast_decode=false decodes with the"),
        ({"parallel": {"context_parallel_size": 2}}, "parallel.context_parallel_size=2 splits a sequence"),
        ({"parallel": {"tensor_parallel_size": 2}}, "parallel.tensor_parallel_size=2 splits a sequence"),
    ):
        with pytest.raises(ConfigError, match=said):
            build_config(overrides={"algo": {"routing_replay": True}, **overrides})


def test_with_replay_the_trainers_logprobs_are_the_engines_within_1e_5_in_fp32():
    from strop.algo.config import AlgoConfig
    from strop.parallel.strategy import SingleProcess
    from strop.train.config import TrainConfig
    from strop.train.trainer import Sampling, Trainer

    model = make_tiny_qwen3_moe(seed=9)
    samples, _ = _rollout(copy.deepcopy(model))  # (the engine's copy is updated in place before group 2)
    samples = [s for s in samples if s.group_id != 2]  # group 2 was sampled on the updated weights
    trainer = Trainer(
        copy.deepcopy(model),
        pad_token_id=0,
        train=TrainConfig(shared_prefix=False),
        algo=AlgoConfig(routing_replay=True),
        rollout=Sampling(max_new_tokens=16),
        parallel=SingleProcess("cpu"),
    )
    with torch.no_grad():
        batch = trainer._collate(samples)
        lp = trainer._logprobs(trainer.policy, batch, replay=True)[0]
    gap = (lp - batch["rollout_logprobs"]).abs()[batch["loss_mask"] > 0]
    assert gap.numel() > 30 and gap.max().item() <= 1e-5


def test_launched_vllm_and_sglang_servers_are_started_returning_routes():
    from strop.cluster.ray_cluster import engine_args
    from strop.config import build_config

    for kind in ("vllm", "sglang"):
        cfg = build_config(
            overrides={
                "engine": {"kind": kind, "launch": 1},
                "cluster": {"launcher": "ray"},
                "algo": {"routing_replay": True},
            }
        )
        assert "--enable-return-routed-experts" in engine_args(cfg, "/tmp/run")[0]
        cfg = build_config(overrides={"engine": {"kind": kind, "launch": 1}, "cluster": {"launcher": "ray"}})
        assert "--enable-return-routed-experts" not in engine_args(cfg, "/tmp/run")[0]
