"""What the CPU node leaves on the machine, found and taken away: mounts below a folder, a cgroup
in every hierarchy, containerd's shims and the processes in a cgroup. (Root only.)"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
SHIM_SOCKETS = Path("/run/containerd")  # containerd's shims listen in s/ here, whatever its state
MNT_DETACH = 2


# --- mounts ---------------------------------------------------------------------------------

def mounts_below(folder: Path) -> list[str]:
    """The mount points at or below ``folder`` in this mount namespace."""
    prefix, found = str(folder), []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # " " is written \040
        if point == prefix or point.startswith(prefix + "/"):
            found.append(point)
    return found


def unmount_below(folder: Path) -> list[str]:
    """Unmount everything at or below ``folder``, deepest first (lazily where busy); what
    stays mounted."""
    libc = ctypes.CDLL(None, use_errno=True)
    for point in sorted(mounts_below(folder), key=len, reverse=True):
        if libc.umount2(point.encode(), 0) != 0:
            libc.umount2(point.encode(), MNT_DETACH)
    return mounts_below(folder)


def share(folder: Path, mount: Path) -> None:
    """``folder`` as a shared mount of its own: what another mount namespace mounts below it
    (the kubelet's) appears in this one."""
    folder.mkdir(parents=True, exist_ok=True)
    if str(folder) not in mounts_below(folder):
        subprocess.run([str(mount), "--bind", str(folder), str(folder)], check=True)
    subprocess.run([str(mount), "--make-shared", str(folder)], check=True)


# --- cgroups --------------------------------------------------------------------------------

def hierarchies() -> list[Path]:
    """Every mounted cgroup hierarchy (v1 controllers, named ones, the unified one)."""
    if not CGROUP_FS.is_dir():
        return []
    return [h for h in sorted(CGROUP_FS.iterdir()) if (h / "cgroup.procs").exists()]


def make_cgroup(name: str) -> None:
    """/``name`` in every hierarchy; cpuset's with its parent's CPUs and memory nodes (a new
    cpuset has none, and no process could join it or a child)."""
    for hierarchy in hierarchies():
        top = hierarchy / name
        top.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (top / knob).exists() and not (top / knob).read_text().strip():
                (top / knob).write_text((hierarchy / knob).read_text())


def cgroup_pids(name: str) -> set[int]:
    """The processes in /``name`` or below, in any hierarchy."""
    pids: set[int] = set()
    for hierarchy in hierarchies():
        for procs in (hierarchy / name).rglob("cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                pids.update(int(pid) for pid in procs.read_text().split())
    return pids


def remove_cgroup(name: str) -> int:
    """Remove /``name`` and everything below it in every hierarchy (empty cgroups only);
    how many were removed."""
    removed = 0
    for hierarchy in hierarchies():
        if not (hierarchy / name).is_dir():
            continue
        for folder, _, _ in sorted(os.walk(hierarchy / name), key=lambda e: -len(e[0])):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
                removed += 1
    return removed


# --- processes ------------------------------------------------------------------------------

def shim_socket(address: str, namespace: str, shim_id: str) -> Path:
    """Where a shim of the containerd at ``address`` listens (containerd's shim.SocketAddress:
    the socket outlives a shim that is killed)."""
    digest = hashlib.sha256(f"{address}/{namespace}/{shim_id}".encode()).hexdigest()
    return SHIM_SOCKETS / "s" / digest


def shims(address: Path) -> dict[int, Path]:
    """The running shims of the containerd at ``address``, by pid, with their sockets."""
    found = {}
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, KeyError):
            argv = (proc / "cmdline").read_bytes().decode().split("\0")
            if proc.name.isdigit() and "containerd-shim" in argv[0] and str(address) in argv:
                flag = dict(zip(argv[1::2], argv[2::2], strict=False))
                found[int(proc.name)] = shim_socket(flag["-address"], flag["-namespace"],
                                                    flag["-id"])
    return found


def kill(pids: set[int], timeout_s: float = 10) -> None:
    """SIGKILL each, and wait until they are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
