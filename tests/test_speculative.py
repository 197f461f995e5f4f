"""Speculative decoding (``engine.speculative``, strop.serving.speculative): drafts from the prompt's other
responses change how many tokens a forward pass yields, never which tokens or their logprobs."""

import asyncio
import random

import pytest
import torch

from strop.serving.embedded import EmbeddedEngine
from strop.serving.speculative import DraftIndex, Speculator
from strop.types import SamplingParams
from tests.tiny import make_tiny_model, make_tiny_qwen3

PROMPTS = [[412, 9031, 77, 15, 2204, 388, 6001, 45, 902, 13, 31], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [99, 100, 101]]


def peaked(model, scale: float):
    """``model`` with its output layer scaled by ``scale``: below 1 a random tiny model samples more freely at
    temperature 1 (fewer drafts stand), above 1 from fewer likely tokens."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return make_tiny_model()  # it mostly repeats a token: drafts stand


@pytest.fixture(scope="module")
def flatter():
    torch.manual_seed(0)
    return peaked(make_tiny_model(), 0.6)  # it samples more freely: most drafts fall


def engine(model, **kw):
    return EmbeddedEngine(model, pad_token_id=0, default_stop_token_ids=[2], **kw)


def run(e, requests):
    async def go():
        return await asyncio.gather(*(e.generate(p, s) for p, s in requests))

    return asyncio.run(go())


def requests(temperature, seeds, n=4, max_new_tokens=40):
    """A GRPO-like batch: each prompt ``n`` times (siblings), each with its seed (None: the engine's)."""
    rs = random.Random(sum(s or 0 for s in seeds))
    out = []
    for p in PROMPTS:
        for i in range(n):
            seed = seeds[i % len(seeds)]
            out.append(
                (
                    p,
                    SamplingParams(
                        temperature=temperature,
                        max_new_tokens=max(2, max_new_tokens - rs.randrange(8)),
                        seed=None if seed is None else seed + len(out),
                        stop_token_ids=[-1],
                    ),
                )
            )
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.0])
@pytest.mark.parametrize("seeds", [[11], [3, 4], [None]], ids=["seeded", "two-seeds", "engine-seed"])
def test_tokens_and_logprobs_are_bitwise_those_without_speculation(llama, temperature, seeds, monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: True)  # every round drafts (not only faster ones)
    reqs = requests(temperature, seeds)
    plain = run(engine(llama, batch_invariant=True, seed=5), reqs)
    spec_engine = engine(llama, speculative=4, seed=5)
    spec = run(spec_engine, reqs)
    stats = spec_engine.take_speculation_stats()
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.finish_reason == b.finish_reason
    assert stats["spec_draft_rounds_fraction"] > 0.5  # (rounds where no row found a draft decode one token)
    assert 0.2 < stats["spec_acceptance_rate"] and stats["spec_tokens_per_forward"] > 1.2


@pytest.mark.parametrize("seeds", [[11], [None]], ids=["seeded", "engine-seed"])
def test_drafts_that_fall_leave_no_trace(flatter, seeds, monkeypatch):
    """Most drafts are rejected here: their cache columns are overwritten by the next round."""
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: True)
    reqs = requests(1.0, seeds)
    plain = run(engine(flatter, batch_invariant=True, seed=2), reqs)
    e = engine(flatter, speculative=4, seed=2)
    assert [(c.token_ids, c.logprobs) for c in run(e, reqs)] == [(c.token_ids, c.logprobs) for c in plain]
    stats = e.take_speculation_stats()
    assert 0.0 < stats["spec_acceptance_rate"] < 0.9 and stats["spec_draft_rounds_fraction"] > 0.1


def test_a_second_rollout_of_the_same_prompts_drafts_from_the_first(llama, monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: True)
    reqs = requests(0.0, [1])
    e = engine(llama, speculative=4)
    run(e, reqs)
    first = e.take_speculation_stats()
    again = run(e, reqs)
    second = e.take_speculation_stats()
    assert second["spec_tokens_per_forward"] > first["spec_tokens_per_forward"]
    assert second["spec_acceptance_rate"] > 0.9  # greedy and the same weights: the earlier answers are the answers
    assert [c.token_ids for c in again] == [c.token_ids for c in run(engine(llama, batch_invariant=True), reqs)]


def test_qwen3_and_rows_joining_mid_rollout_stay_exact(monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: True)
    torch.manual_seed(1)
    model = peaked(make_tiny_qwen3(), 40.0)
    reqs = requests(1.0, [7], n=3, max_new_tokens=24)
    plain = run(engine(model, batch_invariant=True, max_batch_size=4), reqs)
    spec = run(engine(model, speculative=3, max_batch_size=4), reqs)  # 9 requests through 4 rows: rows join
    assert [(c.token_ids, c.logprobs) for c in plain] == [(c.token_ids, c.logprobs) for c in spec]


