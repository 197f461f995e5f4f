"""Reward functions written for other frameworks, taken as they are (docs/migrating.md).

``rollout.reward`` names a built-in reward (``math``), an import path (``pkg.module:function``) or a
file (``path/to/reward.py`` or ``path/to/reward.py:function``, as verl's ``custom_reward_function``
names one). The function's shape is read from its parameters:

- strop: ``fn(sample)`` or ``fn(samples)`` (strop.plugins' reward contract), used as it is;
- TRL (GRPOTrainer): ``fn(completions, **kwargs) -> list[float]``, called once per group;
- verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` -> float or a
  dict with ``"score"``, called once per sample;
- slime (``--custom-rm-path``): ``[async] fn(args, sample)`` or, grouped (``--group-rm``),
  ``fn(args, samples)``.

Where the parameters do not tell, a prefix declares the shape: ``trl:``, ``verl:``, ``slime:`` or
``strop:`` (``rollout.reward=trl:my_rewards:score``). The adapted function is a strop reward hook
(same contract, same result checks), named after the function it wraps.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from strop.plugins import PluginError, check_signature, import_path
from strop.rollout.rewards import BUILTIN_REWARDS
from strop.types import Sample

STYLES = ("strop", "trl", "verl", "slime")
# the names a TRL reward finds the label under, beside the data's label column (data.label_key)
TRL_LABEL_NAMES = ("ground_truth", "solution")
VERL_DEFAULT_DATA_SOURCE = "unknown"
# a file's function, when its path names none: verl's default, then strop's habit
FILE_DEFAULT_FUNCTIONS = ("compute_score", "reward")

SHAPES = (
    "  strop: def reward(sample) -> float   or   def reward(samples) -> list[float]\n"
    "  trl:   def reward(completions, **kwargs) -> list[float]\n"
    "  verl:  def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict\n"
    "  slime: async def reward(args, sample) -> float   or   async def reward(args, samples) -> list[float]\n"
    "  (declare one with a prefix when its parameters do not tell: rollout.reward=trl:pkg.module:function)"
)


def resolve_reward(name: str, cfg: Any = None) -> Callable:
    """``rollout.reward`` as a strop reward hook: a built-in, or a function of any known shape, loaded
    by import path or by file and adapted (checked now, before any model loads). ``cfg``, the run's
    config, gives the label's column name (``data.label_key``) and slime's ``args``."""
    judge = getattr(cfg, "reward", None)  # (cfg: the run's Config, or what a caller has of it)
    if judge is not None and judge.endpoint:  # a judge behind an OpenAI-compatible server (strop.rollout.judge)
        from strop.rollout.judge import JudgeReward

        return JudgeReward(judge).score
    style, target = _split_style(name)
    if style in (None, "strop") and target in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[target]
    fn = load_reward_function(target)
    return adapt_reward(fn, style or detect_style(fn, name), cfg, name)


def _split_style(name: str) -> tuple[str | None, str]:
    head, sep, rest = name.partition(":")
    if sep and head in STYLES and rest:
        return head, rest
    return None, name


def _is_file(target: str) -> bool:
    path = target.rpartition(":")[0] if ":" in target else target
    return path.endswith(".py") or ("/" in path and Path(path).exists())


def load_reward_function(target: str) -> Callable:
    """The function ``target`` names: a file (``x.py`` / ``x.py:fn``), an import path, or a
    misspelled built-in (an error that lists the built-ins)."""
    if _is_file(target):
        path, _, fn_name = target.partition(":") if ".py:" in target else (target, "", "")
        return load_file(path, fn_name or None)
    if ":" not in target and "." not in target:
        close = difflib.get_close_matches(target, BUILTIN_REWARDS, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise PluginError(
            f"rollout.reward={target!r}: no such built-in reward (built-ins: {', '.join(BUILTIN_REWARDS)}){hint}\n"
            "  (or name your own: 'pkg.module:function' or 'path/to/reward.py[:function]')"
        )
    return import_path(target, "reward")


def load_file(path: str, fn_name: str | None = None) -> Callable:
    """Load a reward function from a Python file by its path (not importable as a module). Its
    directory goes on sys.path, so the file may import modules beside it."""
    where = f"reward file {path!r}"
    file = Path(path)
    if not file.is_file():
        raise PluginError(f"{where}: no such file")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:8]
    module_name = f"strop_reward_{file.stem}_{digest}"
    if str(file.resolve().parent) not in sys.path:
        sys.path.insert(0, str(file.resolve().parent))
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        sys.modules.pop(module_name, None)
        if "relative import" in str(exc):
            raise PluginError(
                f"{where}: it uses a relative import ('from .x import y'), which only works inside a package; "
                "make the import absolute (the file's directory is on the path), or name the function by "
                "import path 'pkg.module:function' from the directory above its package"
            ) from None
        raise PluginError(f"{where}: cannot import it: {type(exc).__name__}: {exc}") from None
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise PluginError(f"{where}: failed while loading: {type(exc).__name__}: {exc}") from None
    own = [n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == module_name]
    public = [n for n in own if not n.startswith("_")]
    if fn_name is None:
        fn_name = next((n for n in FILE_DEFAULT_FUNCTIONS if n in own), None)
        if fn_name is None and len(public) == 1:
            fn_name = public[0]
        if fn_name is None:
            raise PluginError(
                f"{where}: has no 'compute_score' or 'reward' function and {len(public)} public functions "
                f"{public}: name one, '{path}:function'"
            )
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise PluginError(f"{where}: has no function {fn_name!r} (its functions: {public})")
    return fn


def detect_style(fn: Callable, name: str = "") -> str:
    """Which framework's shape ``fn`` has, from its parameter names."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        raise PluginError(f"rollout.reward={name!r}: cannot read its signature") from None
    if params[:2] in (["args", "sample"], ["args", "samples"]):
        return "slime"
    if "solution_str" in params:
        return "verl"
    if "completions" in params:
        return "trl"
    try:
        check_signature("reward", fn, name)
        return "strop"
    except PluginError as exc:  # strop's own contract, broken: its precise message, then the other shapes
        raise PluginError(f"{exc}\n  the reward shapes strop takes:\n{SHAPES}") from None


