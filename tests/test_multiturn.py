"""Multi-turn tool rollout: token in / token out, and one test per hardening rule."""

import asyncio
import re

import pytest

from strop.rollout.generate import RolloutContext
from strop.rollout.multiturn import TurnLimits, generate
from strop.tools import CALCULATOR, Tool, ToolCall, ToolSet, calculate, parse_tool_call
from strop.types import Completion, SamplingParams, Sample, Status


class TextEngine:
    """Answers turn k with texts[k] (tokenised by the real tokenizer), logprob -0.5 per token;
    records every prompt it was given."""

    def __init__(self, tokenizer, texts, *, finish=None, no_logprobs_at=None):
        self.tok, self.texts, self.finish, self.no_logprobs_at = tokenizer, list(texts), finish or {}, no_logprobs_at
        self.prompts, self.budgets = [], []

    async def generate(self, prompt_ids, sampling):
        k = len(self.prompts)
        self.prompts.append(list(prompt_ids))
        self.budgets.append(sampling.max_new_tokens)
        ids = self.tok.encode(self.texts[k], add_special_tokens=False)
        reason = self.finish.get(k, "stop")
        if len(ids) > sampling.max_new_tokens:
            ids, reason = ids[: sampling.max_new_tokens], "length"
        lps = None if k == self.no_logprobs_at else [-0.5] * len(ids)
        return Completion(ids, lps, reason, 3)


def make(tokenizer, texts, tools=(CALCULATOR,), limits=None, **kw):
    engine = TextEngine(tokenizer, texts, **kw)
    ctx = RolloutContext(
        engine=engine, tokenizer=tokenizer, extra={"tools": ToolSet(list(tools)), "turn_limits": limits or TurnLimits()}
    )
    return engine, ctx


def sample(tokenizer):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 17 * 23?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return Sample(prompt="What is 17 * 23?", prompt_ids=list(ids), label="391")


def run(ctx, s, max_new_tokens=400):
    return asyncio.run(generate(ctx, s, SamplingParams(max_new_tokens=max_new_tokens)))


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17 * 23"}}</tool_call>'


def test_a_tool_call_then_an_answer_token_in_token_out(tokenizer):
    engine, ctx = make(tokenizer, [f"Let me compute. {CALL} and then I ramble on", "The answer is 391.<|im_end|>"])
    s = run(ctx, sample(tokenizer))
    assert s.status == Status.COMPLETED and s.metadata["tool_calls"] == 1 and s.metadata["turns"] == 2
    # the second turn's prompt is exactly the prompt + every response token so far
    assert engine.prompts[1] == s.prompt_ids + s.response_ids[: len(engine.prompts[1]) - len(s.prompt_ids)]
    text = tokenizer.decode(s.response_ids, skip_special_tokens=False)
    assert (
        "391" in text.split("<tool_response>")[1] and "ramble" not in text
    )  # the turn's tail after the call is dropped
    # model tokens trainable with their logprobs; the observation (one block) masked with logprob 0
    m = s.loss_mask
    first, last = m.index(0), len(m) - 1 - m[::-1].index(0)
    assert set(m[:first]) == {1} and set(m[first : last + 1]) == {0} and set(m[last + 1 :]) == {1}
    assert tokenizer.decode(s.response_ids[first : last + 1]).count("391") == 1
    assert all(lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m == 0)
    assert all(lp == -0.5 for lp, m in zip(s.rollout_logprobs, s.loss_mask) if m == 1)


def test_a_dirty_retried_sample_starts_clean(tokenizer):
    engine, ctx = make(tokenizer, ["391<|im_end|>"])
    s = sample(tokenizer)
    s.append([5, 6, 7], [-1.0, -1.0, -1.0])  # a previous attempt's tokens
    s.status, s.reward = Status.ABORTED, 1.0
    s.metadata["tool_calls"] = 9
    s = run(ctx, s)
    assert engine.prompts[0] == s.prompt_ids  # the first turn did not see the old tokens
    assert s.response_ids[:3] != [5, 6, 7] and s.reward is None
    assert s.status == Status.COMPLETED and s.metadata["tool_calls"] == 0


