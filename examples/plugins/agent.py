"""An agent hook: a small tool-using agent written with the ``openai`` SDK, trained by strop.

    strop train examples/configs/agent_calculator.yaml

Nothing in it knows about strop's training: it is the loop anyone writes against the OpenAI API
(ask the model, run the tools it calls, hand back the results, stop at an answer). strop hands it
a base URL and an API key that route every call through the agent proxy, which records the exact
tokens for training (docs/agents.md).

Its one tool, ``python``, runs the model's code in strop's sandbox (strop.tools.sandbox: no
network, no host files, resource limits, a timeout) and returns what it prints. The model calls
it by writing a ```python block, the call format SmolLM2-135M writes by itself (it never writes
``<tool_call>`` JSON unprompted: 0 of 64 samples).
"""

import asyncio
import json
import re
import threading

import openai

TOOLS = [{"type": "function", "function": {
    "name": "python",
    "description": "Run Python code in a sandbox and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}}]
SYSTEM = ("You can run Python: write a ```python code block and you will see what it prints. "
          "Use it for arithmetic. End with the final answer as \\boxed{ANSWER}.")
MAX_TURNS = 3

_sandbox, _loop, _lock = None, None, threading.Lock()


def run_python(code: str) -> str:
    """What ``code`` prints, run in strop's sandbox. Every call goes through one event loop of its
    own (the sandbox hands out its per-call users from a queue that belongs to one loop), so the
    agent's many threads may call it at once."""
    global _sandbox, _loop
    with _lock:
        if _sandbox is None:
            from strop.tools.sandbox import Sandbox

            _sandbox, _loop = Sandbox(), asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="agent-sandbox", daemon=True).start()
    result = asyncio.run_coroutine_threadsafe(_sandbox.run_python(code), _loop).result()
    return result.message() or "(no output)"


def run_tool(call) -> str:
    if call.function.name != "python":
        return f"Error: no tool named {call.function.name!r}"
    try:
        return run_python(json.loads(call.function.arguments)["code"])
    except Exception as exc:  # a bad call, or no sandbox here: the model reads it
        return f"Error: {type(exc).__name__}: {exc}"


def final_answer(text: str | None) -> str | None:
    """The last \\boxed{...} of the model's final message, else its last number."""
    text = text or ""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", boxed[-1] if boxed else text)
    return numbers[-1] if numbers else None


def calculator_agent(base_url: str, api_key: str, row: dict) -> float:
    """Answer ``row['prompt']`` with up to MAX_TURNS model calls; reward 1 for the right number.

    The last call asks for the answer (``tool_choice="none"``: whatever the model writes there is its
    answer, a code block included), so a session ends with an answer rather than an unread call."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    reply = None
    for turn in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=TOOLS, max_tokens=128,
                tool_choice="none" if turn == MAX_TURNS - 1 else "auto").choices[0].message
        except openai.BadRequestError:  # out of budget (the proxy's session caps): no answer
            return 0.0
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    answer = final_answer(reply.content if reply is not None and not reply.tool_calls else None)
    try:
        return float(answer is not None and abs(float(answer) - float(row["label"])) < 1e-6)
    except ValueError:
        return 0.0
