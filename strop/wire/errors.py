"""What an engine's answer can be wrong in, as errors both sides raise, and the one reader of a weight version."""

from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine did not answer (connection refused or reset, timeout, 5xx) after every retry."""


class EngineRequestError(ValueError):
    """The engine refused the request (4xx): retrying would not help."""


class EngineRefusedError(EngineRequestError):
    """The engine answered the request with HTTP 4xx (``status``): with 400, 413 or 422 the request itself
    was malformed (the agent proxy answers its client so); the others say the client is misconfigured."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class EngineVersionError(EngineRequestError):
    """The engine reported a weight version strop cannot read, or none where one is needed."""


class EngineReceiptError(EngineRequestError):
    """An engine's receipt of an update (its version, checksum or probe) disagrees with what the trainer
    sent: it must not serve, and the step fails naming it."""


class EngineManifestError(EngineRequestError):
    """The engine's tensors (names, shapes, dtypes) differ from the trainer's: refused before any byte moves."""


# the label SGLang and vLLM report before any update (server flag --weight-version): the weights they started with
INITIAL_VERSION_LABELS = ("default",)


def parse_weight_version(value, where: str) -> int:
    """The one place an engine's weight version is read: an integer (or its decimal string), or an
    initial label (``"default"``: the weights the server started with, version 0). Anything else
    (missing, another string, a float, a negative number) is an :class:`EngineVersionError` naming
    the engine: a version strop cannot compare is never guessed."""
    if isinstance(value, bool):
        raise EngineVersionError(f"{where}: weight version {value!r} is not an integer")
    if isinstance(value, int) and value >= 0:
        return value
    if isinstance(value, str):
        if value in INITIAL_VERSION_LABELS:
            return 0
        if value.isascii() and value.isdigit():
            return int(value)
    raise EngineVersionError(
        f"{where}: weight version {value!r} is not an integer strop set (strop labels every "
        f"update with its integer version; {INITIAL_VERSION_LABELS[0]!r} means initial weights)"
    )
