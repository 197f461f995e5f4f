"""The one interface every inference engine implements (embedded, HTTP clients, the router), and the optional
capabilities some engines add, each a protocol: code asks ``isinstance(engine, Capability)``, never ``getattr``.

This module is the only one that reaches into an engine by attribute name (:class:`EngineWrapper`)."""

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

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> Completion: ...

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> int: ...

    async def abort_all(self) -> None: ...

    async def health(self) -> bool: ...


@runtime_checkable
class Versioned(Protocol):
    """Knows the weight version it serves: the version it last reported holding (never a count kept here)."""

    weight_version: int


@runtime_checkable
class Closable(Protocol):
    """Holds connections or tasks of the run's event loop, released by ``close``."""

    async def close(self) -> None: ...


@runtime_checkable
class Seeded(Protocol):
    """Samples with a generator of this process (the embedded engine), whose state a checkpoint keeps."""

    generator: Any  # a torch.Generator


@runtime_checkable
class Counted(Protocol):
    """Counts failovers and engine events (the router); ``take_counts`` hands those since the last call."""

    def take_counts(self) -> dict[str, int]: ...


@runtime_checkable
class Probed(Protocol):
    """Scores a probe against the trainer's logprobs after each update (the router, with engine.sync_probe):
    ``probe_ids`` the probe's tokens (None: off), ``probe_tolerance`` the largest difference allowed."""

    probe_ids: list[int] | None
    probe_tolerance: float | None

    async def probe(self, ids: list[int], reference: list[float], tolerance: float) -> float: ...


@runtime_checkable
class Metered(Protocol):
    """Counts the bytes of its last weight update: ``bytes_sent`` reached engines, ``bytes_full`` a full sync
    would have moved (0 where the transport does not measure it)."""

    bytes_sent: int
    bytes_full: int


@runtime_checkable
class Stoppable(Protocol):
    """Counts the seconds no request could decode because of a pause or a weight load (the embedded engine)."""

    stopped_seconds: float


@runtime_checkable
class Speculating(Protocol):
    """Drafts tokens and verifies them (the embedded engine with engine.speculative): its metrics since the last
    call (spec_acceptance_rate, spec_tokens_per_forward, spec_draft_rounds_fraction; {} when it decoded nothing)."""

    def take_speculation_stats(self) -> dict[str, float]: ...


@runtime_checkable
class AdapterLoader(Protocol):
    """Loads the LoRA adapter folder ``path`` (strop.wire.lora.peft_files) as weight ``version`` and returns the
    version it then reports: strop serve merges it into the weights it decodes and its checksum of what it merged
    must equal ``checksum``; vLLM and SGLang serve it by name (``policy-v<version>``), unmerged, and ignore
    ``checksum`` (None when no engine of the router computes one)."""

    async def load_adapter(self, path: str, version: int, scaling: float, checksum: str | None) -> int: ...


@runtime_checkable
class GroupMember(Protocol):
    """Joins the trainer's weight-update group with ``group_ranks`` ranks (SGLang: one per TP worker)."""

    group_ranks: int


@runtime_checkable
class InProcess(Protocol):
    """Runs in this process (the embedded engine): ``weights()`` the tensors it decodes with, each once;
    ``tensor_digests()`` a digest of each (strop.wire.digest.tensor_digest, keyed as vLLM's ``/weight_checker``
    keys them: ``dp0:pp0:pcp0:tp0:<name>``), read between batches; ``pause``/``resume`` hold its batches
    (``paused``: the mode it is paused in, or None). What engine.verify_updates overwrites and reads back
    (strop.sync.verify)."""

    paused: str | None

    def weights(self) -> dict[str, Any]: ...

    async def tensor_digests(self) -> dict[str, str]: ...

    async def pause(self, mode: str = "abort") -> None: ...

    def resume(self) -> None: ...


@runtime_checkable
class WeightChecked(Protocol):
    """A server that reports a digest of each tensor it holds (strop serve's ``/weight_checker``, keyed as
    :class:`InProcess` keys them) and which tensors those are (``weights_manifest``), and loads weights from
    a file (``load_weights``): what engine.verify_updates overwrites and reads back (strop.sync.verify)."""

    async def tensor_digests(self) -> dict[str, str]: ...

    async def weights_manifest(self) -> list[tuple[str, str, tuple[int, ...]]] | None: ...

    async def load_weights(self, path, version: int, checksum: str | None = None) -> int: ...


class EngineWrapper:
    """A wrapper that shows the wrapped engine (``self._engine``) through: an attribute it does not have
    itself is the engine's, so hooks read ``ctx.engine.weight_version`` (or the router's state) through it,
    and capability checks see the engine's capabilities."""

    _engine: Any

    def __getattr__(self, name):
        if name == "_engine":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self._engine, name)
