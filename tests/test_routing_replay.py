"""Routing replay (strop.train.routing_replay): the trainer's forward takes the engine's experts, with gate weights
and gradients from its live router."""

import copy

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
    import pytest

    with pytest.raises(ValueError, match="routes for 3 routed-experts layers, but the model has 2"):
        with replay.replaying(torch.zeros(1, 5, 3, 2, dtype=torch.int16)):
            pass
    with pytest.raises(ValueError, match="routes for 4 tokens, but the router saw 5"):
        chosen_by(model, ids, replay, torch.zeros(1, 4, 2, 2, dtype=torch.int16))
