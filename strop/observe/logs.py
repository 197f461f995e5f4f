"""Where strop's log lines go: the terminal (info on stdout, warnings and errors on stderr, as its lines always
went) and, once a run has a directory, that directory's ``run.log``. One line format for both.

Modules log with ``logging.getLogger(__name__)`` (all under the ``strop`` logger); the command line calls
:func:`setup_logging`, a run calls :func:`attach_run_log` where its directory is made. A program that calls
strop as a library gets the terminal lines too (:func:`console`, as a run starts), unless it configured the
``strop`` logger itself.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
RUN_LOG = "run.log"
EARLY_LINES = 1000  # lines kept from before a run has its directory, to open its run.log with
FILE_ONLY = {"file_only": True}  # ``log.info(..., extra=FILE_ONLY)``: run.log only (the progress bar shows it)

root = logging.getLogger("strop")


class Console(logging.Handler):
    """The terminal: below WARNING on stdout, the rest on stderr; the streams looked up at each line (a test's
    captured streams, a redirected sys.stdout)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        self.addFilter(lambda record: not getattr(record, "file_only", False))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


class RunLog(logging.FileHandler):
    """A run directory's ``run.log``: every line the terminal shows, and the step lines."""


class Early(logging.Handler):
    """The lines shown while no run log is open (the checks before a run's directory exists): its run.log
    starts with them."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        self.lines: deque[str] = deque(maxlen=EARLY_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        if not any(isinstance(h, RunLog) for h in root.handlers):
            self.lines.append(self.format(record))


early = Early()


def setup_logging(level: str = "INFO") -> None:
    """The ``strop`` logger at ``level`` (DEBUG, INFO, WARNING, ERROR), with the terminal handler (once)."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LEVELS)}")
    root.setLevel(level)
    if not any(isinstance(h, Console) for h in root.handlers):
        root.addHandler(Console())
    if early not in root.handlers:
        root.addHandler(early)


def console() -> None:
    """The terminal handler at INFO, unless the ``strop`` logger has handlers already (the command line's,
    or a program's own): a run started from Python shows its lines as one started by ``strop train``."""
    if not root.handlers:
        setup_logging("INFO")


def attach_run_log(run_dir: str | Path) -> logging.Handler:
    """Write every strop log line from now on to ``run_dir/run.log`` too (appended: a resumed run adds to its
    log). One run log at a time: a previous one is closed. It starts with the lines shown since the last run."""
    _remove_run_logs()
    console()
    handler = RunLog(Path(run_dir) / RUN_LOG, encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    handler.setLevel(logging.DEBUG)
    if early.lines:  # what was shown before the directory existed
        handler.stream.write("".join(line + "\n" for line in early.lines))
        early.lines.clear()
    root.addHandler(handler)
    return handler


def close_run_log() -> None:
    """Stop writing to the run log (the run is over): the lines after it are the next run's."""
    early.lines.clear()
    _remove_run_logs()


def _remove_run_logs() -> None:
    for handler in [h for h in root.handlers if isinstance(h, RunLog)]:
        root.removeHandler(handler)
        handler.close()
