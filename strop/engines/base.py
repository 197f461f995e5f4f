"""The one interface every inference engine implements (embedded, HTTP clients)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from strop.types import Completion, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """An inference engine as the rollout sees it.

    ``generate`` is called concurrently for many prompts; an engine batches them
    as it sees fit. Logprobs are those of the sampled tokens under the
    temperature-scaled distribution ``log_softmax(logits / temperature)``
    (before top-k / top-p truncation), so that the trainer, applying the same
    temperature, computes the same numbers.
    """

    weight_version: int

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion: ...

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> int: ...

    async def abort_all(self) -> None: ...

    async def health(self) -> bool: ...
