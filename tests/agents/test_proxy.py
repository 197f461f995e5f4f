"""The agent proxy driven by the real ``openai`` SDK: exact tokens, forks, streaming, backpressure, bad input."""

import json
import threading

import httpx
import openai
import pytest
import torch

from strop.agents.session import SessionLimits
from strop.serving.embedded import EmbeddedEngine
from strop.train.logprob import response_logprobs
from strop.types import Completion, SamplingParams, Status
from tests.agents.stand import ForcedEngine, Stand
from tests.held import HeldStep
from tests.tiny import make_tiny_model

pytestmark = pytest.mark.timeout(120)

CALC = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>'
# as a model may write it: keys in another order, spaces: the template would render it otherwise
MODEL_CALL = '<tool_call> {"arguments": {"expression": "17*23"}, "name": "calculator"} </tool_call>'


@pytest.fixture
def model():
    return make_tiny_model().eval()


@pytest.fixture
def stand_of(tokenizer):
    made = []

    def make(engine, tok=None, **kw):
        made.append(Stand(engine, tok or tokenizer, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def trainer_logprobs(model, sample, temperature=1.0) -> list[float]:
    """What the trainer computes for ``sample``'s response (strop's own logprob path)."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    positions = torch.arange(len(sample.prompt_ids), ids.shape[1])[None]
    with torch.no_grad():
        lp, _ = response_logprobs(model, ids, torch.ones_like(ids), positions, temperature=temperature)
    return lp[0].tolist()


def gap(model, sample, temperature=1.0) -> float:
    lp = trainer_logprobs(model, sample, temperature)
    return max(abs(a - b) for a, b, m in zip(lp, sample.rollout_logprobs, sample.loss_mask) if m)


def three_turns(client, tools=CALC):
    """A 3-turn agent: a tool call, the tool's answer, a user follow-up, the final answer."""
    msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 17*23?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=tools)
    m = first.choices[0].message
    msgs.append(m.model_dump(exclude_none=True))
    if m.tool_calls:
        msgs.append({"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"})
    else:
        msgs.append({"role": "user", "content": "Use the calculator."})
    second = client.chat.completions.create(model="m", messages=msgs, tools=tools)
    msgs.append({"role": "assistant", "content": second.choices[0].message.content})
    msgs.append({"role": "user", "content": "So what is it?"})
    third = client.chat.completions.create(model="m", messages=msgs, tools=tools)
    return msgs, [first, second, third]


def test_sdk_three_turn_tool_agent_records_exact_tokens(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, [f"Let me compute. {MODEL_CALL}", "It is 391.", "The answer is 391."])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs, answers = three_turns(client)
    call = answers[0].choices[0]
    # the model's <tool_call> became an OpenAI tool call
    assert call.finish_reason == "tool_calls" and call.message.content == "Let me compute."
    assert call.message.tool_calls[0].function.name == "calculator"
    assert json.loads(call.message.tool_calls[0].function.arguments) == {"expression": "17*23"}
    assert answers[2].choices[0].message.content == "The answer is 391."
    # the proxy's answers carry the sampled ids (the tool call's turn ends with its call: the end token
    # sampled after it is dropped) and the prompt ids it used
    sampled = [a.choices[0].model_extra["token_ids"] for a in answers]
    assert sampled == [engine.outputs[0][:-1], engine.outputs[1], engine.outputs[2]]
    assert tokenizer.decode(sampled[0]).endswith("</tool_call>")
    assert [a.model_extra["prompt_token_ids"] for a in answers] == engine.prompts
    # every turn's prompt starts with the previous prompt plus exactly what the engine sampled (and kept)
    for k in (1, 2):
        before = engine.prompts[k - 1] + sampled[k - 1]
        assert engine.prompts[k][: len(before)] == before
    (sample,) = stand.end(session)
    assert sample.status == Status.COMPLETED and sample.metadata["segments"] == 1
    assert sample.prompt_ids == engine.prompts[0]
    assert sample.prompt_ids + sample.response_ids == engine.prompts[2] + engine.outputs[2]
    # model tokens train, everything the agent added is masked
    trained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
    assert trained == sampled[0] + sampled[1] + sampled[2]
    masked = tokenizer.decode([t for t, m in zip(sample.response_ids, sample.loss_mask) if not m])
    assert "<tool_response>\n391\n</tool_response>" in masked and "So what is it?" in masked
    assert "17*23" not in masked  # the model's call is its own (trained) tokens, never re-rendered
    assert MODEL_CALL in tokenizer.decode(sample.response_ids)
    # the trainer's logprobs at the recorded positions are the engine's (fp32 noise of a longer
    # sequence); one position off, they are not
    assert gap(model, sample) < 1e-4
    lp = trainer_logprobs(model, sample)
    assert max(abs(a - b) for a, b, m in zip(lp[1:], sample.rollout_logprobs, sample.loss_mask) if m) > 0.1


def test_real_engine_three_turns_keep_the_single_turn_gap(model, tokenizer, stand_of):
    """A sampling engine (the embedded engine on the tiny model): the multi-turn trajectory's
    logprob gap against the trainer is that of a single-turn rollout."""
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=[tokenizer.eos_token_id],
        context_window=256,
        seed=0,
    )
    stand = stand_of(
        engine, limits=SessionLimits(max_calls=8, max_call_tokens=12, max_response_tokens=200, context_window=256)
    )
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    three_turns(client, tools=None)
    (sample,) = stand.end(session)
    assert sample.metadata["segments"] == 1 and sample.metadata["session_calls"] == 3
    single = stand.open()
    one = openai.OpenAI(base_url=stand.proxy.base_url, api_key=single.key, max_retries=0)
    one.chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 17*23?"}])
    (alone,) = stand.end(single)
    multi_gap, single_gap = gap(model, sample), gap(model, alone)
    assert multi_gap < max(4 * single_gap, 1e-5), (multi_gap, single_gap)


def test_an_edited_history_forks_the_trajectory_and_both_segments_train(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, ["Four.", "Let me think again.", "It is 4."])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    a = client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": a.choices[0].message.content}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="m", messages=msgs)
    # the agent compacts its history: the first exchange is rewritten
    edited = [{"role": "user", "content": "2 + 2 = ? (answer briefly)"}]
    client.chat.completions.create(model="m", messages=edited)
    samples = stand.end(session)
    assert len(samples) == 2 and session.forks == 1
    assert [s.metadata["segment"] for s in samples] == [0, 1]
    assert all(s.status == Status.COMPLETED for s in samples)
    first, second = samples
    assert [t for t, m in zip(first.response_ids, first.loss_mask) if m] == engine.outputs[0] + engine.outputs[1]
    assert second.prompt_ids == engine.prompts[2] and second.response_ids == engine.outputs[2]
    assert all(gap(model, s) < 1e-4 for s in samples)


