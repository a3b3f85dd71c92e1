"""The local cluster's real CPU node (gemmalab/k8s/cluster/node.py): a kubelet with containerd,
runc and the CNI bridge beside kwok's fake TPU nodes. Its pods really run: their logs come through
the API server, their names resolve as on GKE (a JobSet pod's hostname through CoreDNS), they
reach the API server at the `kubernetes` Service and nothing else, and `make cluster-down` takes
everything away again. Needs root (without it the cluster has no CPU node: skipped)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from gemmalab.k8s.cluster import build, images, network, node, stack
from gemmalab.k8s.config import RUN_AS_USER, local_volumes
from tests.helpers.k8s import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def busybox(cpu_node, tmp_path_factory) -> str:
    archive = images.busybox_archive(tmp_path_factory.mktemp("image") / "busybox.tar")
    assert node.load_image(archive, cpu_node.layout) == [images.BUSYBOX_IMAGE]
    return images.BUSYBOX_IMAGE


def pod_spec(image: str, script: str) -> dict[str, Any]:
    return {**node.pod_placement(), "restartPolicy": "Never",
            "containers": [{"name": "main", "image": image, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", script]}]}


def finished(core: k8s.CoreV1Api, namespace: str, name: str) -> k8s.V1Pod | None:
    pod = core.read_namespaced_pod(name, namespace)
    return pod if pod.status.phase in ("Succeeded", "Failed") else None


def run_pod(cluster, namespace: str, name: str, image: str, script: str) -> tuple[k8s.V1Pod, str]:
    core = k8s.CoreV1Api(cluster.api)
    core.create_namespaced_pod(namespace, {"metadata": {"name": name},
                                           "spec": pod_spec(image, script)})
    pod = wait_for(f"pod {name} to finish", lambda: finished(core, namespace, name), 120)
    return pod, core.read_namespaced_pod_log(name, namespace)


def test_the_cpu_node_is_a_real_kubelet_kept_for_cpu_pods(cpu_node):
    found = k8s.CoreV1Api(cpu_node.api).read_node(node.NODE_NAME)
    info = found.status.node_info
    assert info.container_runtime_version == f"containerd://{build.CONTAINERD_VERSION[1:]}"
    assert info.kubelet_version == build.KUBERNETES_VERSION
    assert found.metadata.labels[node.ROLE_LABEL] == node.ROLE
    assert [t.to_dict() | {"time_added": None} for t in found.spec.taints] == [
        {**node.TAINT, "time_added": None}]
    assert {a.type: a.address for a in found.status.addresses}["InternalIP"] == network.NODE_IP
    ready = {c.type: c.status for c in found.status.conditions}["Ready"]
    assert ready == "True"
    allocatable = found.status.allocatable
    assert int(allocatable["cpu"]) == os.cpu_count() and allocatable["memory"].endswith("Ki")
    # The CPU profile's /data and /outputs, standing for the buckets: the image's user writes.
    for folder in local_volumes():
        assert folder.is_dir() and folder.stat().st_uid == RUN_AS_USER, folder


def test_a_pod_runs_with_cluster_dns_and_no_way_out_and_its_log_reads_through_the_api(
        cpu_node, run_namespace, busybox):
    kwok_ip = network.KWOK_POD_CIDR.replace("0/16", "7")
    pod, log = run_pod(cpu_node, run_namespace, "probe", busybox, (
        "cat /etc/resolv.conf; ip route; "
        f"nslookup kubernetes.default.svc.{node.CLUSTER_DOMAIN}; "
        f"for ip in 192.0.2.1 {kwok_ip} 8.8.8.8; do ip route get $ip 2>&1; done; true"))
    assert pod.status.phase == "Succeeded", log
    assert pod.spec.node_name == node.NODE_NAME
    assert ipaddress.ip_address(pod.status.pod_ip) in network.POD_SUBNET
    assert f"nameserver {network.NODE_IP}" in log
    assert f"search {run_namespace}.svc.cluster.local svc.cluster.local cluster.local" in log
    routes = sorted(line.split()[0] for line in log.splitlines() if " dev eth0" in line)
    assert routes == sorted([network.SERVICE_CIDR, str(network.POD_SUBNET)]), log
    assert f"Address: {network.API_SERVICE_IP}" in log
    assert log.count("Network is unreachable") == 3, log


def test_a_pod_reaches_the_api_server_at_the_kubernetes_service(cpu_node, run_namespace,
                                                                  busybox):
    """Through the pod's own network namespace: TLS to 10.96.0.1:443 verified against the
    cluster's CA under the name in-cluster clients use, with a service account's token
    (busybox's TLS speaks none of the API server's ciphers)."""
    core = k8s.CoreV1Api(cpu_node.api)
    core.create_namespaced_pod(run_namespace, {"metadata": {"name": "sleeper"},
                                               "spec": pod_spec(busybox, "sleep 300")})
    pod = wait_for("the pod to run", lambda: (p := core.read_namespaced_pod(
        "sleeper", run_namespace)).status.phase == "Running" and p, 60)
    container = pod.status.container_statuses[0].container_id.split("://")[1]
    tasks = subprocess.run(
        [str(build.CTR.path()), f"--address={node.NodePaths.of(cpu_node.layout).socket}",
         "--namespace=k8s.io", "tasks", "ls"], capture_output=True, text=True).stdout
    pid = next(line.split()[1] for line in tasks.splitlines() if line.startswith(container))
    token = cpu_node.kubectl("create", "token", "gemmalab-runner", "-n", run_namespace).strip()
    request = (f"GET /api/v1/namespaces/{run_namespace}/serviceaccounts HTTP/1.0\r\n"
               f"Host: kubernetes.default.svc\r\nAuthorization: Bearer {token}\r\n\r\n")
    script = f"""
