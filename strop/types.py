"""The data types that flow through every stage: Sample, Status, Completion, SamplingParams."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any, Literal


class Status(str, enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"  # the engine stopped on a stop token
    TRUNCATED = "truncated"  # hit max_new_tokens or the context window
    ABORTED = "aborted"  # cancelled (weight update, shutdown); never trained on
    FAILED = "failed"  # an error in generate, tools or reward; never trained on

    @property
    def trainable(self) -> bool:
        return self in (Status.COMPLETED, Status.TRUNCATED)


FinishReason = Literal["stop", "length", "abort"]
_FINISH_TO_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


class SampleInvariantError(ValueError):
    """A Sample's per-token lists disagree in length, or a value is out of range (or cannot be checkpointed)."""


# what a checkpoint's safe loader (torch.load(weights_only=True), strop.checkpoint) reads back, as such
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_CONVERTS = "use Python numbers, strings, lists, tuples, dicts or torch tensors"


def checkpointable(value: Any, where: str) -> Any:
    """``value`` as a checkpoint holds it: Python scalars, strings, lists, tuples, sets, dicts, torch tensors and
    samples are kept; numpy scalars become Python scalars and numpy arrays lists (what ``.item()`` and
    ``.tolist()`` give), subclasses of str, int and float their base type (a str-valued enum, say), recursively.
    Anything else raises SampleInvariantError naming ``where`` and the path inside it. Returns ``value`` itself
    when nothing had to change."""
    kind = type(value)
    if kind in _SCALARS or kind in (Status, Sample):
        if kind is Sample:  # (an agent's extra samples travel in metadata)
            value.make_checkpointable()
        return value
    numpy = sys.modules.get("numpy")  # (a numpy value means numpy is imported)
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        plain = value.tolist()
        if type(plain) is kind or isinstance(plain, (numpy.generic, numpy.ndarray)):  # (an object it cannot convert)
            raise SampleInvariantError(
                f"{where}: {kind.__module__}.{kind.__qualname__} cannot be saved in a checkpoint; {_CONVERTS}"
            )
        return checkpointable(plain, where)
    torch = sys.modules.get("torch")
    if torch is not None and kind is torch.Tensor:
        return value
    if isinstance(value, dict):
        out = {checkpointable(k, f"{where} key {k!r}"): checkpointable(v, f"{where}[{k!r}]") for k, v in value.items()}
        same = kind is dict and all(a is b for a, b in zip(out, value)) and all(out[k] is value[k] for k in value)
        return value if same else out
    if isinstance(value, (list, tuple, set)):
        items = [checkpointable(v, f"{where}[{i}]") for i, v in enumerate(value)]
        base = set if isinstance(value, set) else tuple if isinstance(value, tuple) else list
        same = kind is base and all(a is b for a, b in zip(items, value))
        return value if same else base(items)
    for base in (bool, int, float, complex, str, bytes):
        if isinstance(value, base):  # a subclass: its plain value
            return base(value) if base is not str else str.__str__(value)
    raise SampleInvariantError(
        f"{where}: {kind.__module__}.{kind.__qualname__} cannot be saved in a checkpoint; {_CONVERTS}"
    )


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class Completion:
    """What any engine returns for one prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: int
    # per token, the version of the weights that sampled it, when a request spans an update (a kept or
    # retracted request); None: every token is ``weight_version``'s
    token_versions: list[int] | None = None
    # routed-expert (MoE) models on strop's decoder: the experts each token was routed to, an int16 tensor
    # [prompt + response tokens but the last, MoE layers, top_k] (strop.serving.moe); None for a dense model
    routed_experts: Any = None

    def cut(self, keep: int, finish_reason: FinishReason = "stop") -> "Completion":
        """This completion's first ``keep`` tokens, with their logprobs, versions and routes (a stop string or a
        tool call's end found in the text)."""
        drop = len(self.token_ids) - keep
        routes = self.routed_experts  # all but the last token's: with tokens dropped, the kept last one's too
        if routes is not None and drop:
            routes = routes[: len(routes) - drop + 1]
        return Completion(
            list(self.token_ids[:keep]),
            list((self.logprobs or [])[:keep]),
            finish_reason,
            self.weight_version,
            None if self.token_versions is None else list(self.token_versions[:keep]),
            routes,
        )