def test_an_unchanged_history_never_forks_even_when_the_client_remakes_ids(model, tokenizer, stand_of):
    """The OpenAI message the agent sends back may differ in form (content None beside tool calls,
    new call ids, arguments re-serialised): the same message, so no fork."""
    engine = ForcedEngine(model, tokenizer, [MODEL_CALL, "391."])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "17*23?"}]
    a = client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    assert a.choices[0].message.content is None and a.choices[0].message.tool_calls
    msgs.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "mine",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression":"17*23"}'},
                }
            ],
        }
    )
    msgs.append({"role": "tool", "tool_call_id": "mine", "content": "391"})
    client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    samples = stand.end(session)
    assert len(samples) == 1 and session.forks == 0


def test_tokens_the_model_sampled_are_kept_even_where_the_tokenizer_would_split_them_otherwise(
    model, tokenizer, stand_of
):
    """ "Four." sampled as single characters: re-tokenising the history would merge them (and fork);
    the recorded ids are kept instead."""
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "Four."]
    assert spelled != tokenizer.encode("Four.", add_special_tokens=False)
    engine = ForcedEngine(model, tokenizer, [spelled, "Yes."])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "2+2?"}]
    r = client.chat.completions.create(model="m", messages=msgs)
    assert r.choices[0].message.content == "Four."
    msgs += [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="m", messages=msgs)
    (sample,) = stand.end(session)
    assert session.forks == 0 and engine.prompts[1][: len(engine.prompts[0]) + 6] == engine.prompts[0] + spelled + [
        tokenizer.eos_token_id
    ]
    assert gap(model, sample) < 1e-4


def test_streaming_yields_the_same_tokens_as_the_plain_call(model, tokenizer, stand_of):
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=[tokenizer.eos_token_id],
        context_window=256,
        seed=0,
    )
    stand = stand_of(engine)
    msgs = [{"role": "user", "content": "Tell me a story."}]
    plain_session, stream_session = stand.open(), stand.open(index=1)
    plain = openai.OpenAI(base_url=stand.proxy.base_url, api_key=plain_session.key, max_retries=0)
    streamed = openai.OpenAI(base_url=stand.proxy.base_url, api_key=stream_session.key, max_retries=0)
    a = plain.chat.completions.create(model="m", messages=msgs, seed=1234, max_tokens=24, logprobs=True)
    text, ids, lps, finish = "", [], [], None
    for chunk in streamed.chat.completions.create(
        model="m", messages=msgs, seed=1234, max_tokens=24, logprobs=True, stream=True
    ):
        for c in chunk.choices:
            text += c.delta.content or ""
            ids += (c.model_extra or {}).get("token_ids") or []
            lps += [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
            finish = c.finish_reason or finish
    assert ids == a.choices[0].model_extra["token_ids"] and len(ids) > 0
    assert text == a.choices[0].message.content
    assert lps == [x.logprob for x in a.choices[0].logprobs.content]
    assert finish == a.choices[0].finish_reason
    other = plain.chat.completions.create(model="m", messages=msgs, seed=99, max_tokens=24)
    assert other.choices[0].model_extra["token_ids"] != ids  # the seed is what made them equal


def test_32_concurrent_sessions_complete_through_429s(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, ["Four."])
    stand = stand_of(engine, max_calls_in_flight=4, retry_after_s=0.05)
    sessions = [stand.open(index=i) for i in range(32)]
    answers, errors = {}, []

    def agent(i, s):
        try:
            client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=s.key, max_retries=50)
            msgs = [{"role": "user", "content": f"What is {i} + {i}?"}]
            r = client.chat.completions.create(model="m", messages=msgs)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "ok"}]
            answers[i] = client.chat.completions.create(model="m", messages=msgs).choices[0].message.content
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(i, s)) for i, s in enumerate(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(answers) == 32
    counts = stand.proxy.take_counts()
    assert counts["agent_calls"] == 64
    assert counts["agent_calls_rejected_busy"] > 0  # 4 at a time: the others were told to retry
    assert all(len(stand.end(s)) == 1 for s in sessions)


def test_a_held_proxy_answers_429_with_retry_after_and_serves_again_later(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]), retry_after_s=2.5)
    session = stand.open()
    body = {"model": "m", "messages": [{"role": "user", "content": "2+2?"}]}
    headers = {"Authorization": f"Bearer {session.key}"}
    url = stand.proxy.base_url + "/chat/completions"
    hold = stand.proxy.hold("weight update")
    stand.loop.run(hold.__aenter__())
    r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and r.headers["retry-after-ms"] == "2500"
    assert "weight update" in r.json()["error"]["message"]
    stand.loop.run(hold.__aexit__(None, None, None))
    r = httpx.post(url, json=body, headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Four."


def test_bad_input_gets_a_4xx_naming_it_and_the_proxy_keeps_serving(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]))
    session, other = stand.open(), stand.open(index=1)
    url = stand.proxy.base_url
    auth = {"Authorization": f"Bearer {session.key}"}
    ok = [{"role": "user", "content": "2+2?"}]

    def post(path, body, headers=auth):
        return httpx.post(url + path, json=body, headers=headers)

    cases = [
        ("/chat/completions", {"messages": [{"content": "no role"}]}, auth, 400, "messages[0].role"),
        ("/chat/completions", {"messages": [{"role": "user", "content": 5}]}, auth, 400, "messages[0].content"),
        ("/chat/completions", {"messages": []}, auth, 400, "non-empty"),
        ("/chat/completions", {"messages": "hello"}, auth, 400, "messages must be"),
        (
            "/chat/completions",
            {
                "messages": ok,
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
                ],
            },
            auth,
            400,
            "not a valid JSON Schema",
        ),
        ("/chat/completions", {"messages": ok, "tools": [{"type": "function"}]}, auth, 400, "tools[0]"),
        (
            "/chat/completions",
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}],
                    }
                ]
            },
            auth,
            400,
            "arguments is not valid JSON",
        ),
        ("/chat/completions", {"messages": ok, "n": 1000}, auth, 400, "n"),
        ("/chat/completions", {"messages": ok, "temperature": -1}, auth, 400, "temperature"),
        ("/chat/completions", {"messages": ok, "tool_choice": "required"}, auth, 400, "tool_choice"),
        ("/chat/completions", {"messages": ok}, {"Authorization": "Bearer nope"}, 401, "unknown API key"),
        ("/chat/completions", {"messages": ok}, {}, 401, "unknown API key"),
        ("/completions", {"prompt": [10**9]}, auth, 400, "token ids"),
        (f"/sessions/{other.id}/reward", {"reward": 1.0}, auth, 403, "another session"),
        ("/sessions/sess_missing/reward", {"reward": 1.0}, auth, 404, "no such session"),
        (f"/sessions/{session.id}/reward", {"reward": "high"}, auth, 400, "reward"),
        (f"/sessions/{session.id}/reward", {"score": 1.0}, auth, 400, ""),
    ]
    for path, body, headers, status, words in cases:
        r = post(path, body, headers)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert words in r.json()["error"]["message"], (words, r.text)
    r = httpx.post(url + "/chat/completions", content=b"{not json", headers=auth | {"content-type": "application/json"})
    assert r.status_code == 400
    # non-finite rewards cannot even be written as JSON numbers: NaN is refused
    r = httpx.post(
        url + f"/sessions/{session.id}/reward",
        content=b'{"reward": NaN}',
        headers=auth | {"content-type": "application/json"},
    )
    assert r.status_code == 400
    # still serving, and the failures did not count as calls of the session
    assert (
        post("/chat/completions", {"model": "m", "messages": ok}).json()["choices"][0]["message"]["content"] == "Four."
    )
    assert session.calls == 1
    # a reward for a closed session
    stand.end(other)
    r = httpx.post(
        url + f"/sessions/{other.id}/reward", json={"reward": 1.0}, headers={"Authorization": f"Bearer {other.key}"}
    )
    assert r.status_code == 409 and "closed" in r.json()["error"]["message"]


