"""strop's extension points: a few plain functions, loaded by import path.

Every hook's signature is defined once here, as a typing Protocol with a
docstring, and in :data:`HOOKS`, which the loader, the call sites and the
contract tests all read. A hook is loaded with :func:`load_hook` (checked
before any model loads) and called only through :func:`call_hook`, which
refuses arguments that differ from the contract (so a call site cannot drift
from its contract unnoticed) and checks the result.

    strop check-plugin --hook reward my_pkg.rewards:score
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from strop.callables import PluginError, is_async
from strop.tools import check_tools
from strop.types import SamplingParams, Sample, SampleInvariantError


# ---- the contracts ---------------------------------------------------------------------------
class RolloutFn(Protocol):
    async def __call__(self, ctx: Any, groups: list[list[Sample]], sampling: SamplingParams) -> list[list[Sample]]:
        """A whole step's rollout: turn groups of PENDING samples (n per prompt) into scored groups.

        Returns the groups to train on (it may drop groups, e.g. by a filter).
        ``ctx`` is a :class:`strop.rollout.generate.RolloutContext` (engine,
        tokenizer, config, step, and the generate / reward / filter hooks).
        Must be async. Default: ``strop.rollout.generate:rollout``.
        """


class GenerateFn(Protocol):
    async def __call__(self, ctx: Any, sample: Sample, sampling: SamplingParams) -> Sample:
        """Produce one sample's response (possibly many turns with tools) and return the sample.

        Grow the response only with ``sample.append`` / ``sample.apply_completion``
        and set ``sample.status`` and ``sample.response_text``. Must be async.
        Default: ``strop.rollout.generate:generate``.
        """


class RewardFn(Protocol):
    def __call__(self, sample: Sample) -> float:
        """Score one finished sample. Sync or async.

        The group form takes ``samples: list[Sample]`` (one prompt's group) and
        returns one float per sample; strop tells them apart by the parameter name.
        Default: ``rollout.reward=math`` (math-verify).
        """


class FilterFn(Protocol):
    def __call__(self, group: list[Sample]) -> bool:
        """Dynamic sampling: keep (True) or drop (False) one scored group. Sync.

        Dropped groups are replaced by groups from new prompts, up to
        ``rollout.filter_max_rounds`` rollout rounds per step.
        """


class PostprocessFn(Protocol):
    def __call__(self, samples: list[Sample], step: int) -> list[Sample] | None:
        """Rollout-data postprocess, just before training: edit samples in place or return a new list. Sync.

        Returning None keeps the (edited) list. Returned samples must keep the
        Sample invariants (checked).
        """


class AdvantageFn(Protocol):
    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Replace the advantage estimator. Sync.

        rewards, group_ids: (N,); mask: (N, T) response tokens. Returns (N,)
        (one advantage per sample) or (N, T) (per token).
        """


class PolicyLossFn(Protocol):
    def __call__(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict]:
        """Replace the policy loss. Sync. All inputs (N, T); advantages may be (N, 1).

        Returns the per-token loss (N, T) (strop aggregates it with
        ``algo.loss_agg``) and a dict of extra per-token boolean/float tensors
        (may be empty).
        """


class DataSourceFn(Protocol):
    def __call__(self, config: Any, split: str) -> list[dict]:
        """Prompt rows for ``split`` ('train' or 'eval'; return [] for no eval set). Sync.

        ``config`` is the ``data`` config section. Each row is a dict with
        ``prompt`` (text or chat messages), optional ``label`` and ``metadata``.
        """


class ToolsFn(Protocol):
    def __call__(self, config: Any) -> list:
        """The tools a multi-turn rollout may call, next to the built-ins of ``tools.enabled``. Sync.

        ``config`` is the ``tools`` config section (limits, sandbox). Returns a list of
        :class:`strop.tools.Tool`: a name, a description, a JSON schema of the arguments (an object
        whose ``properties`` the function takes as keywords) and the function, sync or async,
        returning text. A sync function runs in a thread of its own, so it must be
        thread-safe (write ``async def`` for a resource bound to one thread). An exception
        inside a tool is shown to the model as ``Error: ...``; a result that is not text stops
        the run (a plugin bug). Called once, when the run starts.
        """


class AgentFn(Protocol):
    def __call__(self, base_url: str, api_key: str, row: dict) -> float | None:
        """Run your agent on one prompt row, sync or async (docs/agents.md).

        ``base_url`` is the agent proxy's OpenAI-compatible URL (``.../v1``) and ``api_key`` this
        sample's session: give both to the ``openai`` client (or any OpenAI-speaking code), and
        every call is generated by the run's engines and recorded as exact tokens. ``row`` holds
        ``prompt``, ``messages`` (the prompt as chat messages, system prompt included), ``label``,
        ``metadata`` and ``session_id``. Return the reward (a finite number), or post it to
        ``{base_url}/sessions/{id}/reward``, or return None with ``agent.reward='hook'``. An
        exception fails this sample only. Called in a worker thread or process
        (``agent.workers``), many at once.
        """


@dataclass(frozen=True)
class HookSpec:
    name: str
    protocol: type
    config_key: str  # where the config names it
    mode: str  # "async", "sync" or "either"
    alt_params: tuple[str, ...] | None = None  # a second accepted form (group reward)

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(p for p in inspect.signature(self.protocol.__call__).parameters if p != "self")

    def signature_text(self) -> str:
        sig = inspect.signature(self.protocol.__call__)
        prefix = "async " if self.mode == "async" else ""
        params = [p for n, p in sig.parameters.items() if n != "self"]
        return f"{prefix}def {self.name}{sig.replace(parameters=params)}".replace("'", "")


HOOKS: dict[str, HookSpec] = {
    spec.name: spec
    for spec in (
        HookSpec("rollout", RolloutFn, "plugins.rollout", "async"),
        HookSpec("generate", GenerateFn, "plugins.generate", "async"),
        HookSpec("reward", RewardFn, "rollout.reward", "either", alt_params=("samples",)),
        HookSpec("filter", FilterFn, "plugins.filter", "sync"),
        HookSpec("postprocess", PostprocessFn, "plugins.postprocess", "sync"),
        HookSpec("advantage", AdvantageFn, "plugins.advantage", "sync"),
        HookSpec("policy_loss", PolicyLossFn, "plugins.policy_loss", "sync"),
        HookSpec("data_source", DataSourceFn, "plugins.data_source", "sync"),
        HookSpec("tools", ToolsFn, "plugins.tools", "sync"),
        HookSpec("agent", AgentFn, "plugins.agent", "either"),
    )
}


# ---- loading and checking --------------------------------------------------------------------
def import_path(path: str, hook: str = "plugin") -> Callable:
    """Import ``package.module:function`` (or ``package.module.function``)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # plugins in the working directory import, as with `python -m`
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{hook} hook {path!r}: not an import path like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module itself failing on import
        raise PluginError(
            f"{hook} hook {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attr):
        raise PluginError(f"{hook} hook {path!r}: module {module_name!r} has no attribute {attr!r}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise PluginError(f"{hook} hook {path!r}: {attr!r} is a {type(fn).__name__}, not a function")
    return fn


def check_signature(hook: str, fn: Callable, path: str = "") -> str:
    """Raise PluginError unless ``fn`` fits ``hook``'s contract; return the accepted form's name."""
    spec = HOOKS[hook]
    where = f"{hook} hook {path!r}" if path else f"{hook} hook {getattr(fn, '__qualname__', fn)!r}"
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise PluginError(f"{where}: cannot read its signature") from None
    found = f"{'async ' if is_async(fn) else ''}def {getattr(fn, '__name__', 'fn')}{sig}"
    expected = spec.signature_text()
    if spec.alt_params:
        expected += f"  (or with parameters {spec.alt_params})"

    def fail(why: str):
        raise PluginError(f"{where}: {why}\n  expected: {expected}\n  found:    {found}")

    params = sig.parameters
    if any(p.kind == p.POSITIONAL_ONLY for p in params.values()):
        fail("has positional-only parameters; strop passes arguments by keyword")
    takes_any_keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
    required = tuple(
        n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    )
    form = None
    for contract in [spec.params] + ([spec.alt_params] if spec.alt_params else []):
        # every argument strop passes must be accepted by name, and nothing else may be required
        if all(n in params or takes_any_keyword for n in contract) and set(required) <= set(contract):
            form = contract
            break
    if form is None:
        if len(required) != len(spec.params):
            fail(
                f"requires {len(required)} parameter(s) {required}; the contract passes "
                f"{len(spec.params)}: {spec.params}"
            )
        fail(f"parameter names {required} differ from the contract's {spec.params} (strop passes them by name)")
    if spec.mode == "async" and not is_async(fn):
        fail("must be an async function (async def); strop awaits it")
    if spec.mode == "sync" and is_async(fn):
        fail("must be a plain (sync) function; strop calls it without awaiting")
    return "group" if form == spec.alt_params else "sample"


def load_hook(hook: str, path: str) -> Callable:
    """Import and check a hook before anything heavy runs."""
    if hook not in HOOKS:
        raise PluginError(f"unknown hook {hook!r}; hooks are {sorted(HOOKS)}")
    fn = import_path(path, hook)
    check_signature(hook, fn, path)
    return fn


# ---- calling ---------------------------------------------------------------------------------
def _describe(obj) -> str:
    if isinstance(obj, Sample):
        return f"sample group={obj.group_id} index={obj.index}"
    if isinstance(obj, list) and obj and isinstance(obj[0], Sample):
        return f"group {obj[0].group_id}"
    if isinstance(obj, list) and obj and isinstance(obj[0], list):
        return f"{len(obj)} groups"
    return "the step's batch"


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"


def _check_call_site(hook: str, kwargs: dict) -> None:
    spec = HOOKS[hook]
    if tuple(kwargs) not in (spec.params, spec.alt_params):
        # the call site drifted from the contract: fail loudly in strop's own tests
        raise TypeError(
            f"strop bug: call site of the {hook} hook passes {tuple(kwargs)}, the contract is {spec.params}"
        )


async def call_hook(hook: str, fn: Callable, **kwargs) -> Any:
    """Call a hook exactly as its contract says, await it if needed, and check what it returns."""
    _check_call_site(hook, kwargs)
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        result = await result
    return check_result(hook, fn, kwargs, result)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _finite(x) -> bool:
    return x == x and abs(x) != float("inf")


def _reward(result, kwargs: dict, bad: Callable[[str], None]):
    if "samples" in kwargs:
        if not isinstance(result, (list, tuple)) or len(result) != len(kwargs["samples"]):
            bad(f"returned {type(result).__name__}; expected a list of {len(kwargs['samples'])} floats")
        if not all(_number(x) for x in result):
            bad(f"returned {result!r}; every item must be a float")
        nonfinite = [i for i, x in enumerate(result) if not _finite(x)]
        if nonfinite:
            i = nonfinite[0]
            bad(f"returned {result[i]!r} for sample {i} ({_describe(kwargs['samples'][i])}); rewards must be finite")
        return [float(x) for x in result]
    if not _number(result):
        bad(f"returned {result!r} ({type(result).__name__}); expected a float")
    if not _finite(result):
        bad(f"returned {result!r}; rewards must be finite")
    return float(result)


def _generate(result, kwargs: dict, bad: Callable[[str], None]):
    if not isinstance(result, Sample):
        bad(f"returned {type(result).__name__}; expected the Sample")
    try:
        result.check()
    except SampleInvariantError as exc:
        bad(f"broke the Sample invariants: {exc}")
    if result.status.value == "pending":
        bad("left the sample PENDING; set COMPLETED, TRUNCATED, ABORTED or FAILED")
    return result


def _rollout(result, kwargs: dict, bad: Callable[[str], None]):
    if not isinstance(result, list) or not all(
        isinstance(g, list) and all(isinstance(s, Sample) for s in g) for g in result
    ):
        bad(f"returned {type(result).__name__}; expected a list of groups (lists of Samples)")
    for g in result:
        for s in g:
            s.check()
    return result


def _filter(result, kwargs: dict, bad: Callable[[str], None]):
    if not isinstance(result, bool):
        bad(f"returned {result!r} ({type(result).__name__}); expected True (keep) or False (drop)")
    return result


def _postprocess(result, kwargs: dict, bad: Callable[[str], None]):
    if result is None:
        result = kwargs["samples"]
    if not isinstance(result, list) or not all(isinstance(s, Sample) for s in result):
        bad(f"returned {type(result).__name__}; expected None or a list of Samples")
    for s in result:
        try:
            s.check()
        except SampleInvariantError as exc:
            bad(f"broke the Sample invariants: {exc}")
    return result


def _advantage(result, kwargs: dict, bad: Callable[[str], None]):
    n, t = kwargs["mask"].shape
    if not isinstance(result, torch.Tensor) or tuple(result.shape) not in ((n,), (n, t)):
        got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
        bad(f"returned {got}; expected a tensor of shape ({n},) or ({n}, {t})")
    if not torch.isfinite(result).all():
        bad("returned non-finite advantages")
    return result


def _policy_loss(result, kwargs: dict, bad: Callable[[str], None]):
    shape = tuple(kwargs["logprobs"].shape)
    if not (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], torch.Tensor)
        and isinstance(result[1], dict)
    ):
        bad(f"returned {type(result).__name__}; expected (per-token loss tensor, dict)")
    if tuple(result[0].shape) != shape:
        bad(f"per-token loss has shape {tuple(result[0].shape)}; expected {shape}")
    return result


def _data_source(result, kwargs: dict, bad: Callable[[str], None]):
    if not isinstance(result, list):
        bad(f"returned {type(result).__name__}; expected a list of row dicts")
    return result


def _agent(result, kwargs: dict, bad: Callable[[str], None]):
    if result is not None and not (_number(result) and _finite(result)):
        bad(f"returned {result!r} ({type(result).__name__}); expected a finite reward or None")
    return None if result is None else float(result)


def _tools(result, kwargs: dict, bad: Callable[[str], None]):
    try:
        check_tools(result)
    except (TypeError, ValueError) as exc:
        bad(str(exc))
    return list(result)


# each hook's check of what it returned: (result, the call's kwargs, bad(why) raising PluginError) -> the result
_RESULT_CHECKS = {
    "reward": _reward,
    "generate": _generate,
    "rollout": _rollout,
    "filter": _filter,
    "postprocess": _postprocess,
    "advantage": _advantage,
    "policy_loss": _policy_loss,
    "data_source": _data_source,
    "agent": _agent,
    "tools": _tools,
}


def check_result(hook: str, fn: Callable, kwargs: dict, result: Any) -> Any:
    """What hook ``fn`` returned, checked against its contract (and normalised: floats, a list); a
    PluginError naming the hook, the plugin and the samples it was called on if it broke it."""
    where = f"{hook} hook {_name(fn)}"
    subject = next(
        (kwargs[k] for k in ("sample", "samples", "group", "groups", "logprobs", "rewards") if k in kwargs), None
    )
    where += f" on {_describe(subject)}" if subject is not None else ""  # tools and data_source get no samples

    def bad(why: str):
        raise PluginError(f"{where}: {why}")

    if hook not in _RESULT_CHECKS:
        raise AssertionError(hook)
    return _RESULT_CHECKS[hook](result, kwargs, bad)


def call_hook_sync(hook: str, fn: Callable, **kwargs) -> Any:
    """:func:`call_hook` for sync call sites (the hook itself must be sync)."""
    _check_call_site(hook, kwargs)
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        result.close()
        raise PluginError(f"{hook} hook {_name(fn)} returned an awaitable; it must be a plain (sync) function")
    return check_result(hook, fn, kwargs, result)


__all__ = [
    "HOOKS",
    "HookSpec",
    "PluginError",
    "load_hook",
    "check_signature",
    "call_hook",
    "call_hook_sync",
    "import_path",
]
