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

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code in a sandbox and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]
SYSTEM = (
    "You can run Python: write a ```python code block and you will see what it prints. "
    "Use it for arithmetic. End with the final answer as \\boxed{ANSWER}."
)
MAX_TURNS = 3
OUTPUT_CHARS = 500  # what the model is shown of a run's output (a long traceback would eat its token budget)
PRINTED_CREDIT = 0.5  # a wrong final answer after a run of the model's code printed the right number
RAN_CREDIT = 0.1  # a wrong final answer after its code ran and printed something
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_sandbox, _loop, _lock = None, None, threading.Lock()


def run_python(code: str) -> tuple[str, bool]:
    """What ``code`` prints, run in strop's sandbox, and whether it ran cleanly and printed. Every
    call goes through one event loop of its own (the sandbox hands out its per-call users from a
    queue that belongs to one loop), so the agent's many threads may call it at once."""
    global _sandbox, _loop
    with _lock:
        if _sandbox is None:
            from strop.tools.sandbox import Sandbox

            _sandbox, _loop = Sandbox(), asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="agent-sandbox", daemon=True).start()
    result = asyncio.run_coroutine_threadsafe(_sandbox.run_python(code), _loop).result()
    text = result.message() or "(no output)"
    if len(text) > OUTPUT_CHARS:
        text = text[:OUTPUT_CHARS] + f"\n[output cut at {OUTPUT_CHARS} characters]"
    return text, result.exit_code == 0 and not result.timed_out and bool(result.output.strip())


def run_tool(call) -> tuple[str, bool]:
    """The tool's answer to ``call`` for the model, and whether its code ran and printed."""
    if call.function.name != "python":
        return f"Error: no tool named {call.function.name!r}", False
    try:
        return run_python(json.loads(call.function.arguments)["code"])
    except Exception as exc:  # a bad call, or no sandbox here: the model reads it
        return f"Error: {type(exc).__name__}: {exc}", False


def is_label(number: str | None, label) -> bool:
    try:
        return number is not None and abs(float(number) - float(label)) < 1e-6
    except ValueError:
        return False


def final_answer(text: str | None) -> str | None:
    """The last \\boxed{...} of the model's final message, else its last number."""
    text = text or ""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    numbers = NUMBER.findall(boxed[-1] if boxed else text)
    return numbers[-1] if numbers else None


def last_message(reply) -> str | None:
    """What the model wrote last: the reply's text and, if it called a tool, the code it wrote."""
    if reply is None:
        return None
    code = []
    for call in reply.tool_calls or []:
        try:
            code.append(str(json.loads(call.function.arguments).get("code", "")))
        except (ValueError, AttributeError):
            code.append(call.function.arguments)
    return "\n".join([reply.content or "", *code])


def calculator_agent(base_url: str, api_key: str, row: dict) -> float:
    """Answer ``row['prompt']`` with up to MAX_TURNS model calls; reward 1 for the right number in
    the final answer. A wrong one earns partial credit for the way there: PRINTED_CREDIT if a run
    of the model's code printed the right number, RAN_CREDIT if its code ran and printed anything
    (strop's held-out accuracy counts only rewards >= 1, so only right answers).

    The answer is the model's last message. When that message is a call the agent has no turn left
    to run, the call's code is part of it (a model that writes ``print(1166)`` has said 1166), as the
    ``tool_python`` preset scores its last turn."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    reply, credit = None, 0.0
    for turn in range(MAX_TURNS):
        try:
            reply = (
                client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=128)
                .choices[0]
                .message
            )
        except openai.BadRequestError:  # the session's token budget is spent (the proxy's caps): the last reply stands
            break
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls or turn == MAX_TURNS - 1:
            break
        for call in reply.tool_calls:
            output, ok = run_tool(call)
            if ok:
                printed = any(is_label(x, row["label"]) for x in NUMBER.findall(output))
                credit = max(credit, PRINTED_CREDIT if printed else RAN_CREDIT)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 1.0 if is_label(final_answer(last_message(reply)), row["label"]) else credit
