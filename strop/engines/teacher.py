"""On-policy distillation's teacher behind a server: the logprobs an engine gives the student's own tokens
(``strop serve`` and SGLang: ``input_token_logprobs``; vLLM: ``prompt_logprobs``), at temperature 1."""

from __future__ import annotations

import asyncio

from strop.types import Sample


class RemoteTeacher:
    """Scores a step's samples on the server at ``url`` (``kind`` strop, sglang or vllm): for each sample the
    teacher's logprob of every response token given everything before it. Called from the trainer's thread,
    which holds no event loop of its own: each call runs its requests, all at once, on a short-lived one."""

    def __init__(self, url: str, kind: str = "strop", *, timeout_s: float = 600.0):
        self.url, self.kind, self.timeout_s = url, kind, timeout_s

    def __repr__(self) -> str:
        return f"RemoteTeacher({self.kind} at {self.url})"

    def __call__(self, samples: list[Sample]) -> list[list[float]]:
        return asyncio.run(self._score(samples))

    async def _score(self, samples: list[Sample]) -> list[list[float]]:
        from strop.engines.http import SGLangEngine
        from strop.engines.vllm import VLLMEngine

        client = (VLLMEngine if self.kind == "vllm" else SGLangEngine)(self.url, timeout_s=self.timeout_s)
        try:  # a sequence's logprob j is that of token j + 1: the response's start at len(prompt) - 1
            scored = await asyncio.gather(*[client.score(s.prompt_ids + s.response_ids) for s in samples])
        finally:
            await client.close()
        return [lp[len(s.prompt_ids) - 1:] for s, lp in zip(samples, scored)]