def test_session_caps_answer_400_and_the_samples_train_as_truncated(model, tokenizer, stand_of):
    stand = stand_of(
        ForcedEngine(model, tokenizer, ["Four."]),
        limits=SessionLimits(max_calls=2, max_call_tokens=64, max_response_tokens=512, context_window=2048),
    )
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "2+2?"}]
    for _ in range(2):
        r = client.chat.completions.create(model="m", messages=msgs)
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "again"}]
    with pytest.raises(openai.BadRequestError, match="2 calls are spent"):
        client.chat.completions.create(model="m", messages=msgs)
    # a reward still lands on a capped session
    httpx.post(
        stand.proxy.base_url + f"/sessions/{session.id}/reward",
        json={"reward": 0.5},
        headers={"Authorization": f"Bearer {session.key}"},
    ).raise_for_status()
    (sample,) = stand.end(session)
    assert session.state == "capped" and sample.status == Status.TRUNCATED and sample.reward == 0.5


def test_the_response_budget_cuts_a_call_and_then_caps_the_session(model, tokenizer, stand_of):
    stand = stand_of(
        ForcedEngine(model, tokenizer, ["one two three four five six seven eight nine ten"]),
        limits=SessionLimits(max_calls=8, max_call_tokens=64, max_response_tokens=6, context_window=2048),
    )
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "Count."}]
    r = client.chat.completions.create(model="m", messages=msgs)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].model_extra["token_ids"]) == 6
    msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
    with pytest.raises(openai.BadRequestError, match="no tokens left"):
        client.chat.completions.create(model="m", messages=msgs)
    (sample,) = stand.end(session)
    assert sample.status == Status.TRUNCATED and sample.response_length == 6


class AbortingEngine:
    weight_version = 0

    def __init__(self, logprobs=True):
        self.logprobs = logprobs

    async def generate(self, prompt_ids, sampling):
        if self.logprobs:
            return Completion([5, 6], [-1.0, -1.0], "abort", 0)
        return Completion([5, 6], None, "stop", 0)

    async def abort_all(self):
        return None


@pytest.mark.parametrize("logprobs", [True, False], ids=["aborted", "no_logprobs"])
def test_an_aborted_or_logprob_less_answer_ends_the_session(tokenizer, stand_of, logprobs):
    stand = stand_of(AbortingEngine(logprobs))
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    with pytest.raises(openai.InternalServerError, match="aborted" if logprobs else "no logprobs"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert session.state == "aborted" and session.ended.is_set()
    with pytest.raises(openai.ConflictError, match="closed"):  # the session generates no more
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_an_idle_session_is_closed_and_counted(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]), idle_timeout_s=0.3)
    session = stand.open()
    assert session.ended.wait.__self__ is session.ended
    import time

    deadline = time.monotonic() + 10
    while session.state == "open" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session.state == "idle"
    assert stand.proxy.take_counts()["agent_sessions_idle_closed"] == 1


def test_the_agent_asking_other_sampling_gets_the_rollouts_and_it_is_counted(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, ["Four."])
    stand = stand_of(
        engine, sampling=SamplingParams(temperature=0.7, max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id])
    )
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}], temperature=0.2)
    (sample,) = stand.end(session)
    assert session.sampling_overridden == 1 and stand.proxy.take_counts()["agent_sampling_overridden"] == 1
    assert gap(model, sample, temperature=0.7) < 1e-4  # recorded at the rollout's temperature


def test_completions_route_continues_a_segment_by_token_prefix(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, [" four", " five"])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    a = client.completions.create(model="m", prompt="Two plus two is", max_tokens=8)
    ids = a.model_extra["prompt_token_ids"] + a.choices[0].model_extra["token_ids"]
    client.completions.create(
        model="m", prompt=ids + tokenizer.encode(" and 2+3 is", add_special_tokens=False), max_tokens=8
    )
    (sample,) = stand.end(session)
    assert session.forks == 0 and sum(sample.loss_mask) == len(engine.outputs[0]) + len(engine.outputs[1])


def test_n_choices_train_the_one_the_agent_continued(model, tokenizer, stand_of):
    engine = ForcedEngine(model, tokenizer, ["A.", "B.", "C."])  # call 1's two choices: "A.", "B."
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "Pick."}]
    r = client.chat.completions.create(model="m", messages=msgs, n=2)
    assert [c.message.content for c in r.choices] == ["A.", "B."]
    msgs += [{"role": "assistant", "content": "B."}, {"role": "user", "content": "Why?"}]  # it went on with B
    client.chat.completions.create(model="m", messages=msgs)
    (sample,) = stand.end(session)
    assert session.forks == 0 and session.unused_choices == 1
    assert [t for t, m in zip(sample.response_ids, sample.loss_mask) if m] == engine.outputs[1] + engine.outputs[2]


