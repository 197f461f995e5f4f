"""Run model-written Python in a sandbox: a separate process that sees no network, no host files
but the system's read-only ``/usr`` and a fresh, size-limited ``/tmp``, under CPU-time, memory,
process-count and file-size limits, with a wall-clock timeout that kills everything it started,
a scrubbed environment, and its output capped while it is read.

Isolation, best first (``isolation="auto"``):

- ``bwrap``: bubblewrap (Debian package ``bubblewrap``): new user, mount, pid, network, ipc and
  uts namespaces; ``/usr`` bound read-only; fresh ``/proc``, ``/dev`` and ``/tmp`` (a tmpfs);
  all capabilities dropped; dies with its parent.
- ``namespaces``: the same built from util-linux (``unshare``, ``mount``, ``chroot``,
  ``setpriv``) where bubblewrap is missing: a root tmpfs made read-only, ``/usr`` bound
  read-only, a tmpfs at ``/tmp``, the capability bounding set emptied.
- ``none``: only resource limits, a scrubbed environment and a timeout. Model code then reads
  and writes whatever the user running strop can; strop refuses it unless asked for by name.

Totals per call, on top of the per-process limits: the memory of all the call's processes
together (a cgroup of its own where this process may make one, else a watchdog that sums their
resident memory), and the bytes and files of its ``/tmp`` (a size-limited tmpfs, watched too); what a call
holds is measured from outside it by :mod:`strop.tools.watch`.
A call past a total is stopped and the model reads why. Every call also runs under a seccomp
filter that refuses the keyring system calls (``add_key``, ``request_key``, ``keyctl``): every
process inherits the session keyring of the one that started it, so without it model code could
read and add the host's keys. Under bubblewrap it cannot create user namespaces either
(``--disable-userns``) unless ``nested_userns`` is set; under ``namespaces`` the chroot always
refuses them.

Both isolated modes run as an unprivileged uid of their own when strop runs as root (call slot
``i`` as uid ``SANDBOX_UID + i``): host files owned by root are never the sandbox's, and the
process limit counts that one call's processes (it counts per uid). Without root the sandbox
runs as the user, and the process limit is set above the user's current process count.
Every call runs in its own process group and pid namespace; when its first process ends (or is
killed at the timeout) the kernel ends everything else it started.

Calls never block the event loop (asyncio subprocesses) and at most ``max_concurrency`` run at
once (one semaphore, taken once per call).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from strop.tools.isolation import (
    SandboxUnavailable,
    boot_args,
    bwrap_command,
    keyring_filter,
    namespaces_command,
)
from strop.tools.watch import (
    CallCgroup,
    kill_group,
    memory_cgroup,
    process_tree,
    processes_of,
    resident_bytes,
    tmp_usage,
)

SANDBOX_UID = 200_000  # as root, concurrent call i runs as uid SANDBOX_UID + i (no passwd entry needed)
ISOLATIONS = ("bwrap", "namespaces", "none")
WATCH_S = 0.2  # how often a running call's memory and /tmp are measured


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock, then the whole process tree is killed
    cpu_s: int = 10  # RLIMIT_CPU
    memory_mb: int = 1024  # RLIMIT_AS per process
    processes: int = 64  # RLIMIT_NPROC (the sandbox user's processes)
    file_mb: int = 16  # RLIMIT_FSIZE: the largest file it may write
    open_files: int = 64  # RLIMIT_NOFILE
    output_bytes: int = 16_384  # stdout + stderr kept; past this the run is stopped
    memory_total_mb: int = 512  # all the call's processes together (a cgroup, else a watchdog)
    tmp_mb: int = 64  # bytes in its /tmp (a tmpfs of this size)
    tmp_files: int = 4096  # files and directories in its /tmp


@dataclass
class RunResult:
    output: str  # stdout and stderr interleaved, at most limits.output_bytes (decoded, errors replaced)
    exit_code: int | None  # None when it was killed
    timed_out: bool = False
    truncated: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def message(self) -> str:
        """The text a model sees: the output, then a visible marker for anything cut or stopped."""
        parts = [self.output.rstrip("\n")] if self.output else []
        if self.truncated:
            parts.append(f"[output truncated: more than {len(self.output.encode())} bytes; the run was stopped]")
        if self.timed_out:
            parts.append(f"[timed out after {self.seconds:.1f} s; the run was stopped]")
        elif self.exit_code is not None and self.exit_code > 128:
            sig = self.exit_code - 128
            why = {
                int(signal.SIGXCPU): "the CPU time limit",
                int(signal.SIGKILL): "SIGKILL",
                int(signal.SIGXFSZ): "the file size limit",
                int(signal.SIGSEGV): "a segmentation fault",
            }
            parts.append(f"[killed by {why.get(sig, f'signal {sig}')}]")
        elif self.exit_code not in (0, None):
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts + self.notes)


def _system_python() -> str:
    """A Python interpreter under /usr (visible inside the sandbox)."""
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(cand):
            return os.path.realpath(cand)
    raise SandboxUnavailable(
        "no Python interpreter under /usr/bin or /usr/local/bin for the sandbox; "
        "pass Sandbox(python=...) with one under /usr"
    )


def _host_env(cwd: Path) -> dict[str, str]:
    """The environment of the sandbox's launcher (the sandboxed program gets its own, scrubbed)."""
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8", "HOME": str(cwd), "PYTHONUNBUFFERED": "1"}


