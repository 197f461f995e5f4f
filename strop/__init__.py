"""strop: RL post-training for LLMs. The Python API:

    import strop

    cfg = strop.Config(model={"path": "Qwen/Qwen2.5-0.5B-Instruct"}, train={"steps": 10})
    summary = strop.train(cfg)

``strop.train`` runs in this process the run ``strop train`` runs after reading its command line
(strop.loop's ``train``); it raises where the command prints an error. ``import strop`` loads neither
the config nor torch: they load on first use of ``strop.Config`` or ``strop.train``.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

# loaded on first use: import strop stays cheap (no pydantic, no torch)
_LAZY = ("Config", "ConfigError")


def __getattr__(name: str) -> Any:
    if name == "Config":
        from strop.config import Config as value
    elif name == "ConfigError":
        from strop.configbase import ConfigError as value
    else:
        raise AttributeError(f"module 'strop' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"train"})


def load_config(config: Any = None, **sections: dict) -> Any:
    """A :class:`strop.Config` from a Config (returned as it is), a YAML file's path, or a dict of
    sections (``{"train": {"steps": 1}}``), with ``sections`` merged over it as command-line
    overrides would be. A bad value raises ``strop.ConfigError`` naming the key."""
    import strop.config as config_module

    if isinstance(config, config_module.Config):
        if not sections:
            return config
        config = config.model_dump(mode="json", exclude_unset=True)
    if config is None or isinstance(config, dict):
        overrides = config_module._deep_merge(dict(config or {}), sections)
        return config_module.build_config(overrides=overrides)
    return config_module.build_config(str(config), sections or None)


def _train(config: Any = None, *, resume: bool = False, **sections: dict) -> dict | None:
    """Train with ``config`` (see :func:`strop.load_config`) in this process, as ``strop train`` does on
    one process, and return the run's summary. ``resume``: continue the run in ``config.run.dir``
    from its newest checkpoint. ``strop.train(train={"steps": 1})`` works too."""
    cfg = load_config(config, **sections)
    from strop.loop import train

    return train(cfg, resume=resume)


class _Train:
    """``strop.train``: the API function, which also shows the modules of the ``strop/train/`` package
    (``strop.train.trainer``), whose name it shares."""

    __doc__ = _train.__doc__
    __signature__ = inspect.signature(_train)

    def __call__(self, config: Any = None, *, resume: bool = False, **sections: dict) -> dict | None:
        return _train(config, resume=resume, **sections)

    def __getattr__(self, name: str) -> Any:
        import strop.train  # noqa: F401 (the package: _Strop's setter keeps it aside)

        return getattr(sys.modules["strop.train"], name)

    def __repr__(self) -> str:
        return "<function strop.train>"


class _Strop(types.ModuleType):
    """The strop module: importing the ``strop.train`` package binds it here under the name ``train``
    (the import system does); the binding is kept aside so ``strop.train`` stays the API function."""

    @property
    def train(self) -> _Train:
        return _TRAIN

    @train.setter
    def train(self, package: types.ModuleType) -> None:
        self.__dict__["_train_package"] = package


_TRAIN = _Train()
sys.modules[__name__].__class__ = _Strop

__all__ = ["Config", "ConfigError", "load_config", "train"]