def test_the_budget_running_out_mid_turn(tokenizer):
    limits = TurnLimits(max_turn_tokens=100)
    engine, ctx = make(tokenizer, [f"{CALL}", "The answer is " + "very " * 200], limits=limits)
    s = run(ctx, sample(tokenizer), max_new_tokens=80)
    first = len(engine.prompts[1]) - len(s.prompt_ids)
    assert engine.budgets == [80, 80 - first]  # min(per-turn cap, what is left)
    assert s.response_length == 80 and s.status == Status.TRUNCATED


def test_missing_logprobs_abort_the_sample(tokenizer):
    engine, ctx = make(tokenizer, [CALL, "391<|im_end|>"], no_logprobs_at=1)  # the second turn has none
    s = run(ctx, sample(tokenizer))
    assert s.status == Status.ABORTED and "no logprobs" in s.metadata["abort_reason"]
    assert not s.status.trainable and len(engine.prompts) == 2
    assert all(m == 1 for m in s.loss_mask[:5])  # the first turn's tokens stay; the bad turn's never enter
    assert s.metadata["turns"] == 2


def test_an_engine_abort_aborts_the_sample(tokenizer):
    engine, ctx = make(tokenizer, ["The answer is"], finish={0: "abort"})
    s = run(ctx, sample(tokenizer))
    assert s.status == Status.ABORTED and "aborted" in s.metadata["abort_reason"] and s.response_length == 0


def test_a_huge_tool_output_is_capped_with_a_marker_then_cut_to_the_budget(tokenizer):
    huge = Tool("dump", "prints a lot", {"type": "object", "properties": {}}, lambda: "x" * 1_000_000)
    call = '<tool_call>{"name": "dump", "arguments": {}}</tool_call>'
    limits = TurnLimits(output_chars=5000, output_tokens=120)
    engine, ctx = make(tokenizer, [call, "done<|im_end|>"], tools=[huge], limits=limits)
    s = run(ctx, sample(tokenizer), max_new_tokens=400)
    text = tokenizer.decode(s.response_ids, skip_special_tokens=False)
    assert "[tool output truncated at 120 tokens]" in text and "</tool_response>" in text
    assert s.loss_mask.count(0) == 120 and s.status == Status.COMPLETED
    # with less budget left than the capped output, the observation is cut and the sample TRUNCATED
    engine, ctx = make(tokenizer, [call, "done<|im_end|>"], tools=[huge], limits=limits)
    s = run(ctx, sample(tokenizer), max_new_tokens=60)
    assert s.response_length == 60 and s.status == Status.TRUNCATED and len(engine.prompts) == 1
    assert s.metadata["stopped"] == "budget in tool output"


def test_tool_errors_go_back_to_the_model(tokenizer):
    bad = '<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>'
    engine, ctx = make(
        tokenizer,
        [bad, '<tool_call>{"name": "nope"}</tool_call>', "<tool_call>{not json</tool_call>", "I give up<|im_end|>"],
        limits=TurnLimits(max_turns=4),
    )
    s = run(ctx, sample(tokenizer))
    text = tokenizer.decode(s.response_ids, skip_special_tokens=False)
    assert "Error: SyntaxError" in text and "unknown tool 'nope'" in text and "could not parse the tool call" in text
    assert s.metadata["tool_calls"] == 3 and s.metadata["tool_errors"] == 3 and s.status == Status.COMPLETED


def test_max_turns_with_a_pending_call_truncates(tokenizer):
    engine, ctx = make(tokenizer, [CALL, CALL], limits=TurnLimits(max_turns=2))
    s = run(ctx, sample(tokenizer))
    assert s.status == Status.TRUNCATED and s.metadata["stopped"] == "max_turns" and s.metadata["tool_calls"] == 1


def test_parse_tool_call_forms():
    assert parse_tool_call("no call here") is None
    text = 'x <tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call> y'
    c = parse_tool_call(text)
    assert c.name == "calculator" and c.arguments == {"expression": "1+1"} and text[c.end :] == " y"
    f = parse_tool_call("Let me run:\n```python\nprint(2**10)\n```\nresult")
    assert f.name == "python" and f.arguments == {"code": "print(2**10)\n"}
    assert parse_tool_call("<tool_call>[1, 2]</tool_call>").name == "invalid"
    assert parse_tool_call("```python\nprint(1)\n") is None  # an unfinished block is not a call yet


def test_a_deeply_nested_tool_call_is_an_invalid_call_not_a_crash():
    """json.loads recurses per bracket: a turn of brackets must reach the model as an error."""
    text = "<tool_call>" + "[" * 5000 + "</tool_call> rest"
    call = parse_tool_call(text)
    assert call.name == "invalid" and "RecursionError" in call.arguments["error"] and text[call.end :] == " rest"


