"""Process trees from /proc, for the tests that check what a run leaves behind: every descendant a
``strop train`` ever had, and which of them still live (a zombie counts as gone: here nobody reaps
what is re-parented to init)."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/<pid>/stat), None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(x) for x in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of ``pid``: pid -> start time (a reused pid has another)."""
    found, todo = {}, [pid]
    while todo:
        for child in _children(todo.pop()):
            start = _start_time(child)
            if start is not None and child not in found:
                found[child] = start
                todo.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(seen: dict[int, str]) -> list[str]:
    return [f"{pid}: {_cmdline(pid)}" for pid, start in seen.items() if _start_time(pid) == start]


class Run:
    """``strop train`` in a subprocess, watched: its output, and every descendant it ever had."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strop.cli", "train", *args],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.lines, self.seen = [], {}
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def watch(self, until, timeout_s: float) -> None:
        """Record descendants until ``until()`` holds or the trainer exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None and not until():
            self.seen |= _descendants(self.proc.pid)
            time.sleep(0.05)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def servers(self) -> list[int]:
        return [pid for pid in self.seen if " serve " in _cmdline(pid)]

    def cleanup(self) -> None:
        """Whatever the test found, end what this test started (by pid)."""
        for pid, start in self.seen.items():
            if _start_time(pid) == start:
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