def test_hostile_bodies_get_a_4xx_and_the_proxy_keeps_serving(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]))
    stand.proxy.max_body_bytes = 1 << 20  # (read when a request arrives)
    session = stand.open()
    url, auth = stand.proxy.base_url, {"Authorization": f"Bearer {session.key}"}
    huge = b'{"messages": [{"role": "user", "content": "' + b"x" * (2 << 20) + b'"}]}'
    r = httpx.post(url + "/chat/completions", content=huge, headers=auth | {"content-type": "application/json"})
    assert r.status_code == 413

    def chunks():  # no Content-Length: read until the limit, then refused
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(64):
            yield b"y" * (64 << 10)
        yield b'"}]}'

    r = httpx.post(url + "/chat/completions", content=chunks(), headers=auth | {"content-type": "application/json"})
    assert r.status_code == 413
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(
        url + "/chat/completions",
        headers=auth,
        json={
            "messages": [
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}
            ]
        },
    )
    assert r.status_code == 400
    r = httpx.post(
        url + "/chat/completions",
        headers=auth,
        json={"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 100},
    )
    assert r.status_code == 400 and "stop" in r.json()["error"]["message"]
    r = httpx.post(url + "/chat/completions", headers=auth, json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and session.calls == 1


QWEN_LIKE = (  # a tools-aware ChatML template of the Qwen kind (enough of it to exercise the native path)
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{%- elif m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}{%- for c in m.tool_calls or [] %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_a_template_that_renders_tools_itself_keeps_exact_tokens(model, tokenizer, stand_of):
    import copy

    native = copy.deepcopy(tokenizer)
    native.chat_template = QWEN_LIKE
    engine = ForcedEngine(model, native, [MODEL_CALL, "It is 391."])
    stand = stand_of(engine, native)
    assert stand.proxy.renderer.native_tools
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "17*23?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    assert "# Tools" in tokenizer.decode(engine.prompts[0])  # the template's own tool block
    m = first.choices[0].message
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"}]
    client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    (sample,) = stand.end(session)
    before = engine.prompts[0] + engine.outputs[0]
    assert session.forks == 0 and engine.prompts[1][: len(before)] == before
    assert "<tool_response>\n391\n</tool_response>" in tokenizer.decode(engine.prompts[1][len(before) :])
    assert gap(model, sample) < 1e-4


def test_a_session_of_a_full_step_gets_429_and_closes(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]))
    session = stand.open()
    session.sample.metadata["leftover"] = True  # what the rollout manager marks once the step is full
    url, auth = stand.proxy.base_url + "/chat/completions", {"Authorization": f"Bearer {session.key}"}
    body = {"messages": [{"role": "user", "content": "2+2?"}]}
    r = httpx.post(url, json=body, headers=auth)
    assert r.status_code == 429 and "budget is spent" in r.json()["error"]["message"] and "retry-after" in r.headers
    assert session.state == "aborted" and session.ended.is_set()
    assert httpx.post(url, json=body, headers=auth).status_code == 409


@pytest.mark.parametrize("cut", [True, False])
def test_a_turn_that_calls_a_tool_ends_with_its_calls(model, tokenizer, stand_of, cut):
    """What the model writes after its call (an imagined output, an answer) is not the agent's to see
    and is never trained, as in strop's multi-turn rollout; cut_after_tool_calls=False keeps it."""
    said = "Let me run it.\n```python\nprint(17*23)\n```\nIt prints 999. \\boxed{999}"
    engine = ForcedEngine(model, tokenizer, [said, "391"])
    stand = stand_of(engine, cut_after_tool_calls=cut)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "python",
                "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
            },
        }
    ]
    msgs = [{"role": "user", "content": "17*23?"}]
    r = client.chat.completions.create(model="m", messages=msgs, tools=tools)
    m = r.choices[0].message
    assert json.loads(m.tool_calls[0].function.arguments) == {"code": "print(17*23)\n"}
    kept = tokenizer.decode(r.choices[0].model_extra["token_ids"])
    assert (
        (kept.endswith("```") and "999" not in kept and m.content == "Let me run it.")
        if cut
        else ("999" in kept and "999" in m.content)
    )
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"}]
    client.chat.completions.create(model="m", messages=msgs, tools=tools)
    (sample,) = stand.end(session)
    assert session.forks == 0 and ("999" in tokenizer.decode(sample.response_ids)) == (not cut)
    assert gap(model, sample) < 1e-4


@pytest.mark.parametrize("template", ["framed", "native"])
@pytest.mark.parametrize("describe", [True, False])
def test_describe_tools_off_leaves_the_tools_out_of_the_prompt_and_still_parses_calls(
    model, tokenizer, stand_of, template, describe
):
    """agent.describe_tools=False (an agent whose system prompt tells the model how to call): the prompt
    is the template's rendering of the messages alone, for both kinds of template; the model's call
    still comes back as an OpenAI tool call and the session continues without a fork."""
    import copy

    tok = copy.deepcopy(tokenizer)
    if template == "native":
        tok.chat_template = QWEN_LIKE
    engine = ForcedEngine(model, tok, [MODEL_CALL, "It is 391."])
    stand = stand_of(engine, tok, describe_tools=describe)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "17*23?"}]
    first = client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    prompt = tok.decode(engine.prompts[0])
    bare = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (CALC[0]["function"]["name"] in prompt.replace(msgs[0]["content"], "")) == describe
    assert (prompt == bare) == (not describe)
    m = first.choices[0].message
    assert m.tool_calls and m.tool_calls[0].function.name == CALC[0]["function"]["name"]
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"}]
    client.chat.completions.create(model="m", messages=msgs, tools=CALC)
    (sample,) = stand.end(session)
    assert session.forks == 0 and gap(model, sample) < 1e-4


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_returns_a_call_as_content(model, tokenizer, stand_of):
    """tool_choice='none' on a later call (an agent asking for its final answer): the tools stay in the
    prompt, as with OpenAI, so the session continues without a fork; what the model writes is content."""
    engine = ForcedEngine(model, tokenizer, [MODEL_CALL, MODEL_CALL])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "user", "content": "17*23?"}]
    m = client.chat.completions.create(model="m", messages=msgs, tools=CALC).choices[0].message
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"}]
    last = client.chat.completions.create(model="m", messages=msgs, tools=CALC, tool_choice="none").choices[0]
    assert last.finish_reason == "stop" and not last.message.tool_calls and "17*23" in last.message.content
    assert "<tools>" in tokenizer.decode(engine.prompts[1])
    (sample,) = stand.end(session)
    assert session.forks == 0 and gap(model, sample) < 1e-4


# ---- bad input, engine refusals, hung-up clients, backpressure, streaming cost ----------------------------


