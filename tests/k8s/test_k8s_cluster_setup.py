"""``make cluster``'s bad input, each refused in one line with the fix before any long work: a
port in use, no etcd, no Go (or too old a one), a build that fails. A cluster home of the test's
own: nothing here builds, starts or touches the suite's cluster."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gemmalab.k8s.cluster import build, nodes, stack
from tests.helpers import free_port


def cluster_up(tmp_path: Path, path_dirs: list[Path], **env: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "gemmalab.k8s.cluster", "up"], capture_output=True, text=True,
        timeout=60, env={**os.environ, "GEMMALAB_CLUSTER_HOME": str(tmp_path / "home"),
                         "PATH": os.pathsep.join(map(str, path_dirs)), **env})
    return done.returncode, done.stderr.strip()


def fake_programs(folder: Path, **scripts: str) -> Path:
    """Executables named like the keywords, running the given shell lines."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    return folder


def free_base_port() -> int:
    """A base port whose whole range is free now."""
    for _ in range(50):
        base = free_port()
        if base + len(stack.PORT_OFFSETS) < 65535 and all(
                stack._port_holder(base + i) is None for i in range(len(stack.PORT_OFFSETS))):
            return base
    raise AssertionError("no free port range")


GO_126 = 'if [ "$1 $2" = "env GOVERSION" ]; then echo go1.26.8; exit 0; fi'


def test_a_port_in_use_is_named_with_the_fix(tmp_path):
    base = free_base_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + stack.PORT_OFFSETS["kube-apiserver"]))
        squatter.listen()
        code, said = cluster_up(tmp_path, [Path(sys.executable).parent, Path("/usr/bin"),
                                           Path("/bin")], CLUSTER_PORT=str(base))
    assert code == 2 and "\n" not in said, said
    assert said.startswith(f"make cluster: port {base + 2} (for kube-apiserver) on 127.0.0.1 "
                           "cannot be used")
    assert f"CLUSTER_PORT={base + 100}" in said


def test_a_bad_cluster_port_is_refused(tmp_path):
    code, said = cluster_up(tmp_path, [Path("/usr/bin")], CLUSTER_PORT="http")
    assert code == 2 and said == ("make cluster: CLUSTER_PORT='http' is not a port number. "
                                  "Fix: use a number such as 16400")


def test_missing_etcd_is_named_before_anything_builds(tmp_path):
    bin_dir = fake_programs(tmp_path / "bin", go=f"{GO_126}\nexit 1")
    code, said = cluster_up(tmp_path, [bin_dir], CLUSTER_PORT=str(free_base_port()))
    assert code == 2 and said == ("make cluster: etcd is not installed. Fix: install Debian's "
                                  "etcd-server (sudo apt-get install etcd-server)")


@pytest.mark.parametrize("go", [None, "echo go1.22.4"])
def test_a_missing_or_old_go_toolchain_is_named(tmp_path, go):
    programs = {"etcd": "exit 1"} | ({"go": go} if go else {})
    bin_dir = fake_programs(tmp_path / "bin", **programs)
    code, said = cluster_up(tmp_path, [bin_dir], CLUSTER_PORT=str(free_base_port()))
    assert code == 2 and "\n" not in said, said
    problem = ("no Go toolchain: `go` is not on PATH" if go is None
               else f"{bin_dir / 'go'} is go1.22.4; the cluster's modules need go1.26")
    assert said.startswith(f"make cluster: {problem}. Fix: install Go 1.26 or newer"), said


def test_a_failing_build_says_why_and_where_its_log_is(tmp_path):
    bin_dir = fake_programs(
        tmp_path / "bin", etcd="exit 1",
        go=f"{GO_126}\necho 'go: downloading k8s.io/api v0.36.3'\n"
           "echo 'k8s.io/kubernetes@v1.36.3: reading https://proxy.golang.org/...: 403 "
           "Forbidden' >&2\nexit 1")
    code, said = cluster_up(tmp_path, [bin_dir], CLUSTER_PORT=str(free_base_port()))
    log = tmp_path / "home" / "build" / f"{build.CONTROL_PLANE.key}.log"
    progress, refusal = said.splitlines()
    assert progress.startswith("building kube v1.36.3 (once per machine;") and str(log) in progress
    assert code == 2
    assert refusal.startswith(f"make cluster: building kube {build.KUBERNETES_VERSION} failed "
                              "(exit 1): k8s.io/kubernetes@v1.36.3: reading"), said
    assert f"Fix: read {log}" in refusal and log.is_file()
    assert not any((tmp_path / "home" / "bin").rglob("kube"))  # nothing half-built is kept


def test_fake_nodes_look_like_gke_tpu_v6e_node_pools():
    made = nodes.fake_nodes()
    by_pool: dict[str, list[dict]] = {}
    for node in made:
        by_pool.setdefault(node["metadata"]["labels"][nodes.NODEPOOL_LABEL], []).append(node)
    assert {pool: len(members) for pool, members in by_pool.items()} == {
        "v6e-1x1-0": 1, "v6e-1x1-1": 1, "v6e-1x1-2": 1, "v6e-1x1-3": 1,
        "v6e-2x4-0": 2, "v6e-2x4-1": 2}
    host = by_pool["v6e-2x4-0"][0]
    assert host["metadata"]["labels"]["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
    assert host["metadata"]["labels"]["cloud.google.com/gke-tpu-topology"] == "2x4"
    assert host["metadata"]["labels"]["node.kubernetes.io/instance-type"] == "ct6e-standard-4t"
    assert host["status"]["capacity"]["google.com/tpu"] == "4"
    assert host["spec"]["taints"] == [{"key": "google.com/tpu", "value": "present",
                                       "effect": "NoSchedule"}]


def test_the_command_line_without_a_cluster_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """No credentials, or credentials for a cluster that is down: one line with the fix."""
    from kubernetes import client as k8s

    from gemmalab.k8s.cli import main

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    assert main(["watch", "run"]) == 2
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and said.startswith(
        f"ConfigError: KUBECONFIG: no cluster credentials in {tmp_path / 'missing'}"), said
    port = free_port()
    (tmp_path / "down").write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "down"))
    default = k8s.Configuration.get_default_copy()
    try:
        assert main(["logs", "run"]) == 2
    finally:
        k8s.Configuration.set_default(default)
    said = capsys.readouterr().err.strip()
    assert said == (f"ConfigError: KUBECONFIG: nothing answers at 127.0.0.1:{port} (the cluster "
                    "is down?). Fix: start it (make cluster) or point KUBECONFIG at a running one")
