"""The calculator agent of docs/agents.md (examples/plugins/agent.py), run unchanged through the real
proxy, with an engine that writes a given exchange: which answer it scores, and that its tool ran."""

import pytest

from examples.plugins.agent import calculator_agent
from strop.agents.session import SessionLimits
from tests.agents.stand import ForcedEngine, Stand
from tests.test_e2e import _need_sandbox
from tests.tiny import make_tiny_model

ROW = {"prompt": "Calculate 50 / 25.", "label": "2"}
RUN = "```python\nprint(50 / 25)\n```"


@pytest.fixture(scope="module", autouse=True)
def sandbox():
    _need_sandbox()


@pytest.fixture
def run_agent(tokenizer):
    stands = []

    def run(texts: list[str], max_calls: int = 8) -> tuple[float, ForcedEngine, list]:
        engine = ForcedEngine(make_tiny_model().eval(), tokenizer, texts)
        limits = SessionLimits(max_calls=max_calls, max_call_tokens=128, max_response_tokens=1024, context_window=4096)
        stand = Stand(engine, tokenizer, limits=limits, describe_tools=False)
        stands.append(stand)
        session = stand.open(ROW["prompt"])
        reward = calculator_agent(stand.proxy.base_url, session.key, ROW)
        return reward, engine, stand.end(session)

    yield run
    for s in stands:
        s.close()


def test_the_tool_runs_and_the_final_message_is_the_answer(run_agent, tokenizer):
    """1 for the right number in the last message; a wrong one gets 0.5 if the model's code printed
    the right number, 0.1 if its code ran and printed something else, 0 if it failed or never ran."""
    reward, engine, (sample,) = run_agent([RUN, "So it is \\boxed{2}."])
    assert reward == 1.0 and len(engine.prompts) == 2
    assert "2.0" in tokenizer.decode(engine.prompts[1][len(engine.prompts[0]) :])  # the sandbox's output
    assert run_agent([RUN, "So it is \\boxed{3}."])[0] == 0.5
    assert run_agent(["```python\nprint(50 - 25)\n```", "So it is \\boxed{3}."])[0] == 0.1
    assert run_agent(["So it is \\boxed{2}."])[0] == 1.0 and run_agent(["So it is 3."])[0] == 0.0
    failed = "```python\nprint(2)\nprint(undefined)\n```"
    reward, engine, _ = run_agent([failed, "So it is \\boxed{3}."])  # it printed 2, then failed: no credit
    assert reward == 0.0 and "NameError" in tokenizer.decode(engine.prompts[1])


def test_a_long_output_is_cut_for_the_model(run_agent, tokenizer):
    from examples.plugins.agent import OUTPUT_CHARS

    _, engine, _ = run_agent(["```python\nprint('x' * 5000)\n```", "Done."])
    shown = tokenizer.decode(engine.prompts[1][len(engine.prompts[0]) :])
    assert f"[output cut at {OUTPUT_CHARS} characters]" in shown and shown.count("x") <= OUTPUT_CHARS + 10


def test_a_last_call_with_no_turn_left_is_read_as_the_answer(run_agent, tokenizer):
    """Three calls, the third a call the agent cannot run: its code is the model's answer, and what
    the engine wrote after the call is not (the proxy ends a call's turn at the call)."""
    texts = [RUN, "```python\nprint(2.0)\n```", "```python\nprint(2.0)\n```\nOr maybe 7."]
    reward, engine, (sample,) = run_agent(texts)
    assert reward == 1.0 and len(engine.prompts) == 3
    assert "maybe 7" not in tokenizer.decode(sample.response_ids)
    assert run_agent(texts[:2] + ["```python\nprint(7)\n```"])[0] == 0.5  # its runs printed 2.0


def test_a_session_out_of_calls_keeps_its_last_reply(run_agent):
    """The proxy refuses the third call (agent.max_calls=2): the agent's last reply stands."""
    reward, engine, _ = run_agent([RUN, "```python\nprint(2.0)\n```", "It is 7."], max_calls=2)
    assert reward == 1.0 and len(engine.prompts) == 2
