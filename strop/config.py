"""One typed config tree, composed of the sections that live beside the code they configure
(``strop/<part>/config.py``). Every field has a help text; ``strop train --help`` lists them.

Sources, later wins: the defaults, a preset (strop/presets.py), a YAML file, ``--section.key=value``
overrides on the command line. Unknown keys and bad values fail before any model loads, naming the full
key (``train.lr``) and what was expected; what spans sections is refused by the rules of strop/rules.py.
Here: the composition, loading, merging, secrets and resume.
"""

from __future__ import annotations

import copy
import difflib
import json
import textwrap
import types
import typing
from pathlib import Path

import yaml
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator

from strop.agents.config import AgentConfig
from strop.algo.config import AlgoConfig
from strop.cluster.config import ClusterConfig
from strop.configbase import ConfigError, Section
from strop.data.config import DataConfig
from strop.engines.config import EngineConfig
from strop.envs.config import AGENT_HOOKS, EnvConfig
from strop.observe.config import RunConfig
from strop.parallel.config import ParallelConfig
from strop.plugins_config import PluginsConfig
from strop.presets import PRESETS
from strop.rollout.config import EvalConfig, RewardEndpointConfig, RolloutConfig
from strop.rules import check_rules
from strop.tools.config import ToolsConfig
from strop.train.config import ModelConfig, TrainConfig


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    data: DataConfig = Field(default_factory=DataConfig, description="prompt sources")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="generation and rewards")
    reward: RewardEndpointConfig = Field(
        default_factory=RewardEndpointConfig,
        description="a judge or reward model behind an OpenAI-compatible endpoint (docs/environments.md)",
    )
    algo: AlgoConfig = Field(default_factory=AlgoConfig, description="advantages and policy loss")
    train: TrainConfig = Field(default_factory=TrainConfig, description="optimizer and batching")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation")
    run: RunConfig = Field(default_factory=RunConfig, description="outputs")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the rollout engine: in process or HTTP servers behind a router"
    )
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="multi-process training (strop train --nproc N)"
    )
    plugins: PluginsConfig = Field(default_factory=PluginsConfig, description="hooks by import path (docs/plugins.md)")
    cluster: ClusterConfig = Field(
        default_factory=ClusterConfig,
        description="where processes run: the local machine or a Ray cluster (docs/scale-out.md)",
    )
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="tools for multi-turn rollouts (docs/tools.md)")
    agent: AgentConfig = Field(
        default_factory=AgentConfig,
        description="agent programs behind the OpenAI-compatible proxy (plugins.agent; docs/agents.md)",
    )
    env: EnvConfig = Field(
        default_factory=EnvConfig,
        description="a verifiers or OpenEnv environment, trained through the agent proxy (docs/environments.md)",
    )

    @model_validator(mode="after")
    def _check_rules(self):
        self._environment_hooks()
        check_rules(self)  # the refusals that span sections: one table, strop/rules.py
        return self

    def _environment_hooks(self) -> None:
        """env.verifiers / env.openenv: each sample is an episode run by strop's agent hook for that kind,
        the environment's tasks are the prompts (strop.envs.wiring). A hook of the user's in either place
        would be replaced: refused."""
        kind = self.env.kind
        if kind is None:
            return
        hook = AGENT_HOOKS[kind]
        for name, value in (("agent", self.plugins.agent), ("data_source", self.plugins.data_source)):
            if value and value != (hook if name == "agent" else None):
                raise ValueError(
                    f"env.{kind}={getattr(self.env, kind)!r} runs each sample as an episode of its environment "
                    f"and takes its prompts from it; plugins.{name}={value!r} would replace that: set one of them"
                )
        given = [k for k in ("source", "path", "eval_path", "task", "task_options") if k in self.data.model_fields_set]
        if given:
            raise ValueError(
                f"env.{kind}={getattr(self.env, kind)!r} takes its prompts from the environment; "
                f"data.{given[0]}={getattr(self.data, given[0])!r} would be ignored: remove it"
            )
        if self.plugins.agent != hook:
            self.plugins.agent = hook


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            got = e.get("input")
            got_text = "" if isinstance(got, dict) or key in secret_fields() else f" (got {got!r})"
            lines.append(f"  {key}: {e['msg']}{got_text}")
    return "\n".join(lines)


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def option_names(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """Every option of the command line, dotted (``train.steps``), in the order of the config tree."""
    out = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out += option_names(field.annotation, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def did_you_mean(word: str, choices, prefix: str = "") -> str:
    """`` did you mean X?`` for the choice closest to ``word`` (difflib), or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


def _type_text(ann) -> str:
    """An option's type as the help shows it: ``int``, ``{a,b}``, ``{str,null}``, ``list[str]``."""
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(ann)) + "}"
    if origin in (typing.Union, types.UnionType):
        parts = ("null" if a is type(None) else _type_text(a).strip("{}") for a in typing.get_args(ann))
        return "{" + ",".join(parts) + "}"
    if origin is not None:
        return str(ann).replace("typing.", "")
    if ann is SecretStr:
        return "str"
    return getattr(ann, "__name__", str(ann))


def _default_text(field) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if value is None:
        return "null"
    if isinstance(value, str):
        return value or "''"
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def help_all(prog: str = "strop train") -> str:
    """Every option of the config tree, section by section: its type, help text and default value."""
    lines = [
        f"usage: {prog} [CONFIG.yaml] [--section.key=value | --section.key value ...]",
        "",
        "Every config option (later sources win: defaults, preset, CONFIG.yaml, command line). A section",
        "may also be given whole as JSON: --train='{\"steps\": 3}'. Lists and dicts are JSON too.",
    ]
    for section, sfield in Config.model_fields.items():
        lines += ["", f"{section}: {sfield.description}"]
        for name, field in sfield.annotation.model_fields.items():
            secret_env = "env" in (field.json_schema_extra or {})  # its help names its default
            text = field.description if secret_env else f"{field.description} (default: {_default_text(field)})"
            lines.append(f"  --{section}.{name} {_type_text(field.annotation)}")
            lines += textwrap.wrap(text, 112, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _check_names(args: list[str], prog: str) -> None:
    """Refuse an option that names no config field, with the closest one."""
    known = option_names()
    sections = set(Config.model_fields)
    for arg in args:
        if not arg.startswith("--"):
            continue
        name = arg[2:].split("=", 1)[0]
        if name in sections or any(name == k or name.startswith(k + ".") for k in known):
            continue  # a section as JSON, an option, a key inside a dict option
        raise ConfigError(
            f"unrecognized arguments: {arg}{did_you_mean(name, known, '--')}\n"
            f"  (`{prog} --help-all` lists every option)"
        )


def parse_overrides(args: list[str], prog: str = "strop train") -> dict:
    """Turn ``--section.key=value`` and ``--section.key value`` arguments into a nested dict (only what was
    given). ``--help``: every option, then SystemExit."""
    from pydantic_settings import CliSettingsSource, SettingsError

    if "-h" in args or "--help" in args or "--help-all" in args:  # the full listing, on request only
        print(help_all(prog))
        raise SystemExit(0)
    _check_names(args, prog)
    try:
        return CliSettingsSource(
            Config, cli_parse_args=args, cli_prog_name=prog, cli_implicit_flags=False, cli_exit_on_error=False
        )()
    except SettingsError as exc:
        why = str(exc).removeprefix("error parsing CLI: ")
        raise ConfigError(f"{why}\n  (`{prog} --help-all` lists every option)") from None


def build_config(yaml_path: str | None = None, overrides: dict | None = None, preset: str | None = None) -> Config:
    """Defaults < preset < YAML file < overrides. A YAML file may name a preset with ``preset: NAME``."""
    data: dict = load_yaml(yaml_path) if yaml_path else {}
    preset = preset or data.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(
                f"unknown preset {preset!r}{did_you_mean(preset, PRESETS)} (presets: {', '.join(sorted(PRESETS))})"
            )
        data = _deep_merge(PRESETS[preset](), data)
    origin = f"file {yaml_path!r}" if yaml_path else "defaults"
    if preset:
        origin += f" + preset {preset!r}"
    if overrides:
        data = _deep_merge(data, overrides)
        origin += " + command line"
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, origin)) from None


