"""Routed experts on the sample (MoE routing replay): placed by the tokens they belong to through every way a
response grows (a plain call, a resumed call, multi-turn with a re-rendered or cut turn), kept through the samples
file, and laid out as the tokens in every micro-batch layout."""

import asyncio
import json

import pytest
import torch

from strop.data.sources import DataError
from strop.parallel.packing import collate_packed
from strop.parallel.prefix import collate_shared_prefix
from strop.rollout.generate import RolloutContext
from strop.rollout.multiturn import TurnLimits, generate as multiturn
from strop.rollout.samples_file import read_samples, write_header, write_samples
from strop.tools import CALCULATOR, ToolSet
from strop.train.batch import collate
from strop.types import Completion, SampleInvariantError, SamplingParams, Sample, Status

LAYERS, K = 3, 2


def route(prefix: list[int]) -> list[list[int]]:
    """A stand-in for a router: a token's experts are a function of the tokens up to it, as a real one's are."""
    h = sum((i + 1) * t for i, t in enumerate(prefix))
    return [[(h + layer) % 8, (h * 3 + layer + 1) % 8] for layer in range(LAYERS)]


def routes_of(seen: list[int], upto: int) -> torch.Tensor:
    return torch.tensor([route(seen[: p + 1]) for p in range(upto)], dtype=torch.int16).reshape(upto, LAYERS, K)


def completion(prompt, ids, version=0):
    """An engine's answer with its routes, laid out as vLLM's: the prompt and every token but the last."""
    seen = list(prompt) + list(ids)
    return Completion(list(ids), [-0.5] * len(ids), "stop", version, None, routes_of(seen, len(seen) - 1))


def known(s: Sample) -> list[int]:
    """Positions of ``s`` whose routes are known; each must be the router's function of the sample's own tokens."""
    tokens = s.prompt_ids + s.response_ids
    assert len(s.routed_experts) == len(tokens)
    out = [p for p in range(len(tokens)) if (s.routed_experts[p] >= 0).all()]
    for p in out:
        assert s.routed_experts[p].tolist() == route(tokens[: p + 1]), f"position {p} carries another token's route"
    return out


def test_a_call_a_resumed_call_and_a_cut_completion_place_routes_on_their_tokens():
    s = Sample(prompt="p", prompt_ids=[5, 6, 7])
    s.apply_completion(completion([5, 6, 7], [8, 9]))
    assert known(s) == [0, 1, 2, 3]  # the last token was never fed back in
    s.apply_completion(completion([5, 6, 7, 8, 9], [10, 11, 12]))  # resumed (rollout.partial=resume)
    assert known(s) == list(range(7))
    cut = completion([5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16]).cut(2)  # a stop string after two tokens
    assert cut.token_ids == [13, 14] and len(cut.routed_experts) == 10  # 14 was fed back in: its route is known
    s.apply_completion(cut)
    assert known(s) == list(range(10)) and s.total_length == 10
    s.reset_response()
    assert s.routed_experts is None


def test_routes_of_a_call_that_saw_other_tokens_are_refused_or_taken_only_where_they_agree():
    s = Sample(prompt="p", prompt_ids=[5, 6, 7])
    with pytest.raises(SampleInvariantError, match="routes for 6 tokens, but its call had 3 prompt and 2 generated"):
        s.apply_completion(completion([1, 5, 6, 7, 9], [8, 9]))  # a prompt the sample does not hold, unsaid
    s = Sample(prompt="p", prompt_ids=[5, 6, 7])
    s.apply_completion(completion([5, 6, 7], [8, 9]))
    s.append([20, 21], trainable=False)  # an observation
    # the next turn's prompt was rendered again: one token more inside the observation (AReaL's trap: slicing
    # the new routes at the previous length would give every later token its neighbour's route)
    rerendered = [5, 6, 7, 8, 9, 20, 99, 21]
    s.append([30, 31], [-0.1, -0.2])
    s.take_routes(routes_of(rerendered + [30, 31], 9), rerendered + [30, 31])
    assert known(s) == [0, 1, 2, 3, 4, 5]  # up to where the two agree; after it nothing is claimed
    assert (s.routed_experts[6:] == -1).all()


