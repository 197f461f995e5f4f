"""What every config section shares: the section base model, the config error and secret fields.

Torch-free and strop-free: each section module (``strop/<part>/config.py``) builds on this alone, so
``import strop.config`` and ``strop train --help`` load no model code.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator


class ConfigError(ValueError):
    """A config problem, already phrased for the user."""


REDACTED = "**********"  # a secret as written anywhere (pydantic's SecretStr mask)


def secret(env: str, description: str):
    """A secret field (a SecretStr): redacted wherever the config is written, printed or sent;
    unset, it comes from the environment variable ``env``."""
    return Field(
        None,
        validate_default=True,
        json_schema_extra={"env": env},
        description=f"{description} (a secret: never written or logged; default: the environment variable {env})",
    )


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _secret_value(cls, value, info):
        """A secret field: unset, from its environment variable; the mask of a saved config is never
        the secret itself, so it must come from there too (a resumed run), or the config is refused."""
        env = (cls.model_fields[info.field_name].json_schema_extra or {}).get("env")
        if env is None:
            return value
        raw = value.get_secret_value() if isinstance(value, SecretStr) else value
        if raw is None or raw == "":
            return os.environ.get(env) or None
        if raw == REDACTED:
            if os.environ.get(env):
                return os.environ[env]
            raise ValueError(
                f"holds the redacted mask {REDACTED!r} (a saved config never holds the secret): "
                f"set the environment variable {env}"
            )
        return value