class GatedEngine(ForcedEngine):
    """A ForcedEngine whose answers wait until ``gate`` is set (bounded: 30 s)."""

    def __init__(self, *args, delays: list[float] | None = None):
        super().__init__(*args)
        self.gate, self.delays = threading.Event(), list(delays or [])

    async def generate(self, prompt_ids, sampling):
        import asyncio
        import time

        k = len(self.prompts)
        out = await super().generate(prompt_ids, sampling)
        if k < len(self.delays):  # this call takes delays[k] seconds
            await asyncio.sleep(self.delays[k])
            return out
        deadline = time.monotonic() + 30
        while not self.gate.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return out


def wait_for(condition, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def deep_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_bad_input_gets_a_short_4xx_naming_the_field_never_an_engine_failure(model, tokenizer, stand_of):
    """Deep nesting, lone surrogates, an empty prompt, non-JSON and oversized values: each a 4xx in
    OpenAI's error shape naming the field, short, echoing neither the input nor the proxy's source;
    the session stays open and the next good call is served."""
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]))
    session = stand.open()
    url, auth = stand.proxy.base_url, {"Authorization": f"Bearer {session.key}", "content-type": "application/json"}
    ok = '[{"role": "user", "content": "2+2?"}]'
    mark = "ECHOME" * 2000  # never to be seen in an answer
    tool = {"type": "function", "function": {"name": "f", "parameters": deep_schema(150)}}
    cases = [  # (route, raw body, status, words in the message, param)
        (
            "/chat/completions",
            json.dumps({"messages": json.loads(ok), "tools": [tool]}),
            400,
            "nested",
            "tools[0].function.parameters",
        ),
        (
            "/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
            400,
            "surrogate",
            "messages[0].content",
        ),
        ("/chat/completions", '{"messages": ' + ok + ', "stop": ["\\udfff"]}', 400, "surrogate", "stop[0]"),
        (
            "/chat/completions",
            '{"messages": ' + ok + ', "tools": [{"type": "function", "function": {"name": "f", '
            '"description": "\\ud800"}}]}',
            400,
            "surrogate",
            "tools[0].function.description",
        ),
        ("/completions", '{"prompt": "\\ud800"}', 400, "surrogate", "prompt"),
        ("/completions", '{"prompt": ""}', 400, "no tokens", "prompt"),
        ("/completions", '{"prompt": []}', 400, "token ids", "prompt"),
        ("/chat/completions", mark * 300, 400, "not valid JSON", None),  # 3.6 MB, not JSON
        ("/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400, "nested", None),
        ("/chat/completions", json.dumps([mark]), 400, "object", None),
        (
            "/chat/completions",
            json.dumps({"messages": [{"role": mark, "content": "x"}]}),
            400,
            "role",
            "messages[0].role",
        ),
        (
            "/chat/completions",
            json.dumps({"messages": json.loads(ok), "tool_choice": mark}),
            400,
            "tool_choice",
            "tool_choice",
        ),
        (
            "/chat/completions",
            json.dumps({"messages": json.loads(ok), "logit_bias": {mark: 5}}),
            400,
            "logit_bias",
            "logit_bias",
        ),
        ("/chat/completions", json.dumps({"messages": json.loads(ok), "n": mark}), 400, "n", "n"),
        (
            "/chat/completions",
            json.dumps({"messages": [{"role": "user", "content": [{"type": mark}]}]}),
            400,
            "messages[0].content",
            "messages[0].content",
        ),
        (
            "/chat/completions",
            json.dumps(
                {
                    "messages": json.loads(ok),
                    "tools": [
                        {
                            "type": "function",
                            "function": {"name": "f", "parameters": {"type": "object", "properties": mark}},
                        }
                    ],
                }
            ),
            400,
            "JSON Schema",
            "tools[0].function.parameters",
        ),
        (f"/sessions/{session.id}/reward", json.dumps({"reward": mark}), 400, "reward", "reward"),
        (f"/sessions/{session.id}/reward", mark * 300, 400, "not valid JSON", None),
    ]
    for path, raw, status, words, param in cases:
        r = httpx.post(url + path, content=raw.encode("utf-8", "surrogatepass"), headers=auth, timeout=60)
        where = (path, raw[:80])
        assert r.status_code == status, (where, r.status_code, r.text[:300])
        assert len(r.content) < 600, (where, len(r.content), r.text[:300])  # short, whatever came in
        error = r.json()["error"]
        assert words in error["message"], (where, error)
        assert error["type"] == "invalid_request_error" and error.get("param") == param, (where, error)
        assert "ECHOME" not in r.text and ".py" not in r.text and "File " not in r.text, (where, r.text)
    # none of it reached the engine or ended the session, and the session still generates
    assert session.state == "open" and session.engine_error is None and session.calls == 0
    assert stand.proxy.take_counts()["agent_bad_requests"] == len(cases)
    r = httpx.post(url + "/chat/completions", content=('{"messages": ' + ok + "}").encode(), headers=auth)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Four."


class RefusingEngine:
    """Refuses every request as an engine does when the request is at fault, or fails as a broken one."""

    weight_version = 0

    def __init__(self, error):
        self.error = error

    async def generate(self, prompt_ids, sampling):
        raise self.error

    async def abort_all(self):
        return None


@pytest.mark.parametrize("kind", ["embedded", "http"])
def test_an_engine_refusing_the_request_is_the_clients_4xx_and_the_session_goes_on(tokenizer, stand_of, kind):
    if kind == "embedded":
        from strop.serving.request import RequestError

        error = RequestError("empty prompt: a request needs at least one token")
    else:
        from strop.wire.errors import EngineRefusedError

        error = EngineRefusedError("http://engine/generate: HTTP 400: input_ids[3] is outside the vocabulary", 400)
    stand = stand_of(RefusingEngine(error))
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="the engine refused"):
        client.completions.create(model="m", prompt=[1, 2, 3])
    assert session.state == "open" and session.engine_error is None and session.calls == 0
    counts = stand.proxy.take_counts()
    assert counts["agent_bad_requests"] == 1 and "agent_calls" not in counts


@pytest.mark.parametrize("status", [401, 404])
def test_an_engine_that_fails_or_is_misconfigured_still_stops_the_session(tokenizer, stand_of, status):
    from strop.wire.errors import EngineRefusedError, EngineUnavailable

    error = (
        EngineUnavailable("http://engine/generate failed after 4 attempts")
        if status == 404
        else EngineRefusedError("http://engine/generate: HTTP 401: a token is needed", 401)
    )
    stand = stand_of(RefusingEngine(error))
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="m", prompt=[1, 2, 3])
    assert caught.value.status_code == 502
    assert session.state == "aborted" and session.engine_error is not None


