"""Routed experts (Qwen3-MoE) in the fast decoder (strop.serving.moe): the same tokens as the model's own forward,
logprobs within 1e-5 of a full forward, and each token's recorded experts equal to the model's router on the full
sequence, for every token and layer."""

import asyncio

import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.types import SamplingParams
from tests.tiny import make_tiny_qwen3_moe

PROMPTS = [[5, 17, 230, 9, 5, 17], [44, 45, 46], [7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def moe():
    return make_tiny_qwen3_moe(seed=3)


def engine(model, **kw):
    return EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], **kw)


def router_view(model, prompt, completion):
    """The model's own forward over the prompt and response: logprobs of the response tokens at temperature 1,
    and the experts its routers chose for every token but the last (tokens, MoE layers, top_k)."""
    seq = torch.tensor([prompt + completion.token_ids[:-1]])
    chosen = []
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda mod, args, out: chosen.append(out[2]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "gate")
    ]
    try:
        with torch.no_grad():
            logits = model(seq).logits[0, len(prompt) - 1 :].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    return lp, torch.stack(chosen, dim=1).to(torch.int16)


def test_greedy_tokens_are_the_models_own_on_the_fast_path(moe):
    e = engine(moe)
    assert e.decode_path.startswith("kv-cache decoder") and e._fast.routed == 2
    outs = e.generate_batch(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[-1]))
    for prompt, out in zip(PROMPTS, outs):
        hf = moe.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.token_ids == hf[0, len(prompt) :].tolist()


def test_sampled_rows_joining_and_sharing_a_prompt_record_the_routers_choice_for_every_token(moe):
    e = engine(moe, max_batch_size=3)  # 9 rows through 3 slots: rows join mid-batch; each prompt 3 times
    reqs = [
        (p, SamplingParams(temperature=1.0, max_new_tokens=6 + 2 * i, seed=10 * k + i, stop_token_ids=[-1]))
        for k, p in enumerate(PROMPTS)
        for i in range(3)
    ]

    async def go():
        return await asyncio.gather(*(e.generate(p, s) for p, s in reqs))

    outs = asyncio.run(go())
    checked = 0
    for (prompt, _), out in zip(reqs, outs):
        lp, routes = router_view(moe, prompt, out)
        torch.testing.assert_close(torch.tensor(out.logprobs), lp, rtol=0, atol=1e-5)
        assert out.routed_experts.dtype == torch.int16
        assert out.routed_experts.shape == (len(prompt) + len(out.token_ids) - 1, 2, 2)
        assert torch.equal(out.routed_experts, routes)  # every token, every layer, in the router's order
        checked += routes.numel()
    assert checked > 200


def test_the_routes_follow_a_weight_update_in_place(moe):
    import copy

    model = copy.deepcopy(moe)
    e = engine(model)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[-1])
    before = e.generate_batch(PROMPTS[:1], sp)[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.copy_(-layer.mlp.gate.weight)  # every router now prefers the other experts
    after = e.generate_batch(PROMPTS[:1], sp)[0]
    _, routes = router_view(model, PROMPTS[0], after)
    assert torch.equal(after.routed_experts, routes)
    assert not torch.equal(after.routed_experts[: len(PROMPTS[0])], before.routed_experts[: len(PROMPTS[0])])


def test_a_dense_layer_among_routed_ones_and_a_dense_model_record_accordingly(moe, tiny_model):
    torch.manual_seed(0)
    from transformers import Qwen3MoeForCausalLM

    cfg = copy_config(moe.config, mlp_only_layers=[0])
    mixed = Qwen3MoeForCausalLM(cfg).float()
    e = engine(mixed)
    out = e.generate_batch(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[-1]))[0]
    hf = mixed.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.token_ids == hf[0, len(PROMPTS[0]) :].tolist() and e._fast.routed == 1
    assert torch.equal(out.routed_experts, router_view(mixed, PROMPTS[0], out)[1])
    dense = engine(tiny_model).generate_batch(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert dense.routed_experts is None


def copy_config(config, **changes):
    import copy

    cfg = copy.deepcopy(config)
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


@pytest.mark.parametrize("kw", [{"batch_invariant": True}, {"speculative": 2}])
def test_batch_invariance_and_speculation_are_refused_for_routed_experts(moe, kw):
    with pytest.raises(ValueError, match="not built for routed-expert \\(MoE\\) models yet"):
        engine(moe, **kw)


def test_a_tiny_moe_trains_on_rollouts_from_the_fast_decoder(tmp_path, tokenizer):
    """Two RL steps of a Qwen3-MoE: the embedded engine decodes on the fast path from the trainer's own weights,
    and the rollout's logprobs are the trainer's within 1e-5 (routes agree: fp32, same weights)."""
    import json

    from strop.config import build_config
    from strop.loop import train
    from tests.test_e2e import tiny_overrides

    path = tmp_path / "moe"
    make_tiny_qwen3_moe().save_pretrained(path)
    tokenizer.save_pretrained(path)
    run = tmp_path / "run"
    train(build_config(overrides=tiny_overrides(path, run, rollout={"seed": 2})))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train_rollout_logprob_abs_diff" in r]
    assert len(steps) == 2 and all(r["train_rollout_logprob_abs_diff"] < 1e-5 for r in steps)
    assert "kv-cache decoder" in (run / "run.log").read_text()


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped-mm", "per-expert"])
def test_the_dispatch_computes_the_models_sparse_block(moe, grouped, monkeypatch):
    from strop.serving import moe as moe_module

    monkeypatch.setattr(moe_module, "GROUPED", grouped and moe_module.GROUPED)
    block = moe.model.layers[1].mlp
    h = torch.randn(2, 13, moe.config.hidden_size)
    out, chosen = moe_module.RoutedExperts(block)(h)
    with torch.no_grad():
        want = block(h)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    assert chosen.shape == (2, 13, 2) and len({tuple(c) for c in chosen.reshape(-1, 2).tolist()}) > 1