def _probe(cmd: list[str], cwd: Path) -> bool:
    try:
        out = subprocess.run(
            cmd, cwd=cwd, env=_host_env(cwd), stdin=subprocess.DEVNULL, capture_output=True, timeout=20
        )
        return out.returncode == 0 and out.stdout.strip() == b"ok"
    except (OSError, subprocess.TimeoutExpired):
        return False


class Sandbox:
    def __init__(
        self,
        limits: Limits | None = None,
        *,
        isolation: str = "auto",
        python: str | None = None,
        max_concurrency: int = 8,
        nested_userns: bool = False,
    ):
        """``isolation``: "auto" (bwrap, else namespaces, else refuse), or one of ``ISOLATIONS``
        by name ("none" is the explicit opt-out: no filesystem or network isolation).
        ``nested_userns``: let the code create user namespaces (bubblewrap only)."""
        self.limits = limits or Limits()
        self.python = python or _system_python()
        self.as_nobody = os.geteuid() == 0
        self.nested_userns = nested_userns
        self._filter = keyring_filter().hex()
        self._cgroup = memory_cgroup()  # (directory, version) that calls' cgroups are made in, or None
        self.isolation = self._choose(isolation)
        self.max_concurrency = max_concurrency
        self._slots: tuple | None = None  # (event loop, queue of the uids free for a call; None without root)

    def describe(self) -> str:
        how = {
            "bwrap": "bubblewrap (user, mount, pid, network, ipc, uts namespaces; /usr read-only)",
            "namespaces": "unshare namespaces (user, mount, pid, network, ipc, uts; /usr read-only)",
            "none": "NO isolation (resource limits and timeout only; explicitly allowed)",
        }[self.isolation]
        who = (
            f" as uids {SANDBOX_UID}..{SANDBOX_UID + self.max_concurrency - 1}"
            if self.as_nobody and self.isolation != "none"
            else ""
        )
        L = self.limits
        total = f"cgroup v{self._cgroup[1]}" if self._cgroup else f"watchdog every {WATCH_S:g} s"
        return (
            f"sandbox: {how}{who}; timeout {L.timeout_s:g} s, cpu {L.cpu_s} s, memory {L.memory_mb} MB per "
            f"process and {L.memory_total_mb} MB per call ({total}), {L.processes} processes, files "
            f"{L.file_mb} MB, /tmp {L.tmp_mb} MB and {L.tmp_files} files, output {L.output_bytes} bytes, "
            f"keyring calls refused{'' if self.nested_userns else ', no user namespaces'}, "
            f"{self.max_concurrency} at once"
        )

    # ---- choosing the isolation -------------------------------------------------------------
    def _prefix(self, uid: int | None) -> list[str]:
        L = self.limits
        # the call dies with the trainer: setpriv sets the parent-death signal (after the uid change, which
        # would clear one set before it); bwrap sets its own as well (--die-with-parent)
        ids = (
            [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            if uid is not None and self.isolation != "none"
            else []
        )
        who = ["setpriv", *ids, "--pdeathsig=KILL", "--"] if ids or shutil.which("setpriv") else []
        nproc = L.processes if uid is not None else L.processes + processes_of(os.getuid())
        # CPU: SIGXCPU at the soft limit (reported as such), SIGKILL a second later
        return who + [
            "prlimit",
            f"--cpu={L.cpu_s}:{L.cpu_s + 1}",
            f"--as={L.memory_mb << 20}",
            f"--nproc={nproc}",
            f"--fsize={L.file_mb << 20}",
            f"--nofile={L.open_files}",
            "--core=0",
            "--",
        ]

    def _command(self, base: Path, uid: int | None) -> list[str]:
        L, work, root = self.limits, base / "work", base / "root"
        if self.isolation == "bwrap":
            return self._prefix(uid) + bwrap_command(
                self.python, work, L.tmp_mb << 20, self.nested_userns, self._filter
            )
        if self.isolation == "namespaces":  # + 2: the root and main.py
            return self._prefix(uid) + namespaces_command(
                self.python, root, work, L.tmp_mb << 20, L.tmp_files + 2, self._filter
            )
        return self._prefix(uid) + [self.python, *boot_args(self._filter)]

    def _choose(self, isolation: str) -> str:
        if isolation not in ("auto", *ISOLATIONS):
            raise ValueError(f"sandbox isolation {isolation!r}: expected 'auto' or one of {ISOLATIONS}")
        if isolation == "none":
            return "none"
        tried = []
        for mode in ("bwrap", "namespaces") if isolation == "auto" else (isolation,):
            ok, why = self._works(mode)
            if ok:
                return mode
            tried.append(f"{mode}: {why}")
        raise SandboxUnavailable(
            "no sandbox for model-written code (" + "; ".join(tried) + "). Install bubblewrap (Debian/Ubuntu: "
            "apt-get install bubblewrap) or allow unprivileged user namespaces; or run model code WITHOUT isolation "
            "by setting the sandbox isolation to 'none' explicitly"
        )

    def _works(self, mode: str) -> tuple[bool, str]:
        need = {"bwrap": ["bwrap", "prlimit"], "namespaces": ["unshare", "prlimit", "setpriv", "mount", "chroot"]}[mode]
        missing = [t for t in need + (["setpriv"] if self.as_nobody else []) if shutil.which(t) is None]
        if missing:
            return False, f"{', '.join(missing)} not found"
        self.isolation = mode
        base = Path(tempfile.mkdtemp(prefix="strop-sandbox-probe-"))
        uid = SANDBOX_UID if self.as_nobody else None
        try:
            self._prepare(base, "print('ok')", uid)
            ok = _probe(self._command(base, uid), base / "work")
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return ok, "" if ok else "it could not start a process here"

    def _prepare(self, base: Path, code: str, uid: int | None) -> None:
        (base / "work").mkdir()
        (base / "root").mkdir()
        (base / "work" / "main.py").write_text(code)
        if uid is not None and self.isolation != "none":
            for p in (base, base / "work", base / "root", base / "work" / "main.py"):
                os.chown(p, uid, uid)
            os.chmod(base, 0o700)

    # ---- running ------------------------------------------------------------------------------
    async def run_python(self, code: str) -> RunResult:
        """Run ``code`` as ``main.py`` in a fresh working directory (the sandbox's ``/tmp``)."""
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # a queue belongs to one event loop
            free: asyncio.Queue = asyncio.Queue()
            for i in range(self.max_concurrency):
                free.put_nowait(SANDBOX_UID + i if self.as_nobody else None)
            self._slots = (loop, free)
        free = self._slots[1]
        uid = await free.get()  # taken once, given back once
        try:
            base = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="strop-sandbox-"))
            cgroup = None
            try:
                await asyncio.to_thread(self._prepare, base, code, uid)
                cmd = self._command(base, uid)
                if self._cgroup:
                    cgroup = await asyncio.to_thread(
                        CallCgroup, *self._cgroup, base.name, self.limits.memory_total_mb << 20
                    )
                    cmd = cgroup.enter() + cmd
                return await self._run(cmd, cwd=base / "work", cgroup=cgroup)
            finally:
                if cgroup is not None:
                    await asyncio.to_thread(cgroup.remove)
                await asyncio.to_thread(shutil.rmtree, base, True)
        finally:
            free.put_nowait(uid)

    def _over_a_total(self, pid: int, cgroup: CallCgroup | None, main_py: tuple[int, int]) -> str | None:
        """Why the call started as ``pid`` must stop (a total reached), or None. Reads /proc and
        the cgroup: run it in a thread."""
        L = self.limits
        pids = cgroup.pids() if cgroup else process_tree(pid)
        if cgroup.oom_kills() if cgroup else resident_bytes(pids) > L.memory_total_mb << 20:
            return (
                f"[memory total exceeded: the call's processes used more than {L.memory_total_mb} MB together; "
                "the run was stopped]"
            )
        tmp = tmp_usage(pids, main_py)
        if tmp is not None and (tmp[0] >= L.tmp_files or tmp[1] >= L.tmp_mb << 20):
            return (
                f"[/tmp limit reached: {tmp[0]} files and directories (limit {L.tmp_files}), {tmp[1] >> 20} MB "
                f"(limit {L.tmp_mb} MB); the run was stopped]"
            )
        return None

    async def _watch(self, pid: int, cgroup: CallCgroup | None, main_py: tuple[int, int]) -> str:
        """Poll the call's totals until one is reached; then stop the call and say why."""
        while True:
            await asyncio.sleep(WATCH_S)
            why = await asyncio.to_thread(self._over_a_total, pid, cgroup, main_py)
            if why:
                kill_group(pid)
                return why

    async def _run(self, cmd: list[str], cwd: Path, cgroup: CallCgroup | None = None) -> RunResult:
        L, t0 = self.limits, time.monotonic()
        main = (cwd / "main.py").stat()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            cwd=cwd,
            env=_host_env(cwd),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        out, timed_out, truncated = bytearray(), False, False
        deadline = t0 + L.timeout_s
        watch = asyncio.ensure_future(self._watch(proc.pid, cgroup, (main.st_dev, main.st_ino)))
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                try:
                    chunk = await asyncio.wait_for(proc.stdout.read(65536), timeout=left)
                except asyncio.TimeoutError:
                    timed_out = True
                    break
                if not chunk:
                    break
                out += chunk[: L.output_bytes + 1 - len(out)]
                if len(out) > L.output_bytes:
                    truncated = True
                    del out[L.output_bytes :]
                    break
        finally:
            if proc.returncode is None and (timed_out or truncated):
                kill_group(proc.pid)
            try:  # read to the end, discarding: asyncio's wait() also waits for the pipe to close
                await asyncio.wait_for(_drain(proc.stdout), timeout=10)
                code = await asyncio.wait_for(proc.wait(), timeout=10)
            except asyncio.TimeoutError:
                kill_group(proc.pid)
                proc.stdout.feed_eof()
                code = await proc.wait()
            kill_group(proc.pid)  # anything left in its session (isolation "none")
            watch.cancel()
        notes = [watch.result()] if watch.done() and not watch.cancelled() else []
        if not notes and cgroup is not None and await asyncio.to_thread(cgroup.oom_kills):  # killed between polls
            notes = [f"[memory total exceeded: the call's processes used more than {L.memory_total_mb} MB together]"]
        killed = timed_out or truncated or code < 0 or bool(notes)
        return RunResult(
            out.decode("utf-8", errors="replace"),
            None if killed else code,
            timed_out=timed_out,
            truncated=truncated,
            seconds=time.monotonic() - t0,
            notes=notes,
        )


async def _drain(stream: asyncio.StreamReader) -> None:
    while await stream.read(65536):
        pass
