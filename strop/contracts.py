"""Contract checks a user can run on their own plugin before spending an hour on a run.

``check_plugin(hook, path)`` imports the plugin, checks its signature against
the hook's contract, then calls it through strop's own call path on synthetic
Samples (a fake engine and a character-level tokenizer, no model) and checks
the result's type and shape. Used by ``strop check-plugin`` and tests/contracts.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import torch

from strop.agents.proxy import AgentProxy
from strop.agents.rollout import prompt_row
from strop.agents.session import SessionLimits
from strop.agents.worker import call_agent
from strop.data.config import DataConfig
from strop.data.sources import _row_from_record
from strop.plugins import HOOKS, _name, call_hook, call_hook_sync, check_result, load_hook
from strop.rollout.generate import RolloutContext, score_group
from strop.rollout.multiturn import TurnLimits, generate
from strop.rollout.reward_adapters import resolve_reward
from strop.tools import ToolSet
from strop.tools.config import ToolsConfig
from strop.types import Completion, SamplingParams, Sample, Status


class CharTokenizer:
    """Token id = character code; enough for plugins that decode or encode text (and, for the
    agent proxy, a ChatML chat template)."""

    eos_token_id = pad_token_id = 0
    chat_template = "chatml"  # (rendered by apply_chat_template below)

    def __len__(self) -> int:
        return 0x110000

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i > 0)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}


class FakeEngine:
    """Answers every prompt with a fixed text; logprobs -0.5 per token."""

    weight_version = 0

    def __init__(self, answer: str = "The answer is 4."):
        self.answer = [ord(c) for c in answer]
        self.calls: list[list[int]] = []

    async def generate(self, prompt_ids, sampling):
        self.calls.append(list(prompt_ids))
        ids = self.answer[: sampling.max_new_tokens]
        return Completion(ids, [-0.5] * len(ids), "stop" if len(ids) == len(self.answer) else "length", 0)

    async def update_weights(self, state_dict, version=None):
        return self.weight_version

    async def abort_all(self):
        return None

    async def health(self):
        return True


def synthetic_group(n: int = 4, group_id: int = 0, scored: bool = True) -> list[Sample]:
    """A finished group: answers '4', '5', '4', '7' to 'What is 2+2?' (label 4)."""
    group = []
    for i in range(n):
        text = f"The answer is {[4, 5, 4, 7][i % 4]}."
        s = Sample(
            prompt="What is 2+2?", prompt_ids=[ord(c) for c in "What is 2+2?"], label="4", group_id=group_id, index=i
        )
        if scored:
            s.append([ord(c) for c in text], [-0.5] * len(text))
            s.response_text, s.status = text, Status.COMPLETED
            s.reward = 1.0 if "4" in text else 0.0
        group.append(s)
    return group


def make_context(reward=None, generate=None, filter=None):
    return RolloutContext(
        engine=FakeEngine(),
        tokenizer=CharTokenizer(),
        config=None,
        step=1,
        generate=generate,
        reward=reward or (lambda sample: 1.0),
        filter=filter,
    )


def run_contract(hook: str, fn) -> str:
    """Call ``fn`` the way strop does on synthetic data; return a one-line description of the result."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    if hook == "reward":
        group = synthetic_group()
        for s in group:
            s.reward = None
        ctx = make_context(reward=fn)

        asyncio.run(score_group(ctx, group))
        return f"rewards {[s.reward for s in group]} for answers {[s.response_text for s in group]}"
    if hook == "generate":
        group = synthetic_group(2, scored=False)
        ctx = make_context(generate=fn)
        out = [asyncio.run(call_hook("generate", fn, ctx=ctx, sample=s, sampling=sampling)) for s in group]
        return f"statuses {[s.status.value for s in out]}, response lengths {[s.response_length for s in out]}"
    if hook == "rollout":
        groups = [synthetic_group(2, g, scored=False) for g in range(2)]
        ctx = make_context()
        out = asyncio.run(call_hook("rollout", fn, ctx=ctx, groups=groups, sampling=sampling))
        return f"{len(out)} groups of sizes {[len(g) for g in out]}"
    if hook == "filter":
        kept = [call_hook_sync("filter", fn, group=g) for g in (synthetic_group(), synthetic_group(4, 1)[:1])]
        return f"keep decisions {kept}"
    if hook == "postprocess":
        out = call_hook_sync("postprocess", fn, samples=synthetic_group(), step=1)
        return f"{len(out)} samples"
    if hook == "advantage":
        mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
        out = call_hook_sync(
            "advantage", fn, rewards=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.tensor([0, 0, 1, 1]), mask=mask
        )
        return f"advantages of shape {tuple(out.shape)}"
    if hook == "policy_loss":
        g = torch.Generator().manual_seed(0)
        logprobs = (-torch.rand(3, 5, generator=g)).requires_grad_(True)
        old = logprobs.detach() + 0.05 * torch.randn(3, 5, generator=g)
        loss, info = call_hook_sync(
            "policy_loss",
            fn,
            logprobs=logprobs,
            old_logprobs=old,
            advantages=torch.tensor([[1.0], [-1.0], [0.5]]),
            mask=torch.ones(3, 5),
        )
        loss.sum().backward()
        if logprobs.grad is None or not torch.isfinite(logprobs.grad).all():
            raise ValueError("policy_loss hook: the loss has no finite gradient with respect to logprobs")
        return f"per-token loss of shape {tuple(loss.shape)}, extra metrics {sorted(info)}"
    if hook == "data_source":
        rows = call_hook_sync("data_source", fn, config=DataConfig(), split="train")
        for i, r in enumerate(rows[:100]):
            _row_from_record(r, f"data_source hook row {i}", "prompt", "label", [])
        return f"{len(rows)} training rows"
    if hook == "tools":
        return _run_tools(fn)
    if hook == "agent":
        return asyncio.run(_run_agent(fn))
    raise ValueError(f"unknown hook {hook!r}")