def test_a_draft_index_proposes_what_followed_the_longest_matching_suffix():
    index = DraftIndex([1, 2, 3])
    a, b = [7, 8, 9, 10, 11], []
    index.follow(a)
    index.follow(b)
    assert index.draft(b, 4) == []  # nothing after the prompt's end yet
    b += [8, 9]
    assert index.draft(b, 2) == [10, 11]  # (8, 9) was followed by 10, 11 in its sibling
    b += [10, 11]
    assert index.draft(b, 3) == []  # its sibling ends there; its own end is not a draft
    a += [12, 13]
    assert index.draft(b, 3) == [12, 13]
    assert index.draft(b, 0) == []


def test_drafts_are_cut_to_the_rows_budget(llama):
    e = engine(llama, speculative=8)
    reqs = [(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[-1])) for n in (1, 2, 5, 9)]
    out = run(e, reqs)
    assert [len(c.token_ids) for c in out] == [1, 2, 5, 9]
    assert [c.token_ids for c in out] == [c.token_ids for c in run(engine(llama, batch_invariant=True), reqs)]


def test_drafting_is_switched_off_where_it_measures_slower():
    spec = Speculator(4)
    assert spec._choose(4)  # unmeasured: drafts first
    spec.cost[4] = [0.01, 0.03]  # a drafting round costs 3 plain ones here
    spec.yield_ = 2.5  # and yields 2.5 tokens a row
    picks = [spec._choose(4) for _ in range(32)]
    assert picks.count(True) == 2  # only the rounds that measure it again
    spec.yield_ = 3.5
    assert [spec._choose(4) for _ in range(15)].count(True) >= 14
    assert not Speculator(4)._choose(64) and Speculator(4).width(32) == 1 and Speculator(4).width(8) == 4
    assert Speculator(16).width(4) == 15  # (a drafting round computes at most DRAFT_ROWS rows)


def test_rounds_that_do_not_draft_are_one_token_per_row(llama, monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: False)  # measured slower everywhere
    e = engine(llama, speculative=2)
    reqs = requests(1.0, [9], n=2, max_new_tokens=24)  # (long enough for drafts to be found)
    assert [c.token_ids for c in run(e, reqs)] == [c.token_ids for c in run(engine(llama, batch_invariant=True), reqs)]
    stats = e.take_speculation_stats()
    assert stats["spec_tokens_per_forward"] == 1.0 and stats["spec_draft_rounds_fraction"] == 0.0
    assert e.take_speculation_stats() == {}  # counters start again


def outputs(completions):
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in completions]


def test_a_batch_too_big_to_draft_decodes_as_the_engine_without_speculation(llama):
    """36 rows at once: one drafted token each would pass DRAFT_ROWS, so the busy period runs the default kernels
    (no batch-invariant cost) and its tokens and logprobs are those of the engine without speculation."""
    reqs = requests(1.0, [11], n=12)
    assert len(reqs) == 36 and not Speculator(4).drafts_at(36) and Speculator(4).drafts_at(32)
    e = engine(llama, speculative=4, seed=5)
    spec = outputs(run(e, reqs))
    assert spec == outputs(run(engine(llama, seed=5), reqs))
    assert spec != outputs(run(engine(llama, batch_invariant=True, seed=5), reqs))  # (the kernels differ here)
    stats = e.take_speculation_stats()
    assert stats["spec_tokens_per_forward"] == 1.0 and stats["spec_draft_rounds_fraction"] == 0.0
    assert "more than 32 rows decodes without it" in e.decode_path


def test_each_busy_period_chooses_again_and_batch_invariance_asked_for_holds_in_all(llama, monkeypatch):
    monkeypatch.setattr(Speculator, "_choose", lambda self, bucket: True)  # the small period drafts every round
    big, small = requests(1.0, [11], n=12), requests(1.0, [4], n=3)
    e = engine(llama, speculative=4, seed=5)
    got = [outputs(run(e, reqs)) for reqs in (big, small, big)]
    assert got[1] == outputs(run(engine(llama, batch_invariant=True, seed=5), small))
    assert got[0] == got[2] == outputs(run(engine(llama, seed=5), big))
    assert e.take_speculation_stats()["spec_draft_rounds_fraction"] > 0  # (the small period drafted)
    exact = engine(llama, speculative=4, batch_invariant=True, seed=5)
    invariant = engine(llama, batch_invariant=True, seed=5)
    for reqs in (big, small):
        assert outputs(run(exact, reqs)) == outputs(run(invariant, reqs))