def test_calculator_is_arithmetic_only():
    assert calculate("(17 + 5) * 3 / 2") == "33" and calculate("sqrt(16) + 2**3") == "12"
    for bad in ("__import__('os')", "x + 1", "2 ** 100000", "open('f')"):
        with pytest.raises(ValueError):
            calculate(bad)


def _tool(name, fn):
    return Tool(name, f"the {name} tool", {"type": "object", "properties": {"x": {"type": "string"}}}, fn)


def test_a_slow_sync_tool_runs_off_the_event_loop():
    import time

    def slow(x):
        time.sleep(0.3)
        return x.upper()

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        out = await ToolSet([_tool("slow", slow)]).call(ToolCall("slow", {"x": "ok"}, 0))
        task.cancel()
        return out, ticks

    out, ticks = asyncio.run(main())
    assert out == ("OK", True)
    assert ticks >= 10  # the loop kept serving while the tool slept (a blocking call would give 0)


def test_hung_tools_time_out_and_never_queue_the_engines_work():
    """More hung sync tools than tool threads: every call ends with a timeout message for the model,
    and work on the default executor (where the engine's decode steps run) is not held up."""
    import threading
    import time

    release = threading.Event()

    def hang(x):
        release.wait(30)
        return "late"

    async def main():
        tools = ToolSet([_tool("hang", hang)], threads=2, timeout_s=0.5)
        t = time.perf_counter()
        calls = [asyncio.ensure_future(tools.call(ToolCall("hang", {"x": "1"}, 0))) for _ in range(6)]
        await asyncio.sleep(0.05)
        # queued behind the tools it would wait for their 30 s hang: 2 s tells the two apart on any machine
        engine_step = await asyncio.wait_for(asyncio.to_thread(lambda: "decoded"), 2)
        results = await asyncio.gather(*calls)
        return engine_step, results, time.perf_counter() - t

    try:
        engine_step, results, seconds = asyncio.run(main())
    finally:
        release.set()
    assert engine_step == "decoded"
    assert results == [("Error: tool 'hang' gave no result within 0.5 s", False)] * 6
    assert seconds < 10  # the calls waiting for a thread time out too (not after the tools' 30 s hang)


def test_a_tool_returning_non_text_stops_the_run_naming_its_origin():
    from strop.plugins import PluginError

    tools = ToolSet([_tool("quiet", lambda x: None)], {"quiet": "tools hook my_pkg:tools"})
    with pytest.raises(PluginError, match=r"tools hook my_pkg:tools: tool 'quiet' returned NoneType"):
        asyncio.run(tools.call(ToolCall("quiet", {"x": "1"}, 0)))


def test_check_tools_names_the_broken_tool():
    from strop.tools import check_tools

    ok = _tool("fine", lambda x: x)
    check_tools([ok, CALCULATOR])
    for bad, message in [
        ([], "returned no tools"),
        ([ok, "calculator"], "item 1 is a str"),
        ([_tool("has space", lambda x: x)], "tool 0 ('has space'): a name must be"),
        ([_tool("invalid", lambda x: x)], "not 'invalid'"),
        ([Tool("t", "", {"type": "object", "properties": {}}, lambda: "")], "the description is empty"),
        ([Tool("t", "d", {"type": "string"}, lambda: "")], "parameters must be a JSON schema of an object"),
        ([Tool("t", "d", {"type": "object", "properties": {}, "required": ["y"]}, lambda: "")], "required ['y']"),
        ([_tool("t", lambda y: y)], "does not take the schema's properties ['x']"),
        ([_tool("t", lambda x, y: y)], "requires ['y'], which the schema does not give"),
        ([ok, ok], "['fine'] occur twice"),
        (
            [Tool("abs", "d", {"type": "object", "properties": {"x": {"type": "number"}}}, abs)],
            "does not take the schema's properties ['x'] by keyword",
        ),  # abs(x, /) is positional-only
        (
            [Tool("t", "d", {"type": "object", "properties": {"x": "string"}}, lambda x: x)],
            "properties ['x'] must each be a schema object",
        ),
        (
            [Tool("t", "d", {"type": "object", "properties": {"x": {}}, "required": "x"}, lambda x: x)],
            "'required' must be a list of property names",
        ),
    ]:
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            check_tools(bad)