def test_multi_turn_with_a_tool_call_keeps_every_route_on_its_own_token(tokenizer):
    class RoutedEngine:
        def __init__(self, texts):
            self.texts = list(texts)

        async def generate(self, prompt_ids, sampling, affinity=None):
            ids = tokenizer.encode(self.texts.pop(0), add_special_tokens=False)
            return completion(prompt_ids, ids)

    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'
    engine = RoutedEngine([f"Let me compute. {call} and then I ramble on", "The answer is 391.<|im_end|>"])
    ctx = RolloutContext(
        engine=engine, tokenizer=tokenizer, extra={"tools": ToolSet([CALCULATOR]), "turn_limits": TurnLimits()}
    )
    s = Sample(prompt="q", prompt_ids=tokenizer.encode("What is 17 * 23?"))
    s = asyncio.run(multiturn(ctx, s, SamplingParams(max_new_tokens=200)))
    assert s.status == Status.COMPLETED and s.metadata["turns"] == 2
    # the second turn's prefill covers the kept call and the tool's answer: every token but the last is known
    assert known(s) == list(range(s.total_length - 1))


def test_the_samples_file_keeps_the_routes_and_names_a_bad_record(tmp_path):
    s = Sample(prompt="p", prompt_ids=[5, 6, 7], group_id=2)
    s.apply_completion(completion([5, 6, 7], [8, 9]))
    s.reward, s.status = 1.0, Status.COMPLETED
    plain = Sample(prompt="p", prompt_ids=[4], group_id=3)
    plain.append([8], [-0.3])
    plain.reward, plain.status = 0.0, Status.COMPLETED
    path = tmp_path / "samples.jsonl"
    write_header(path, {"temperature": 1.0})
    write_samples(path, [s, plain], step=0)
    _, steps = read_samples(path)
    back, back_plain = steps[0]
    assert torch.equal(back.routed_experts, s.routed_experts) and back.routed_experts.dtype == torch.int16
    assert back_plain.routed_experts is None
    lines = path.read_text().splitlines()
    rec = json.loads(lines[1])
    rec["routed_experts"]["shape"] = [4, LAYERS, K]  # one token short of the sample's five
    path.write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    with pytest.raises(
        DataError, match=r"samples.jsonl:2: .*routed_experts holds 60 bytes, but shape \[4, 3, 2\] needs 48"
    ):
        read_samples(path)
    rec["routed_experts"]["shape"] = [5, LAYERS, K]
    rec["routed_experts"]["int16"] = rec["routed_experts"]["int16"][:-8] + "AAAAAAAA"
    rec["response_ids"] = [8]
    rec["rollout_logprobs"], rec["loss_mask"], rec["weight_versions"] = [-0.5], [1], [0]
    path.write_text("\n".join([lines[0], json.dumps(rec)]) + "\n")
    with pytest.raises(DataError, match=r"samples.jsonl:2: .*routed_experts \(prompt \+ response\) has 2"):
        read_samples(path)


def _group_samples():
    """Two groups; members of group 0 share a prompt and a first response token; one member has no routes."""
    out = []
    for g, (prompt, responses) in enumerate([([5, 6, 7], [[8, 9], [8, 10, 11], [12]]), ([20, 21], [[22], [23, 24]])]):
        for i, r in enumerate(responses):
            s = Sample(prompt="p", prompt_ids=list(prompt), group_id=g, index=i)
            if (g, i) == (1, 1):
                s.append(r, [-0.5] * len(r))  # an engine that recorded nothing for it
            else:
                s.apply_completion(completion(prompt, r))
            s.status, s.reward = Status.COMPLETED, 1.0
            out.append(s)
    return out


