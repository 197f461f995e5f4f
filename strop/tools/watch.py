"""What a sandboxed call holds, measured from outside it (strop.tools.sandbox's totals): a cgroup of its own
where this process may make one, else its process tree, their resident memory and the files and bytes of its
/tmp; the processes of a uid; and the end of a call's process group."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def memory_cgroup() -> tuple[Path, int] | None:
    """A cgroup directory in which this process may make a child with a memory limit, and its
    version (2, else 1), or None (then a watchdog sums the call's memory). v2: this process's
    cgroup, else its parent, wherever the memory controller is enabled for children and the
    directory is writable (root, or a delegated subtree); v1: its memory cgroup, if writable."""
    try:
        own = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = [line.split(" - ") for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    except OSError:
        return None
    for line in own:
        _, controllers, path = line.split(":", 2)
        version = 2 if controllers == "" else 1 if "memory" in controllers.split(",") else None
        for head, tail in mounts if version else []:
            root, mountpoint = head.split()[3:5]
            fstype, _, options = (tail.split() + ["", ""])[:3]
            wanted = fstype == "cgroup2" if version == 2 else fstype == "cgroup" and "memory" in options.split(",")
            if not wanted or not (path + "/").startswith(root.rstrip("/") + "/"):
                continue
            here = Path(mountpoint, path[len(root.rstrip("/")) :].lstrip("/"))
            for d in (here, here.parent) if version == 2 else (here,):
                try:
                    usable = version == 1 or "memory" in (d / "cgroup.subtree_control").read_text().split()
                except OSError:
                    continue
                if usable and os.access(d, os.W_OK):
                    return d, version
    return None


class CallCgroup:
    """One call's cgroup: its memory limit (no swap beyond it) holds all its processes together."""

    def __init__(self, parent: Path, version: int, name: str, limit_bytes: int):
        self.dir, self.version = parent / name, version
        self.dir.mkdir()
        files = (
            {"memory.max": limit_bytes, "memory.swap.max": 0, "memory.oom.group": 1}
            if version == 2
            else {"memory.limit_in_bytes": limit_bytes, "memory.memsw.limit_in_bytes": limit_bytes}
        )
        for file, value in files.items():  # the swap and group files exist only with swap / newer kernels
            if (self.dir / file).exists():
                (self.dir / file).write_text(str(value))

    def enter(self) -> list[str]:
        """A prefix that moves the command into this cgroup before it starts anything."""
        return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.dir / "cgroup.procs")]

    def pids(self) -> list[int]:
        try:
            return [int(x) for x in (self.dir / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def oom_kills(self) -> int:
        """Processes the kernel killed for reaching the limit."""
        try:
            text = (self.dir / ("memory.events" if self.version == 2 else "memory.oom_control")).read_text()
        except OSError:
            return 0
        return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("oom_kill "))

    def remove(self) -> None:
        """Remove the (emptied) cgroup; its last processes may take a moment to exit."""
        for _ in range(50):
            try:
                self.dir.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a pid namespace keeps orphans below its first process)."""
    children: dict[int, list[int]] = {}
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            try:
                ppid = int(Path(d.path, "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def resident_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            pass
    return total


def tmp_usage(pids: list[int], main_py: tuple[int, int]) -> tuple[int, int] | None:
    """(files and directories, bytes) in the call's /tmp, seen through a process inside it (the
    one whose /tmp/main.py is the call's), or None (isolation "none": /tmp is the host's)."""
    for pid in reversed(pids):
        tmp = f"/proc/{pid}/root/tmp"
        try:
            st = os.stat(f"{tmp}/main.py")
            if (st.st_dev, st.st_ino) == main_py:
                v = os.statvfs(tmp)
                return v.f_files - v.f_ffree - 2, (v.f_blocks - v.f_bfree) * v.f_frsize  # - the root and main.py
        except OSError:
            continue
    return None


def processes_of(uid: int) -> int:
    n = 0
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == uid:
                n += 1
        except OSError:
            pass
    return n


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