def test_describe_tools_puts_every_schema_and_the_call_format_in_the_system_prompt():
    import json

    from strop.tools import describe_tools

    tools = ToolSet([CALCULATOR, _tool("echo", lambda x: x)])
    text = describe_tools("Answer in \\boxed{}.", tools)
    assert text.startswith("Answer in \\boxed{}.\n\n") and "<tool_call>" in text
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == tools.schemas()
    assert describe_tools(None, tools).startswith("You may call tools.")


def test_a_turn_bookkeeping_bug_stops_the_run_and_never_fails_the_sample(tokenizer, tmp_path, monkeypatch):
    """TurnError is strop's bug, never the sample's: it leaves the rollout instead of becoming a
    FAILED sample (which would hide it among the failed_samples counts)."""
    from strop.rollout.generate import rollout_groups
    from strop.rollout.multiturn import TurnError

    append = Sample.append

    def buggy_append(self, *args, **kw):  # a bookkeeping bug: the prompt changes under the turn
        append(self, *args, **kw)
        self.prompt_ids = self.prompt_ids[:-1] + [self.prompt_ids[-1] + 1]

    monkeypatch.setattr(Sample, "append", buggy_append)
    ctx = RolloutContext(
        engine=TextEngine(tokenizer, ["391<|im_end|>"]),
        tokenizer=tokenizer,
        generate=generate,
        reward=lambda sample: 1.0,
        run_dir=tmp_path,
        extra={"tools": ToolSet([CALCULATOR]), "turn_limits": TurnLimits()},
    )
    with pytest.raises(TurnError, match="no longer a prefix"):
        asyncio.run(rollout_groups(ctx, [[sample(tokenizer)]], SamplingParams(max_new_tokens=40)))
    assert not (tmp_path / "failed_samples.jsonl").exists()


class TwoTurnEngine:
    """Turn 1 (a bare prompt) answers with a calculator call, later turns with the answer, after
    ``delay_s``; records the prompt of every sample it served a turn of."""

    def __init__(self, tokenizer, prompt_length, delay_s):
        self.tok, self.prompt_length, self.delay_s, self.served = tokenizer, prompt_length, delay_s, []
        self.weight_version = 0

    async def generate(self, prompt_ids, sampling, request_id=None):
        self.served.append(tuple(prompt_ids[: self.prompt_length]))
        await asyncio.sleep(self.delay_s)
        text = CALL if len(prompt_ids) == self.prompt_length else "391<|im_end|>"
        ids = self.tok.encode(text, add_special_tokens=False)
        return Completion(ids, [-0.5] * len(ids), "stop", 0)

    async def health(self):
        return True

    async def get_weight_version(self):
        return 0

    async def close(self):
        pass


@pytest.mark.timeout(60)
def test_engine_affinity_keeps_every_turn_of_a_sample_on_one_engine(tokenizer):
    """engine.affinity reaches the router: every turn of a multi-turn sample goes to one engine.
    Without it, least-outstanding routing sends the second turns of the slow engine's samples to
    the idle fast one."""
    from strop.engines.router import Router

    samples = [sample(tokenizer) for _ in range(4)]
    for i, s in enumerate(samples):  # four distinct prompts of one length
        s.prompt_ids, s.index = s.prompt_ids[:-1] + [s.prompt_ids[-1], 100 + i], i
    n = len(samples[0].prompt_ids)
    slow, fast = TwoTurnEngine(tokenizer, n, 0.3), TwoTurnEngine(tokenizer, n, 0.01)
    router = Router([slow, fast], affinity=True, print_events=False)
    ctx = RolloutContext(
        engine=router, tokenizer=tokenizer, extra={"tools": ToolSet([CALCULATOR]), "turn_limits": TurnLimits()}
    )

    async def main():
        try:
            return await asyncio.gather(*(generate(ctx, s, SamplingParams(max_new_tokens=400)) for s in samples))
        finally:
            await router.close()

    done = asyncio.run(main())
    assert all(s.status == Status.COMPLETED and s.metadata["turns"] == 2 for s in done)
    assert slow.served and fast.served  # both engines had work
    for engine in (slow, fast):  # each sample's two turns on one engine
        assert all(engine.served.count(p) == 2 for p in engine.served), (len(slow.served), len(fast.served))
