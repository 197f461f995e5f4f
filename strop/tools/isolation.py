"""How the sandbox isolates a call: the keyring filter (seccomp), the first Python that installs it, and the
command lines of the two isolations (bubblewrap; plain user, mount and pid namespaces)."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path


class SandboxUnavailable(RuntimeError):
    pass


# ---- the keyring filter ---------------------------------------------------------------------------
# machine -> (AUDIT_ARCH_* of its native system calls, numbers of add_key, request_key, keyctl)
_KEYRING_CALLS = {"x86_64": (0xC000003E, (248, 249, 250)), "aarch64": (0xC00000B7, (217, 218, 219))}


def keyring_filter(machine: str | None = None) -> bytes:
    """A seccomp program (classic BPF, ``struct sock_filter`` records) that fails ``add_key``,
    ``request_key`` and ``keyctl`` with EPERM, fails x32 calls (numbers from 2**30: the same
    calls under other numbers) likewise, and kills a process making calls of another
    architecture (a 32-bit ABI numbers them differently)."""
    machine = machine or os.uname().machine
    if machine not in _KEYRING_CALLS:
        raise SandboxUnavailable(
            f"no keyring filter for {machine!r}: strop.tools.isolation._KEYRING_CALLS knows the "
            f"system call numbers of {sorted(_KEYRING_CALLS)} only"
        )
    arch, numbers = _KEYRING_CALLS[machine]
    n = len(numbers)

    def op(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jump_true, jump_false, k)

    LOAD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    KILL, ALLOW, ERRNO = 0x80000000, 0x7FFF0000, 0x00050000  # SECCOMP_RET_KILL_PROCESS, _ALLOW, _ERRNO
    program = [
        op(LOAD, 4),
        op(JEQ, arch, 1, 0),
        op(RET, KILL),  # seccomp_data.arch
        op(LOAD, 0),
        op(JGE, 0x40000000, n + 1, 0),
    ]  # seccomp_data.nr; x32 -> EPERM
    program += [op(JEQ, nr, n - i, 0) for i, nr in enumerate(numbers)]  # -> EPERM, past the rest and ALLOW
    program += [op(RET, ALLOW), op(RET, ERRNO | errno.EPERM)]
    return b"".join(program)


# the sandbox's first Python: installs the filter (argv[1], hex), then becomes the model's program
_BOOT = r"""
import ctypes, os, sys
program = bytes.fromhex(sys.argv[1])
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
prog, libc, u = Prog(len(program) // 8, program), ctypes.CDLL(None, use_errno=True), ctypes.c_ulong
if libc.prctl(38, u(1), u(0), u(0), u(0)) or libc.prctl(22, u(2), ctypes.byref(prog), u(0), u(0)):
    sys.exit("strop sandbox: could not install the seccomp filter: " + os.strerror(ctypes.get_errno()))
os.execv(sys.executable, [sys.executable, "-I", "main.py"])
"""  # prctl 38: PR_SET_NO_NEW_PRIVS; 22, 2: PR_SET_SECCOMP, SECCOMP_MODE_FILTER


# run inside the new namespaces by /bin/sh: build a read-only root with a size-limited /tmp, then
# start Python in it
_NS_SETUP = r"""
set -e
R="$1"; W="$2"; PY="$3"; TMP_BYTES="$4"; TMP_INODES="$5"; FILTER="$6"; BOOT="$7"
mount -t tmpfs -o size=1m,mode=755 strop-sandbox "$R"
mkdir "$R/usr" "$R/tmp" "$R/proc" "$R/dev"
mount --rbind /usr "$R/usr"
mount -o remount,bind,ro "$R/usr"
for d in bin lib lib64 sbin; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$R/$d"; elif [ -d "/$d" ]; then
    mkdir "$R/$d"; mount --rbind "/$d" "$R/$d"; mount -o remount,bind,ro "$R/$d"; fi
done
for n in null zero random urandom; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
mount -t tmpfs -o "size=$TMP_BYTES,nr_inodes=$TMP_INODES,mode=1777" strop-tmp "$R/tmp"
touch "$R/tmp/main.py"; mount --bind "$W/main.py" "$R/tmp/main.py"; mount -o remount,bind,ro "$R/tmp/main.py"
mount -t proc proc "$R/proc"
mount -o remount,bind,ro "$R"
exec chroot "$R" /usr/bin/setpriv --no-new-privs --bounding-set=-all --inh-caps=-all \
  /usr/bin/env -i PATH=/usr/bin:/bin HOME=/tmp TMPDIR=/tmp LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1 \
  PYTHONUNBUFFERED=1 /bin/sh -c 'cd /tmp && "$0" -I -c "$2" "$1"; exit $?' "$PY" "$FILTER" "$BOOT"
"""


def boot_args(filter_hex: str) -> list[str]:
    """The sandbox's first Python's arguments: ``_BOOT`` with the keyring filter (hex)."""
    return ["-I", "-c", _BOOT, filter_hex]


def bwrap_command(python: str, work: Path, tmp_bytes: int, nested_userns: bool, filter_hex: str) -> list[str]:
    """bubblewrap: a read-only view of the system, a /tmp of ``tmp_bytes``, no network, no capabilities."""
    cmd = [
        "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--die-with-parent",
        "--new-session",
        *([] if nested_userns else ["--disable-userns"]),
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for d in ("bin", "lib", "lib64", "sbin"):
        p = Path("/") / d
        if p.is_symlink():
            cmd += ["--symlink", os.readlink(p), f"/{d}"]
        elif p.is_dir():
            cmd += ["--ro-bind", str(p), f"/{d}"]
    # /tmp: a tmpfs of tmp_mb (bwrap cannot cap its inodes: the watchdog counts them)
    cmd += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--remount-ro",
        "/dev",
        "--size",
        str(tmp_bytes),
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        str(work / "main.py"),
        "/tmp/main.py",
        "--chdir",
        "/tmp",
        "--remount-ro",
        "/",
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PYTHONDONTWRITEBYTECODE",
        "1",
        "--setenv",
        "PYTHONUNBUFFERED",
        "1",
        "--cap-drop",
        "ALL",
        "--",
        python,
        *boot_args(filter_hex),
    ]
    return cmd


def namespaces_command(
    python: str, root: Path, work: Path, tmp_bytes: int, tmp_files: int, filter_hex: str
) -> list[str]:
    """unshare: new user, mount, pid, net, ipc and uts namespaces; ``_NS_SETUP`` builds the root."""
    return [
        "unshare",
        "--user",
        "--map-root-user",
        "--mount",
        "--pid",
        "--fork",
        "--kill-child",
        "--net",
        "--ipc",
        "--uts",
        "--",
        "/bin/sh",
        "-c",
        _NS_SETUP,
        "strop-sandbox",
        str(root),
        str(work),
        python,
        str(tmp_bytes),
        str(tmp_files),
        filter_hex,
        _BOOT,
    ]
