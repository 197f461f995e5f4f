"""An agent hook: a small tool-using agent written with the ``openai`` SDK, trained by strop.

    strop train --preset agent_calculator

Nothing in it knows about strop: it is the loop anyone writes against the OpenAI API (ask the
model, run the tools it calls, hand back the results, stop at an answer). strop hands it a
base URL and an API key that route every call through the agent proxy, which records the exact
tokens for training (docs/agents.md).

The tool is a calculator that reads Python: the model calls it by writing a ```python block
(the call format SmolLM2-135M writes by itself; it never writes ``<tool_call>`` JSON unprompted,
0 of 64 samples) and sees what the code prints. Only arithmetic, assignments and ``print`` run,
evaluated from the syntax tree by strop's calculator: no code is executed.
"""

import ast
import json
import re

import openai

from strop.tools import calculate

TOOLS = [{"type": "function", "function": {
    "name": "python",
    "description": "Run Python arithmetic (assignments and print) and return what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
}}]
SYSTEM = ("You can run Python: write a ```python code block and you will see what it prints. "
          "Use it for arithmetic. End with the final answer as \\boxed{ANSWER}.")
MAX_TURNS = 3


def run_arithmetic(code: str) -> str:
    """What ``code`` prints, for code made of arithmetic assignments and print calls."""
    names, printed = {}, []

    def value(node) -> str:
        # names are replaced by their values, then the expression goes to strop's calculator
        class Substitute(ast.NodeTransformer):
            def visit_Name(self, n):
                if n.id not in names:
                    raise NameError(f"name {n.id!r} is not defined")
                return ast.parse(names[n.id], mode="eval").body
        return calculate(ast.unparse(Substitute().visit(node)))

    for stmt in ast.parse(code).body:
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets):
            for t in stmt.targets:
                names[t.id] = value(stmt.value)
        elif isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and \
                getattr(stmt.value.func, "id", None) == "print":
            printed.append(" ".join(value(a) for a in stmt.value.args))
        else:
            raise ValueError(f"only arithmetic, assignments and print() run here, not {ast.unparse(stmt)[:60]!r}")
    return "\n".join(printed) or "(nothing printed)"


def run_tool(call) -> str:
    if call.function.name != "python":
        return f"Error: no tool named {call.function.name!r}"
    try:
        return run_arithmetic(json.loads(call.function.arguments)["code"])
    except Exception as exc:  # the model's bad code is an observation, not a crash
        return f"Error: {type(exc).__name__}: {exc}"


def final_answer(text: str | None) -> str | None:
    """The last \\boxed{...} of the model's final message, else its last number."""
    text = text or ""
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    numbers = re.findall(r"-?\d+(?:\.\d+)?", boxed[-1] if boxed else text)
    return numbers[-1] if numbers else None


def calculator_agent(base_url: str, api_key: str, row: dict) -> float:
    """Answer ``row['prompt']`` with up to MAX_TURNS model calls; reward 1 for the right number."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=5)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": row["prompt"]}]
    reply = None
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                               max_tokens=128).choices[0].message
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