@dataclass
class Sample:
    """One response to one prompt, with everything the trainer needs.

    ``response_ids`` is everything after the prompt (tool output included); the
    per-token lists ``rollout_logprobs``, ``loss_mask`` and ``weight_versions``
    always have its length. Use :meth:`append` to grow a response. ``label`` and
    ``metadata`` hold only what a checkpoint can (:meth:`make_checkpointable`).
    """

    prompt: str | list[dict]
    prompt_ids: list[int]
    label: Any = None
    group_id: int = 0
    index: int = 0
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    response_text: str = ""
    reward: float | None = None
    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    # routed-expert (MoE) models: the experts the engine routed each token to, an int16 tensor
    # [prompt + response tokens, MoE layers, top_k]; -1 where no engine call recorded one (:meth:`take_routes`)
    routed_experts: Any = None

    def __post_init__(self) -> None:
        self.make_checkpointable()
        self.check()

    def make_checkpointable(self) -> None:
        """Convert ``label`` and ``metadata`` to what a checkpoint holds (:func:`checkpointable`: numpy values
        become Python ones), or refuse what it cannot hold, naming the sample and the path, e.g.
        ``sample group=3 index=1 metadata['entry']['when']``. Run when a sample is made and again on every
        sample a checkpoint saves (hooks may have added to them since)."""
        where = f"sample group={self.group_id} index={self.index}"
        self.label = checkpointable(self.label, f"{where} label")
        if not isinstance(self.metadata, dict):
            raise SampleInvariantError(f"{where}: metadata must be a dict, got {type(self.metadata).__name__}")
        self.metadata = checkpointable(self.metadata, f"{where} metadata")

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def append(
        self, ids: list[int], logprobs: list[float] | None = None, *, trainable: bool = True, weight_version: int = -1
    ) -> None:
        """Append response tokens, keeping every per-token list in step.

        Trainable tokens must come with their sampling logprobs (the trainer
        compares against them); non-trainable tokens (tool output) get mask 0
        and logprob 0.0.
        """
        ids = [int(t) for t in ids]
        if logprobs is None:
            if trainable and ids:
                raise SampleInvariantError(
                    f"sample group={self.group_id} index={self.index}: trainable tokens need logprobs"
                )
            logprobs = [0.0] * len(ids)
        if len(logprobs) != len(ids):
            raise SampleInvariantError(
                f"sample group={self.group_id} index={self.index}: {len(ids)} token ids but {len(logprobs)} logprobs"
            )
        self.response_ids.extend(ids)
        self.rollout_logprobs.extend(float(x) for x in logprobs)
        self.loss_mask.extend([1 if trainable else 0] * len(ids))
        self.weight_versions.extend([weight_version] * len(ids))
        if self.routed_experts is not None and ids:  # the new tokens have no routes until an engine call says
            routes = self.routed_experts
            self.routed_experts = routes.new_full((len(routes) + len(ids), *routes.shape[1:]), -1)
            self.routed_experts[: len(routes)] = routes
        self.check()

    def take_routes(self, routes, seen: list[int]) -> None:
        """Record one engine call's routed experts: ``routes`` (int16 [tokens, MoE layers, top_k]) of the token ids
        ``seen`` (the call's prompt, then what it generated; the routes cover ``seen[:len(routes)]``, all but the
        last token when the engine never fed it back in; a completion cut short keeps its longer routes).

        They are taken for the longest common prefix of ``seen`` and this sample's tokens: a token's route is a
        function of the tokens up to it, so a call whose prompt is not the sample's own tokens (a chat turn
        rendered again, a tool call's tail dropped) gives routes only where the two agree, never shifted. The
        newest call wins there (one engine forward over the whole prefix, the weights nearest the trainer's);
        past it an earlier call's routes stay, or -1 (the trainer's router chooses)."""
        if routes is None:
            return
        import torch  # routes come only from a torch engine; this module stays light

        seq = self.prompt_ids + self.response_ids
        n = min(len(routes), len(seq), len(seen))  # routes past ``seen``: tokens cut from the completion
        agree = next((i for i in range(n) if seq[i] != seen[i]), n)
        old = self.routed_experts
        if old is None or tuple(old.shape[1:]) != tuple(routes.shape[1:]):
            old = torch.full((0, *routes.shape[1:]), -1, dtype=torch.int16)
        out = torch.full((len(seq), *routes.shape[1:]), -1, dtype=torch.int16)
        out[: min(len(old), len(seq))] = old[: len(seq)]
        out[:agree] = routes[:agree].to(torch.int16)
        self.routed_experts = out

    def apply_completion(self, completion: Completion, prompt: list[int] | None = None) -> None:
        """Append an engine completion and set the status from its finish reason. ``prompt``: the ids the engine
        was given (default: this sample's tokens so far), to place the completion's routed experts."""
        seen = (self.prompt_ids + self.response_ids if prompt is None else list(prompt)) + list(completion.token_ids)
        self.append(completion.token_ids, completion.logprobs, weight_version=completion.weight_version)
        routes = completion.routed_experts
        if routes is not None and len(routes) not in (len(seen) - 1, len(seen)):
            raise SampleInvariantError(
                f"sample group={self.group_id} index={self.index}: the engine returned routes for {len(routes)} "
                f"tokens, but its call had {len(seen) - len(completion.token_ids)} prompt and "
                f"{len(completion.token_ids)} generated tokens (a generate function that prompts the engine with "
                "other tokens than the sample's passes them: apply_completion(completion, prompt=...))"
            )
        self.take_routes(routes, seen)
        versions = completion.token_versions
        if versions is not None and completion.token_ids:
            if len(versions) != len(completion.token_ids):
                raise ValueError(
                    f"sample group={self.group_id} index={self.index}: {len(completion.token_ids)} token ids but "
                    f"{len(versions)} token versions"
                )
            self.weight_versions[-len(versions) :] = [int(v) for v in versions]
        self.status = _FINISH_TO_STATUS[completion.finish_reason]

    def reset_response(self) -> None:
        """Start the response over (a retried or requeued sample)."""
        self.response_ids, self.rollout_logprobs = [], []
        self.loss_mask, self.weight_versions = [], []
        self.response_text, self.reward, self.status = "", None, Status.PENDING
        self.routed_experts = None

    def check(self) -> None:
        n = len(self.response_ids)
        lengths = {
            "rollout_logprobs": len(self.rollout_logprobs),
            "loss_mask": len(self.loss_mask),
            "weight_versions": len(self.weight_versions),
        }
        bad = {k: v for k, v in lengths.items() if v != n}
        if self.routed_experts is not None and len(self.routed_experts) != self.total_length:
            bad["routed_experts (prompt + response)"] = len(self.routed_experts) - len(self.prompt_ids)
        if bad:
            raise SampleInvariantError(
                f"sample group={self.group_id} index={self.index}: response has {n} tokens but "
                + ", ".join(f"{k} has {v}" for k, v in bad.items())
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise SampleInvariantError(
                f"sample group={self.group_id} index={self.index}: loss_mask must hold only 0 and 1"
            )
        if not isinstance(self.status, Status):
            raise SampleInvariantError(
                f"sample group={self.group_id} index={self.index}: status {self.status!r} is not a Status"
            )
