"""The cluster's components as plain processes: started in their own session with their log and
pid file in the cluster's folder, found again by that pid (and the folder in their command line),
waited for, and stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from gemmalab.k8s.cluster.errors import ClusterError
from gemmalab.k8s.cluster.layout import Layout


def alive(layout: Layout, name: str) -> int | None:
    """The pid of component ``name`` if it still runs (and is the program we started)."""
    try:
        pid = int(layout.pid_file(name).read_text())
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if not command:  # a zombie, or a process in the middle of its exec (seen under load)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            return None if state in ("Z", "X") else pid
    except (OSError, ValueError, IndexError):
        return None
    return pid if layout.root.as_posix().encode() in command else None


def start(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
    layout.log(name).parent.mkdir(parents=True, exist_ok=True)
    layout.pid_file(name).parent.mkdir(parents=True, exist_ok=True)
    # Every command line names the cluster folder (flags or --kubeconfig), which alive() checks.
    with open(layout.log(name), "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={**os.environ, **(env or {})}, cwd=layout.root)
    layout.pid_file(name).write_text(str(process.pid))


def wait(what: str, ready: Callable[[], bool], layout: Layout, component: str,
         timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if alive(layout, component) is None:
            raise ClusterError(f"{component} exited while starting: "
                               f"{last_line(layout.log(component))}",
                               f"read {layout.log(component)}")
        time.sleep(0.2)
    raise ClusterError(f"{what} was not ready after {timeout_s:.0f} s: "
                       f"{last_line(layout.log(component))}", f"read {layout.log(component)}")


def stop(layout: Layout, name: str, timeout_s: float = 15) -> bool:
    """SIGTERM to the component's process group, SIGKILL after ``timeout_s``; whether it ran."""
    if (pid := alive(layout, name)) is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while alive(layout, name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(layout, name) is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(layout, name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
    return True


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return (lines or ["no log"])[-1].strip()[:300]


def listening(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    def check() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return True
        return False
    return check