def test_models_and_health_need_a_key_and_any_model_name_is_the_runs_model(model, tokenizer, stand_of):
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]), model_name="the-run")
    session = stand.open()
    health = stand.proxy.base_url.removesuffix("/v1") + "/health"
    for url in (stand.proxy.base_url + "/models", health):
        assert httpx.get(url).status_code == 401, url
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401, url
    assert httpx.get(health, headers={"Authorization": f"Bearer {session.key}"}).json()["status"] == "ok"
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["the-run"]
    # an agent written for another model is served by the run's (the answer names it)
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "2+2?"}])
    assert r.model == "the-run" and r.choices[0].message.content == "Four."


def test_a_call_whose_client_hung_up_is_not_recorded(model, tokenizer, stand_of):
    """An SDK that times out and retries: the abandoned call's answer is dropped (not a sample, not a
    call of the session), the retry is the one recorded."""
    engine = GatedEngine(model, tokenizer, ["Four."], delays=[2.0, 0.0, 0.0])
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=1, timeout=0.7)
    msgs = [{"role": "user", "content": "2+2?"}]
    r = client.chat.completions.create(model="m", messages=msgs)
    assert r.choices[0].message.content == "Four." and len(engine.prompts) == 2
    wait_for(lambda: stand.proxy.in_flight == 0)  # the abandoned call's engine answer came back, later
    msgs += [{"role": "assistant", "content": "Four."}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model="m", messages=msgs)
    (sample,) = stand.end(session)
    assert session.calls == 2 and session.forks == 0
    assert stand.proxy.take_counts()["agent_calls_client_gone"] == 1
    assert [t for t, m in zip(sample.response_ids, sample.loss_mask) if m] == engine.outputs[1] + engine.outputs[2]


def test_the_call_past_max_calls_in_flight_gets_429(model, tokenizer, stand_of):
    engine = GatedEngine(model, tokenizer, ["Four."])
    stand = stand_of(engine, max_calls_in_flight=2, retry_after_s=0.5)
    sessions = [stand.open(index=i) for i in range(3)]
    url, body = stand.proxy.base_url + "/chat/completions", {"messages": [{"role": "user", "content": "2+2?"}]}

    def auth(s):
        return {"Authorization": f"Bearer {s.key}"}

    answers = {}
    threads = [
        threading.Thread(
            target=lambda i=i: answers.__setitem__(i, httpx.post(url, json=body, headers=auth(sessions[i]), timeout=60))
        )
        for i in range(2)
    ]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: stand.proxy.in_flight == 2)
        third = httpx.post(url, json=body, headers=auth(sessions[2]))
    finally:
        engine.gate.set()
        for t in threads:
            t.join(60)
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert "agent.max_calls_in_flight=2" in third.json()["error"]["message"] and sessions[2].calls == 0
    assert [answers[i].status_code for i in (0, 1)] == [200, 200]
    assert httpx.post(url, json=body, headers=auth(sessions[2])).status_code == 200  # room again


def test_a_continued_chat_prompt_is_the_templates_tokenisation_of_the_whole_conversation(model, tokenizer, stand_of):
    """Where the model's tokens are the ones the tokenizer makes of its text, a continued call's prompt
    is exactly the chat template's rendering of all its messages, tokenised whole: each ended turn is
    closed once, whether the model wrote the end-of-turn token, a tool call ended the turn before it,
    or the length limit did."""
    from strop.agents.chat import check_messages, check_tools_schema

    engine = ForcedEngine(
        model, tokenizer, [f"Let me compute.{CALL}", "It is 391.", "one two three four five six", "Done."]
    )
    stand = stand_of(engine)
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0)
    msgs = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 17*23?"}]
    asked = []

    def ask(**kw):
        asked.append([dict(m) for m in msgs])
        return client.chat.completions.create(model="m", messages=msgs, tools=CALC, **kw).choices[0]

    m = ask().message  # a tool call: the turn ends at the call, without the end token the model sampled
    msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "391"}]
    said = ask()  # ends with the end-of-turn token
    msgs += [{"role": "assistant", "content": said.message.content}, {"role": "user", "content": "Count."}]
    cut = ask(max_tokens=4)  # cut by the length limit
    assert cut.finish_reason == "length"
    msgs += [{"role": "assistant", "content": cut.message.content}, {"role": "user", "content": "ok"}]
    ask()
    renderer = stand.proxy.renderer
    for k, conversation in enumerate(asked):
        whole = renderer.encode(renderer.render(check_messages(conversation), check_tools_schema(CALC)))
        assert engine.prompts[k] == whole, (k, tokenizer.decode(engine.prompts[k]), tokenizer.decode(whole))
    (sample,) = stand.end(session)
    assert session.forks == 0 and sample.prompt_ids + sample.response_ids == engine.prompts[3] + engine.outputs[3]


