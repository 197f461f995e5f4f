"""A proxy on a real event loop thread, with engines whose logprobs are a real (tiny) model's."""

from __future__ import annotations

import torch

from strop.agents.proxy import AgentProxy
from strop.agents.session import SessionLimits
from strop.rollout.event_loop import EventLoopThread
from strop.types import Completion, SamplingParams, Sample


class ForcedEngine:
    """Answers call k with ``texts[k]`` (tokenised, then the end-of-turn token) and reports the
    logprobs a real model gives those tokens at the sampling temperature: the trainer must
    find the same numbers at the same positions."""

    weight_version = 0

    def __init__(self, model, tokenizer, texts: list[str]):
        self.model, self.tok, self.texts = model, tokenizer, list(texts)
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []

    async def generate(self, prompt_ids, sampling):
        text = self.texts[min(len(self.prompts), len(self.texts) - 1)]  # text, or token ids as sampled
        self.prompts.append(list(prompt_ids))
        ids = (list(text) if isinstance(text, list) else self.tok.encode(text, add_special_tokens=False)) + [
            self.tok.eos_token_id
        ]
        finish = "stop"
        if len(ids) > sampling.max_new_tokens:  # as a sampling engine: cut at the limit, no end token
            ids, finish = ids[: sampling.max_new_tokens], "length"
        self.outputs.append(ids)
        return Completion(
            ids, model_logprobs(self.model, list(prompt_ids), ids, sampling.temperature), finish, self.weight_version
        )

    async def abort_all(self):
        return None

    async def health(self):
        return True


@torch.no_grad()
def model_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of ``response`` after ``prompt`` (the trainer's formula, by hand)."""
    full = torch.tensor([prompt + response])
    logits = model(full).logits[0, len(prompt) - 1 : -1].float() / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


class Stand:
    """A started proxy on its own event loop thread; ``open()`` makes sessions from this thread."""

    def __init__(self, engine, tokenizer, **kw):
        limits = kw.pop(
            "limits", SessionLimits(max_calls=8, max_call_tokens=64, max_response_tokens=512, context_window=2048)
        )
        self.loop = EventLoopThread(60, name="agent-stand")
        self.tokenizer = tokenizer
        self.sampling = kw.pop(
            "sampling", SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=[tokenizer.eos_token_id])
        )
        self.proxy = AgentProxy(engine, tokenizer, limits=limits, stop_token_ids=[tokenizer.eos_token_id], **kw)
        self.loop.run(self.proxy.start())

    def open(self, prompt: str = "What is 2 + 2?", group_id: int = 0, index: int = 0):
        sample = Sample(prompt=prompt, prompt_ids=[1], group_id=group_id, index=index)

        async def go():
            return self.proxy.open(sample, self.sampling)

        return self.loop.run(go())

    def end(self, session, state: str = "completed"):
        async def go():
            self.proxy.end(session, state)
            return session.samples()

        return self.loop.run(go())

    def close(self):
        self.loop.run(self.proxy.close())
        self.loop.close(10)