def _placed(batch, samples) -> int:
    """Check every column's routes against the router of its own sequence; return how many columns had routes."""
    ids, routes = batch["input_ids"], batch["routes"]
    assert routes.shape[:2] == ids.shape and routes.dtype == torch.int16
    checked = 0
    for row in range(ids.shape[0]):
        for c in range(ids.shape[1]):
            if (routes[row, c] >= 0).all():
                checked += 1
                # the column's sequence: find the sample whose tokens put this token here with this route
                r = routes[row, c].tolist()
                assert any(
                    r == route((s.prompt_ids + s.response_ids)[: p + 1])
                    for s in samples
                    for p in range(s.total_length)
                    if (s.prompt_ids + s.response_ids)[p] == ids[row, c]
                )
            else:
                assert (routes[row, c] == -1).all()
    return checked


@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_every_layout_lays_the_routes_out_as_the_tokens(layout):
    samples = _group_samples()
    batch = {
        "padded": lambda: collate(samples, pad_token_id=0),
        "packed": lambda: collate_packed(samples),
        "shared": lambda: collate_shared_prefix(samples),
    }[layout]()
    recorded = sum(int((s.routed_experts[:, 0, 0] >= 0).sum()) for s in samples if s.routed_experts is not None)
    # a shared row lays group 0's prefix 5 6 7 out once for its three members (group 1 shares nothing: one
    # member has no routes to share)
    assert _placed(batch, samples) == recorded - (2 * 3 if layout == "shared" else 0)


def test_a_shared_row_shares_no_column_whose_members_were_routed_differently():
    a = Sample(prompt="p", prompt_ids=[5, 6, 7], group_id=0, index=0)
    b = Sample(prompt="p", prompt_ids=[5, 6, 7], group_id=0, index=1)
    a.apply_completion(completion([5, 6, 7], [8, 9]))
    b.apply_completion(completion([5, 6, 7], [8, 10]))
    b.routed_experts = b.routed_experts.clone()
    b.routed_experts[1, 2] = torch.tensor(
        [7, 6], dtype=torch.int16
    )  # another engine call, a near tie gone the other way
    batch = collate_shared_prefix([a, b])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 6, 7, 8, 10]]  # only token 5 shared
    assert batch["routes"][0, 5, 2].tolist() == [7, 6]


def test_a_checkpoint_keeps_the_routes_of_the_samples_a_run_holds(tmp_path):
    from strop.checkpoint import _safe_load
    from strop.types import checkpointable

    s = Sample(prompt="p", prompt_ids=[5, 6, 7], group_id=2)
    s.apply_completion(completion([5, 6, 7], [8, 9]))
    torch.save(checkpointable({"held": [s]}, "controller state"), tmp_path / "controller.pt")
    back = _safe_load(tmp_path / "controller.pt")["held"][0]
    assert torch.equal(back.routed_experts, s.routed_experts) and back.routed_experts.dtype == torch.int16


def test_an_agent_sessions_samples_carry_each_calls_routes_on_its_own_tokens():
    from strop.agents.session import Call, Choice, Session, SessionLimits

    session = Session(Sample(prompt="p", prompt_ids=[5, 6, 7]), SamplingParams(), SessionLimits())
    first = [5, 6, 7]
    session.attach(first, Call(first, [Choice(completion(first, [8, 9]))]))
    # the agent's next call: everything so far, then a tool's answer, rendered by the proxy
    second = [5, 6, 7, 8, 9, 20, 21]
    session.attach(second, Call(second, [Choice(completion(second, [30, 31, 32]))]))
    forked = [5, 6, 7, 99]  # a call that does not continue: a fork, a sample of its own
    session.attach(forked, Call(forked, [Choice(completion(forked, [40]))]))
    main, fork = session.samples()
    assert main.response_ids == [8, 9, 20, 21, 30, 31, 32] and fork.prompt_ids == forked
    assert known(main) == list(range(main.total_length - 1))  # the last call's prefill covers the tool's tokens
    assert known(fork) == list(range(fork.total_length - 1))