class ReplayEngine(ForcedEngine):
    """A ForcedEngine that answers a prompt it saw again at once, with the same completion."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen = {}

    async def generate(self, prompt_ids, sampling):
        if tuple(prompt_ids) not in self.seen:
            self.seen[tuple(prompt_ids)] = await super().generate(prompt_ids, sampling)
        return self.seen[tuple(prompt_ids)]


class CountingTokenizer:
    """The tokenizer, counting the token ids it decodes and taking ``pause`` seconds per decode (a
    stand-in for a long answer's cost): what the proxy decodes and where it does it show."""

    def __init__(self, tokenizer, pause=0.0):
        self._tok, self.pause, self.decoded = tokenizer, pause, 0

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def __call__(self, *args, **kw):
        return self._tok(*args, **kw)

    def decode(self, ids, *args, **kw):
        import time

        self.decoded += len(ids)
        time.sleep(self.pause)
        return self._tok.decode(ids, *args, **kw)


def test_a_streamed_answer_is_decoded_once_per_token_off_the_event_loop(model, tokenizer, stand_of):
    """A long streamed answer: each token's text is decoded from a few tokens (not the whole prefix
    again), and the decoding runs beside the event loop: other calls are answered meanwhile."""
    import time

    words = " ".join(f"w{k}" for k in range(300))
    slow = CountingTokenizer(tokenizer)
    engine = ReplayEngine(model, tokenizer, [words])
    stand = stand_of(
        engine,
        slow,
        limits=SessionLimits(max_calls=8, max_call_tokens=2048, max_response_tokens=4096, context_window=8192),
    )
    session = stand.open()
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Count."}]
    plain = client.chat.completions.create(model="m", messages=msgs).choices[0]
    n = len(plain.model_extra["token_ids"])
    assert n > 500
    slow.decoded, slow.pause = 0, 0.002  # from here, 2 ms per decode
    text, ids, health = "", [], []
    stop = threading.Event()

    def ping():  # the event loop's latency while the answer is decoded and sent
        while not stop.is_set():
            t = time.monotonic()
            httpx.get(
                stand.proxy.base_url.removesuffix("/v1") + "/health",
                timeout=30,
                headers={"Authorization": f"Bearer {session.key}"},
            )
            health.append(time.monotonic() - t)
            time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        for chunk in client.chat.completions.create(model="m", messages=msgs, stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                ids += (c.model_extra or {}).get("token_ids") or []
    finally:
        stop.set()
        pinger.join(60)
    assert ids == plain.model_extra["token_ids"] and text == plain.message.content
    assert slow.decoded < 12 * n, (slow.decoded, n)  # the whole prefix each token: n * n / 2
    assert len(health) > 3 and max(health) < 1.0, max(health)  # (decoding on the loop: over 5 s)


def test_a_standalone_session_closed_for_idleness_stays_readable_until_collected(model, tokenizer, stand_of):
    """strop proxy: GET shows a session's segments so far (as often as asked); a session closed for
    idleness still reads back and closes (its samples, not trained as it ended idle), then is freed;
    ended sessions nobody collects are kept up to a bound, the oldest freed first."""
    stand = stand_of(ForcedEngine(model, tokenizer, ["Four."]), admin_token="t", idle_timeout_s=0.4)
    base, admin = stand.proxy.base_url, {"Authorization": "Bearer t"}
    opened = httpx.post(base + "/sessions", headers=admin).json()
    client = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
    seen = [httpx.get(base + f"/sessions/{opened['id']}", headers=admin).json() for _ in range(2)]
    assert seen[0] == seen[1] and seen[0]["state"] == "open" and len(seen[0]["samples"]) == 1
    assert seen[0]["samples"][0]["prompt_ids"] == r.model_extra["prompt_token_ids"]
    assert seen[0]["samples"][0]["response_ids"] == r.choices[0].model_extra["token_ids"]
    wait_for(lambda: httpx.get(base + f"/sessions/{opened['id']}", headers=admin).json()["state"] == "idle")
    with pytest.raises(openai.ConflictError, match="idle"):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+2?"}])
    state = httpx.get(base + f"/sessions/{opened['id']}", headers=admin).json()
    done = httpx.post(base + f"/sessions/{opened['id']}/close", headers=admin)
    assert done.status_code == 200 and done.json() == state and state["state"] == "idle"
    (sample,) = state["samples"]
    assert sample["response_ids"] == seen[0]["samples"][0]["response_ids"] and sample["status"] == "aborted"
    assert httpx.get(base + f"/sessions/{opened['id']}", headers=admin).status_code == 404  # collected: freed
    assert opened["id"] not in stand.proxy.by_id and not stand.proxy.sessions
    # never collected: at most max_ended_sessions stay, the first to end go first
    stand.proxy.max_ended_sessions = 3
    ids = [httpx.post(base + "/sessions", headers=admin).json()["id"] for _ in range(6)]
    wait_for(
        lambda: (
            all(stand.proxy.by_id[i].state == "idle" for i in ids if i in stand.proxy.by_id)
            and len(stand.proxy.by_id) <= 3
        )
    )
    assert sorted(stand.proxy.by_id) == sorted(ids[3:]) and len(stand.proxy.sessions) == 3
    assert [httpx.get(base + f"/sessions/{i}", headers=admin).status_code for i in ids] == [404] * 3 + [200] * 3
    assert stand.proxy.take_counts()["agent_sessions_dropped_uncollected"] == 3


# ---- live streams: each token's chunk as it is decoded ------------------------------------------------------


class StreamingForcedEngine(ForcedEngine):
    """A ForcedEngine that reports each token as it is "decoded" (the embedded engine's ``on_token``),
    waits before token ``hold_after`` until ``gate`` is set (at most 30 s: ``timed_out`` then), and
    honours ``abort``."""

    def __init__(self, *args, hold_after: int | None = None):
        super().__init__(*args)
        self.gate, self.timed_out, self.hold_after = threading.Event(), False, hold_after
        self.aborted: set[str] = set()

    async def generate(self, prompt_ids, sampling, request_id=None, *, on_token=None):
        import asyncio
        import time

        whole = await super().generate(prompt_ids, sampling)
        for k, (token, logprob) in enumerate(zip(whole.token_ids, whole.logprobs)):
            if k == self.hold_after:
                deadline = time.monotonic() + 30
                while not self.gate.is_set() and request_id not in self.aborted:
                    if time.monotonic() > deadline:
                        self.timed_out = True
                        break
                    await asyncio.sleep(0.01)
            if request_id in self.aborted:
                return Completion(whole.token_ids[:k], whole.logprobs[:k], "abort", self.weight_version)
            if on_token is not None:
                on_token(token, logprob, None)
            await asyncio.sleep(0)
        return whole

    async def abort(self, request_id):
        self.aborted.add(request_id)
        return True


def _joined(chunks, index=0):
    """(token ids, content, logprobs, finish reason, tool calls as (name, arguments)) of one streamed choice."""
    ids, text, lps, finish, calls = [], "", [], None, []
    for chunk in chunks:
        for c in chunk.choices:
            if c.index != index:
                continue
            ids += (c.model_extra or {}).get("token_ids") or []
            text += c.delta.content or ""
            lps += [x.logprob for x in (c.logprobs.content if c.logprobs else [])]
            calls += [(t.function.name, json.loads(t.function.arguments)) for t in c.delta.tool_calls or []]
            finish = c.finish_reason or finish
    return ids, text, lps, finish, calls


def _recorded(stand, session):
    return [(x.response_ids, x.rollout_logprobs, x.loss_mask) for x in stand.end(session)]


@pytest.mark.parametrize("stop", [False, True], ids=["greedy", "stop-string"])
def test_a_stream_on_the_embedded_engine_sends_each_token_as_it_is_decoded(model, tokenizer, stand_of, stop):
    """The first token's chunk arrives while the engine is held before the generation's end (a hook in
    its decode step: no timing); the chunks join to the plain call's tokens, text, logprobs and finish
    (greedy; sampled with a seed and cut at a stop string, whose text no chunk shows), and the session
    records what the plain call's session records."""
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=[tokenizer.eos_token_id],
        context_window=256,
        seed=0,
    )
    sampling = SamplingParams(
        temperature=1.0 if stop else 0.0, max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id]
    )
    stand = stand_of(engine, sampling=sampling)
    plain_session, stream_session, probe_session = stand.open(), stand.open(index=1), stand.open(index=2)
    plain = openai.OpenAI(base_url=stand.proxy.base_url, api_key=plain_session.key, max_retries=0, timeout=60)
    streamed = openai.OpenAI(base_url=stand.proxy.base_url, api_key=stream_session.key, max_retries=0, timeout=60)
    kw = {
        "model": "m",
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 40,
        "logprobs": True,
        **({"seed": 1234} if stop else {}),
    }
    if stop:  # a word the answer writes after its start
        probe = openai.OpenAI(base_url=stand.proxy.base_url, api_key=probe_session.key, max_retries=0)
        answer = probe.chat.completions.create(**kw).choices[0]
        words = [tokenizer.decode([t]).strip() for t in answer.model_extra["token_ids"][4:]]
        kw["stop"] = [next(w for w in words if w and answer.message.content.index(w) > 4), "never!"]
    with HeldStep(engine, "_advance") as held:  # the 5th decode step waits until the client has read a token
        stream = iter(streamed.chat.completions.create(stream=True, **kw))
        first = next(c for c in stream if c.choices and (c.choices[0].model_extra or {}).get("token_ids"))
        assert not held.timed_out.is_set(), "the first token came only once the generation had ended"
        held.release()
        chunks = [first, *stream]
    a = plain.chat.completions.create(**kw).choices[0]
    ids, text, lps, finish, _ = _joined(chunks)
    assert ids == a.model_extra["token_ids"] and len(ids) > 4 and held.calls >= 5  # (the hook held a step)
    assert text == a.message.content and finish == a.finish_reason
    assert lps == [x.logprob for x in a.logprobs.content]
    if stop:
        assert finish == "stop" and kw["stop"][0] not in text
        assert kw["stop"][0] in tokenizer.decode(ids) and kw["stop"][0] not in tokenizer.decode(ids[:-1])
    assert _recorded(stand, stream_session) == _recorded(stand, plain_session)