def secret_fields(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, str]:
    """Every secret field of the config tree: dotted name -> its environment variable."""
    out = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            out |= secret_fields(field.annotation, f"{prefix}{name}.")
        elif "env" in (field.json_schema_extra or {}):
            out[f"{prefix}{name}"] = field.json_schema_extra["env"]
    return out


def save_config(cfg: Config, path: Path) -> None:
    """Write ``cfg`` as YAML, atomically (a resumed run reads it back); secrets are written redacted."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False))
    tmp.replace(path)


# fields that may differ on resume without being allowed: where the run is and how it shows progress
RESUME_FREE = ("run.dir", "run.progress")


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _without(d: dict, keys) -> dict:
    """A copy of ``d`` without the dotted ``keys``."""
    out = copy.deepcopy(d)
    for key in keys:
        *path, name = key.split(".")
        node = out
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(name, None)
    return out


def find_run_dir(which: str, runs: Path = Path("runs")) -> Path:
    """``--resume`` target: a run directory, or ``latest`` (the newest under ./runs with a config)."""
    if which == "latest":
        found = (
            sorted((p for p in runs.iterdir() if (p / "config.yaml").is_file()), key=lambda p: p.stat().st_mtime)
            if runs.is_dir()
            else []
        )
        if not found:
            raise ConfigError(f"--resume latest: no run directory with a config.yaml under {str(runs)!r}")
        return found[-1]
    run_dir = Path(which)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"--resume {which}: not a strop run directory (no config.yaml in {str(run_dir)!r})")
    return run_dir


def resume_config(
    run_dir: Path,
    yaml_path: str | None = None,
    overrides: dict | None = None,
    preset: str | None = None,
    allow: list[str] = (),
) -> Config:
    """The config of a resumed run: the saved one (or the given file / preset) plus ``overrides``.
    A field that differs from the saved config is refused unless named in ``allow``."""
    saved = load_yaml(run_dir / "config.yaml")
    overrides = dict(overrides or {})
    given_dir = overrides.get("run", {}).get("dir")
    if given_dir is not None and Path(given_dir).resolve() != run_dir.resolve():
        raise ConfigError(f"--resume {run_dir} with --run.dir={given_dir}: a run resumes in its own directory")
    if yaml_path or preset:
        cfg = build_config(yaml_path, overrides, preset)
    else:
        try:
            cfg = Config.model_validate(_deep_merge(saved, overrides))
        except ValidationError as err:
            raise ConfigError(_format_validation_error(err, f"{run_dir / 'config.yaml'} + command line")) from None
    cfg.run.dir = str(run_dir)
    known = _flat(json.loads(Config().model_dump_json()))
    unknown = [k for k in allow if k not in known]
    if unknown:
        raise ConfigError(f"--allow-change {','.join(unknown)}: no such config field")
    secrets = secret_fields()  # never compared: the saved config holds them redacted
    try:  # the saved config as this version reads it (fields added since take their defaults)
        before = _flat(json.loads(Config.model_validate(_without(saved, secrets)).model_dump_json()))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, str(run_dir / "config.yaml"))) from None
    after = _flat(json.loads(cfg.model_dump_json()))
    changed = [
        k
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k) and k not in RESUME_FREE and k not in allow and k not in secrets
    ]
    if changed:
        lines = "\n".join(f"  {k}: {before.get(k)!r} -> {after.get(k)!r}" for k in changed)
        raise ConfigError(
            f"--resume {run_dir}: the config differs from the saved one:\n{lines}\n"
            f"  (allow on purpose with --allow-change {','.join(changed)})"
        )
    return cfg