async def _run_agent(fn) -> str:
    """One session through a real agent proxy whose engine answers every call with a boxed 4."""
    proxy = AgentProxy(FakeEngine("The answer is \\boxed{4}."), CharTokenizer(), limits=SessionLimits())
    await proxy.start()
    try:
        sample = synthetic_group(1, scored=False)[0]
        session = proxy.open(sample, SamplingParams(temperature=1.0, max_new_tokens=64))
        row = prompt_row(sample, "You answer briefly.") | {"session_id": session.id}
        result = await asyncio.get_running_loop().run_in_executor(
            None, call_agent, fn, proxy.base_url, session.key, row
        )
        reward = check_result("agent", fn, {"row": row}, result)
        reward = reward if reward is not None else session.reward
        if not session.calls:
            raise ValueError(
                "agent hook: the agent made no call through the proxy (give base_url and api_key to its OpenAI client)"
            )
        return f"{session.calls} call(s) through the proxy, reward {reward}" + (
            " (none given: needs agent.reward='hook')" if reward is None else ""
        )
    finally:
        await proxy.close()


def synthetic_arguments(schema: dict) -> dict:
    """Arguments a model might write for ``schema``: each property's default, first enum value or
    example, else a plain value of its type (the string '12')."""
    plain = {"string": "12", "integer": 12, "number": 12.0, "boolean": True, "array": [], "object": {}}
    args = {}
    for name, prop in schema.get("properties", {}).items():
        if "default" in prop:
            args[name] = prop["default"]
        elif prop.get("enum"):
            args[name] = prop["enum"][0]
        elif prop.get("examples"):
            args[name] = prop["examples"][0]
        else:
            kind = prop.get("type", "string")
            args[name] = plain.get(kind if isinstance(kind, str) else kind[0], "12")
    return args


class ScriptedEngine(FakeEngine):
    """Answers turn k with texts[k]."""

    def __init__(self, texts: list[str]):
        super().__init__()
        self.texts = texts

    async def generate(self, prompt_ids, sampling):
        text = self.texts[min(len(self.calls), len(self.texts) - 1)]
        self.calls.append(list(prompt_ids))
        ids = [ord(c) for c in text][: sampling.max_new_tokens]
        return Completion(ids, [-0.5] * len(ids), "stop", 0)


def _run_tools(fn) -> str:
    """Call the hook as setup does, then each tool once through the multi-turn rollout: the model
    (a scripted engine) calls it with synthetic arguments and then answers."""
    tools = call_hook_sync("tools", fn, config=ToolsConfig())
    toolset, seen = ToolSet(tools, {t.name: f"tools hook {_name(fn)}" for t in tools}), []
    for tool in tools:
        args = synthetic_arguments(tool.parameters)
        call = json.dumps({"name": tool.name, "arguments": args})
        engine = ScriptedEngine([f"Let me check. <tool_call>{call}</tool_call>", "The answer is 4."])
        ctx = RolloutContext(
            engine=engine,
            tokenizer=CharTokenizer(),
            extra={"tools": toolset, "turn_limits": TurnLimits(observation_template="\n{output}\n")},
        )
        sample = synthetic_group(1, scored=False)[0]
        out = asyncio.run(generate(ctx, sample, SamplingParams(max_new_tokens=4096)))
        if out.metadata["tool_calls"] != 1 or out.status != Status.COMPLETED:
            raise ValueError(
                f"tools hook: tool {tool.name!r} was not called once in a two-turn rollout "
                f"(status {out.status.value}, {out.metadata['tool_calls']} calls)"
            )
        shown = out.metadata["transcript"].split("</tool_call>", 1)[1].strip().split("\n")[0]
        note = " (an error, shown to the model: check the arguments)" if out.metadata["tool_errors"] else ""
        seen.append(f"{tool.name}({json.dumps(args)}) -> {shown[:60]!r}{note}")
    return f"{len(tools)} tool(s): " + "; ".join(seen)


@dataclass
class CheckReport:
    hook: str
    path: str
    signature: str
    result: str

    def __str__(self) -> str:
        return (
            f"ok: {self.path} satisfies the {self.hook} hook contract\n"
            f"  contract: {self.signature}\n  synthetic run: {self.result}"
        )


def check_plugin(hook: str, path: str) -> CheckReport:
    # import and signature (a reward of any shape strop takes, adapted as a run would)
    fn = resolve_reward(path) if hook == "reward" else load_hook(hook, path)
    return CheckReport(hook, path, HOOKS[hook].signature_text(), run_contract(hook, fn))
