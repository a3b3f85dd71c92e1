"""Where one local cluster lives: its folder (``<cluster home>/run``) and its loopback ports."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from gemmalab.k8s.cluster import build
from gemmalab.k8s.cluster.errors import ClusterError

DEFAULT_BASE_PORT = 16400
# Offsets from the base port; every one is bound on 127.0.0.1 only.
PORT_OFFSETS = {"etcd": 0, "etcd-peer": 1, "kube-apiserver": 2, "kube-controller-manager": 3,
                "kube-scheduler": 4, "jobset-webhook": 5, "kueue-webhook": 6, "kwok": 7,
                "kubelet-healthz": 8}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where one cluster lives: its folder and its ports."""

    root: Path
    base_port: int

    @classmethod
    def default(cls) -> Layout:
        port = os.environ.get("CLUSTER_PORT") or DEFAULT_BASE_PORT
        try:
            base_port = int(port)
        except ValueError:
            raise ClusterError(f"CLUSTER_PORT={port!r} is not a port number",
                               "use a number such as 16400") from None
        highest = 65535 - len(PORT_OFFSETS)
        if not 1024 <= base_port <= highest:
            raise ClusterError(f"CLUSTER_PORT={base_port} is outside 1024-{highest}",
                               "use a number such as 16400")
        return cls(build.cluster_home() / "run", base_port)

    def port(self, name: str) -> int:
        return self.base_port + PORT_OFFSETS[name]

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.port('kube-apiserver')}"

    def log(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def pid_file(self, name: str) -> Path:
        return self.root / "pids" / f"{name}.pid"