def adapt_reward(fn: Callable, style: str, cfg: Any = None, name: str = "") -> Callable:
    """``fn`` (of shape ``style``) as a strop reward hook."""
    if style == "strop":
        check_signature("reward", fn, name)
        return fn
    label_key = getattr(getattr(cfg, "data", None), "label_key", "label")
    adapted = {
        "trl": lambda: _trl(fn, label_key),
        "verl": lambda: _verl(fn),
        "slime": lambda: _slime(fn, cfg if cfg is not None else SimpleNamespace()),
    }[style]()
    adapted.__name__ = getattr(fn, "__name__", "reward")
    adapted.__qualname__ = f"{getattr(fn, '__qualname__', adapted.__name__)} ({style} shape)"
    adapted.__module__ = getattr(fn, "__module__", None) or "?"
    adapted.strop_adapted = (style, fn)
    return adapted


# ---- the shapes -------------------------------------------------------------------------------
def _accepts(fn: Callable) -> tuple[set[str] | None, set[str]]:
    """(the keyword names ``fn`` takes, None: any), and those it requires."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    named = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    required = {n for n in named if params[n].default is params[n].empty}
    return (None if takes_any else named), required


async def _call(fn: Callable, kwargs: dict, accepted: set[str] | None, required: set[str], shape: str):
    missing = required - set(kwargs)
    if missing:
        raise PluginError(
            f"{shape} reward {getattr(fn, '__qualname__', fn)!r} requires {sorted(missing)}; strop passes "
            f"{sorted(kwargs)} (dataset columns reach it through data.metadata_keys)"
        )
    result = fn(**(kwargs if accepted is None else {k: v for k, v in kwargs.items() if k in accepted}))
    return await result if inspect.isawaitable(result) else result


def completion_of(sample: Sample) -> str | list[dict]:
    """A response as TRL hands it to a reward: text, or (for a chat prompt) one assistant message."""
    if isinstance(sample.prompt, list):
        return [{"role": "assistant", "content": sample.response_text}]
    return sample.response_text


def trl_kwargs(samples: list[Sample], label_key: str = "label") -> dict:
    """What a TRL reward gets for ``samples``: ``prompts``, ``completions``, ``completion_ids``, then each
    dataset column as a list: the label under the data's label column name and under ``ground_truth``
    and ``solution``, and every metadata key (metadata wins over a label name it shares)."""
    labels = [s.label for s in samples]
    kwargs = {
        "prompts": [s.prompt for s in samples],
        "completions": [completion_of(s) for s in samples],
        "completion_ids": [list(s.response_ids) for s in samples],
    }
    for key in (label_key, *TRL_LABEL_NAMES):
        kwargs.setdefault(key, labels)
    for key in dict.fromkeys(k for s in samples for k in s.metadata):
        if key not in ("prompts", "completions", "completion_ids"):
            kwargs[key] = [s.metadata.get(key) for s in samples]
    return kwargs


def _trl(fn: Callable, label_key: str) -> Callable:
    accepted, required = _accepts(fn)

    async def reward(samples: list[Sample]) -> list[float]:
        result = await _call(fn, trl_kwargs(samples, label_key), accepted, required, "TRL-style")
        return list(result) if isinstance(result, tuple) else result

    return reward


def verl_kwargs(sample: Sample) -> dict:
    """What verl's ``compute_score`` gets: ``data_source`` (metadata 'data_source', else 'unknown'),
    ``solution_str`` (the response text), ``ground_truth`` (the label; a verl ``reward_model`` dict's
    'ground_truth') and ``extra_info`` (metadata 'extra_info' if the data has that column, else all the
    metadata)."""
    label = sample.label
    if isinstance(label, dict) and "ground_truth" in label:
        label = label["ground_truth"]
    meta = sample.metadata
    return {
        "data_source": meta.get("data_source") or VERL_DEFAULT_DATA_SOURCE,
        "solution_str": sample.response_text,
        "ground_truth": label,
        "extra_info": meta["extra_info"] if isinstance(meta.get("extra_info"), dict) else dict(meta),
    }


def _score(result, keys: tuple[str, ...], fn: Callable, sample: Sample):
    if isinstance(result, dict):
        key = next((k for k in keys if k in result), None)
        if key is None:
            raise PluginError(
                f"reward {getattr(fn, '__qualname__', fn)!r} on sample group={sample.group_id} "
                f"index={sample.index}: returned a dict without {' or '.join(map(repr, keys))}: {sorted(result)}"
            )
        return result[key]
    return result


def _verl(fn: Callable) -> Callable:
    accepted, required = _accepts(fn)

    async def reward(sample: Sample) -> float:
        return _score(await _call(fn, verl_kwargs(sample), accepted, required, "verl-style"), ("score",), fn, sample)

    return reward


class SlimeSample:
    """A strop Sample as a slime reward reads one: ``prompt``, ``response``, ``label``, ``metadata``,
    ``tokens`` (prompt and response ids), ``response_length``, ``reward``, ``status``, ``index``,
    ``group_index``. ``metadata`` is the sample's own dict."""

    def __init__(self, sample: Sample):
        self.prompt = sample.prompt
        self.response = sample.response_text
        self.label = sample.label
        self.metadata = sample.metadata
        self.tokens = list(sample.prompt_ids) + list(sample.response_ids)
        self.response_length = sample.response_length
        self.reward = sample.reward
        self.status = sample.status.value
        self.index = sample.index
        self.group_index = sample.group_id


def _slime(fn: Callable, args: Any) -> Callable:
    grouped = list(inspect.signature(fn).parameters)[1] == "samples"
    if grouped:

        async def group_reward(samples: list[Sample]) -> list[float]:
            result = fn(args, [SlimeSample(s) for s in samples])
            result = await result if inspect.isawaitable(result) else result
            if isinstance(result, (list, tuple)):  # (a wrong length is reported by strop's result check)
                extra = list(result[len(samples) :])
                result = [_score(r, ("reward", "score"), fn, s) for r, s in zip(result, samples)] + extra
            return result

        return group_reward

    async def reward(sample: Sample) -> float:
        result = fn(args, SlimeSample(sample))
        return _score(await result if inspect.isawaitable(result) else result, ("reward", "score"), fn, sample)

    return reward


__all__ = [
    "STYLES",
    "SlimeSample",
    "adapt_reward",
    "detect_style",
    "load_file",
    "load_reward_function",
    "resolve_reward",
    "trl_kwargs",
    "verl_kwargs",
]