import socket, ssl
tls = ssl.create_default_context(cafile={str(cpu_node.layout.pki / "ca.crt")!r})
with tls.wrap_socket(socket.create_connection(({network.API_SERVICE_IP!r}, 443), 10),
                     server_hostname="kubernetes.default.svc") as server:
    server.sendall({request.encode()!r})
    print(b"".join(iter(lambda: server.recv(65536), b"")).decode(errors="replace"))
"""
    done = subprocess.run(["nsenter", "-t", pid, "-n", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=30)
    # Authenticated as the pod's service account (RBAC gives it no list: 403, not 401).
    assert done.stdout.startswith("HTTP/1.0 403"), done.stdout + done.stderr
    assert f"system:serviceaccount:{run_namespace}:gemmalab-runner" in done.stdout


def test_a_jobset_pod_resolves_its_peers_hostnames_as_on_gke(cpu_node, run_namespace, busybox):
    name, job = "dns", "workers"
    peer = f"{name}-{job}-0-1.{name}"  # <jobset>-<replicatedJob>-<job index>-<pod index>.<jobset>
    script = (f"i=0; until nslookup {peer}.{run_namespace}.svc.cluster.local; do "
              "i=$((i+1)); [ $i -gt 60 ] && exit 1; sleep 1; done; sleep 2")
    template = {"spec": pod_spec(busybox, script)}
    jobset = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
              "metadata": {"name": name},
              "spec": {"replicatedJobs": [{"name": job, "replicas": 1, "template": {"spec": {
                  "parallelism": 2, "completions": 2, "backoffLimit": 0,
                  "template": template}}}]}}
    k8s.CustomObjectsApi(cpu_node.api).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", run_namespace, "jobsets", jobset)
    core = k8s.CoreV1Api(cpu_node.api)

    def both_done() -> list[k8s.V1Pod] | None:
        pods = core.list_namespaced_pod(
            run_namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}").items
        done = [p for p in pods if p.status.phase in ("Succeeded", "Failed")]
        return done if len(done) == 2 else None

    pods = wait_for("the JobSet's two pods to finish", both_done, 180)
    ips = {p.spec.hostname: p.status.pod_ip for p in pods}
    for pod in pods:
        log = core.read_namespaced_pod_log(pod.metadata.name, run_namespace)
        assert pod.status.phase == "Succeeded", log
        assert pod.spec.subdomain == name and ips[f"{name}-{job}-0-1"] in log, log


def node_images(cpu_node, *args: str) -> dict[str, str]:
    """The node's image references (names and the CRI's ``sha256:...`` ones) and the manifest
    each points at."""
    done = images._ctr(build.CTR.path(), node.NodePaths.of(cpu_node.layout).socket, "images",
                       *args)
    assert done.returncode == 0, done.stderr
    return {row[0]: row[2] for row in map(str.split, done.stdout.splitlines()[1:])
            if len(row) > 2}


def test_importing_a_name_again_lets_the_image_it_named_go(cpu_node, tmp_path):
    """A rebuilt image loaded under its name again: the one it replaces leaves the node's disk,
    also when the CRI holds it by digest too (that reference kept each 4 GB cpu image before)."""
    name = "gemmalab.local/replaced:1"
    by_digest = f"sha256:{'1' * 64}"
    first = images.write_oci_archive(tmp_path / "one.tar", name, [images.File("/v", b"one")],
                                     ["/v"])
    assert node.load_image(first, cpu_node.layout) == [name]
    replaced = node_images(cpu_node, "ls")[name]
    node_images(cpu_node, "tag", name, by_digest)  # as the CRI plugin does after a restart
    second = images.write_oci_archive(tmp_path / "two.tar", name, [images.File("/v", b"two")],
                                      ["/v"])
    try:
        assert node.load_image(second, cpu_node.layout) == [name]
        after = node_images(cpu_node, "ls")
        assert after[name] != replaced and replaced not in after.values(), after
    finally:
        node_images(cpu_node, "rm", "--sync", name)


def test_this_machine_never_dials_a_kwok_pod_or_an_unserved_service_address(cpu_node):
    for address in (network.KWOK_POD_CIDR.replace("0/16", "5"), "10.96.0.10"):
        with pytest.raises(ConnectionRefusedError):  # nftables' reject, not a route out
            socket.create_connection((address, 80), timeout=5)


def test_cluster_down_leaves_nothing_and_the_next_up_is_clean(cpu_node):
    """Last in this file: it stops the session's cluster and starts it again."""
    layout = cpu_node.layout
    # The kubelet's kernel settings are only what it reads in its own mount namespace.
    kernel = {k: Path("/proc/sys", k).read_text() for k in
              [*node.KERNEL_SETTINGS, "net/ipv4/ip_forward"]}
    stack.down(layout)
    assert not Path(f"/sys/class/net/{network.BRIDGE}").exists()
    assert f"table ip {network.NFT_TABLE}" not in subprocess.run(
        ["nft", "list", "tables"], capture_output=True, text=True).stdout
    mounts = Path("/proc/self/mountinfo").read_text()
    assert str(layout.root) not in mounts
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{node.CGROUP_PARENT}"))
    assert not (layout.root / "node").exists()
    # The images loaded into the node stay (beside the cluster's folder), nothing mounted there.
    assert node.NodePaths.of(layout).containerd_root.is_dir()
    assert str(node.NodePaths.of(layout).containerd_root) not in mounts
    assert not list(network.CNI_CACHE.glob(f"results/{network.CNI_NETWORK}-*"))
    assert not Path("/run/containerd/s").exists() or not any(Path("/run/containerd/s").iterdir())
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit()
                 and str(layout.root).encode() in _cmdline(p)]
    assert not leftovers
    assert {k: Path("/proc/sys", k).read_text() for k in kernel} == kernel
    stack.up(layout)
    assert k8s.CoreV1Api(cpu_node.api).read_node(node.NODE_NAME).spec.taints


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""