@pytest.mark.parametrize("cut", [True, False], ids=["cut-after-calls", "kept"])
@pytest.mark.parametrize("said", ["python", "hermes"])
def test_a_streamed_tool_call_holds_its_text_and_ends_as_the_plain_call(model, tokenizer, stand_of, said, cut):
    """With tools, the text before a call goes out live; the call's text (from its marker on) never
    shows as content, the call comes as its own delta at the end, and the chunks join to the plain
    call's tokens, content, calls and finish, with agent.cut_after_tool_calls on or off; the session
    records what the plain call's records."""
    text, tools = {
        "python": (
            "Let me run it.\n```python\nprint(17*23)\n```\nIt prints 999. \\boxed{999}",
            [
                {
                    "type": "function",
                    "function": {
                        "name": "python",
                        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
                    },
                }
            ],
        ),
        "hermes": ("I will compute it. " + MODEL_CALL + " It is 999.", CALC),
    }[said]
    engine = StreamingForcedEngine(model, tokenizer, [text], hold_after=4)
    stand = stand_of(engine, cut_after_tool_calls=cut)
    plain_session, stream_session = stand.open(), stand.open(index=1)
    kw = {"model": "m", "messages": [{"role": "user", "content": "17*23?"}], "tools": tools, "logprobs": True}
    streamed = openai.OpenAI(base_url=stand.proxy.base_url, api_key=stream_session.key, max_retries=0, timeout=60)
    stream = iter(streamed.chat.completions.create(stream=True, **kw))
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    assert not engine.timed_out, "the text before the call came only once the generation had ended"
    engine.gate.set()
    chunks = [first, *stream]
    plain = openai.OpenAI(base_url=stand.proxy.base_url, api_key=plain_session.key, max_retries=0, timeout=60)
    a = plain.chat.completions.create(**kw).choices[0]
    ids, content, lps, finish, calls = _joined(chunks)
    assert ids == a.model_extra["token_ids"] and lps == [x.logprob for x in a.logprobs.content]
    assert content == a.message.content and finish == a.finish_reason == "tool_calls"
    assert calls == [(c.function.name, json.loads(c.function.arguments)) for c in a.message.tool_calls]
    assert all(
        m not in c.choices[0].delta.content
        for c in chunks
        if c.choices and c.choices[0].delta.content
        for m in ("<tool_call>", "```")
    )
    assert ("999" in tokenizer.decode(ids)) == (not cut)
    assert _recorded(stand, stream_session) == _recorded(stand, plain_session)


def test_a_client_hanging_up_mid_stream_aborts_the_engine_request_and_the_call_is_not_recorded(
    model, tokenizer, stand_of
):
    engine = EmbeddedEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        default_stop_token_ids=[tokenizer.eos_token_id],
        context_window=512,
        seed=0,
    )
    ended, generate, advance = [], engine.generate, engine._advance

    async def recorded(prompt_ids, sampling, request_id=None, *, on_token=None, top_logprobs=0):
        ended.append(await generate(prompt_ids, sampling, request_id, on_token=on_token, top_logprobs=top_logprobs))
        return ended[-1]

    def slowed(*args):  # ~10 ms a step: the 200-token answer is still decoding when the client leaves
        import time

        time.sleep(0.01)
        return advance(*args)

    engine.generate, engine._advance = recorded, slowed
    stand = stand_of(
        engine,
        limits=SessionLimits(max_calls=8, max_call_tokens=200, max_response_tokens=1024, context_window=2048),
        sampling=SamplingParams(temperature=1.0, max_new_tokens=200, stop_token_ids=[-1]),
    )
    session = stand.open()
    url, auth = stand.proxy.base_url + "/chat/completions", {"Authorization": f"Bearer {session.key}"}
    body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", url, json=body, headers=auth, timeout=30) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if '"token_ids"' in line)
    wait_for(lambda: ended and stand.proxy.in_flight == 0, timeout=20)
    assert ended[0].finish_reason == "abort" and len(ended[0].token_ids) < 200, ended
    assert session.calls == 0 and stand.proxy.take_counts()["agent_calls_client_gone"] == 1
    client = openai.OpenAI(base_url=stand.proxy.base_url, api_key=session.key, max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="m", messages=body["messages"], max_tokens=8)  # the session goes on
    (sample,) = stand.end(session)
    assert (
        session.calls == 1
        and [t for t, m in zip(sample.response_ids, sample.loss_mask) if m]
        == answer.choices[0].model_extra["token_ids"]
    )
