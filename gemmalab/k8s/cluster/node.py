"""The cluster's one real node, ``cpu-0``: a kubelet on this machine with containerd, Debian's runc
and the CNI bridge (``network``), and CoreDNS for the pods' names, beside kwok's fake TPU nodes.
One per machine (the bridge and the cgroups are the machine's): a second cluster on other ports
runs without one.

Everything it keeps lies in ``<cluster folder>/node``: containerd's root and state (images,
snapshots, the pods' network namespaces), runc's state, the kubelet's root (pod volumes, its
certificate), the pod logs, the CNI config and address leases. The kubelet's cgroups (QoS tiers,
pods, containers) lie below ``/gemmalab/kubepods`` in every hierarchy. ``stop`` and ``cleanup``
take all of it away again: containers, shims, mounts, cgroups, the bridge, its nftables table.

The node is labelled and tainted ``gemmalab.dev/node=cpu`` (NoSchedule): only pods that select
and tolerate it run here (``pod_placement``); the kwok nodes' pods, which select TPU labels,
never do. Pods resolve names through CoreDNS on the bridge (``<jobset>-<job>-<i>-<j>.<jobset>``
as on GKE) and reach the API server at the ``kubernetes`` Service (10.96.0.1:443, ``network``).

The kubelet runs in a mount namespace of its own, where
- the six kernel settings it would set for the whole machine (``vm.overcommit_memory=1``,
  ``kernel.panic_on_oops=1``, ...) read as it wants them: the machine keeps its own;
- ``/var/lib`` is the host's with the kubelet's writes kept in the node's folder (an overlay):
  its device-plugin socket's path, /var/lib/kubelet/device-plugins, is fixed in the kubelet;
- its root folder is a shared mount, so the pod volumes it mounts there are the ones containerd
  (in the host's namespace) sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gemmalab.k8s import accelerators
from gemmalab.k8s.cluster import build, host, images, network, processes
from gemmalab.k8s.cluster.errors import ClusterError
from gemmalab.k8s.cluster.layout import Layout

COMPONENTS = ("containerd", "kubelet", "coredns")  # in start order
NODE_NAME = "cpu-0"
# The CPU profile's selector and toleration (gemmalab.k8s.accelerators): gemmalab.dev/node=cpu
ROLE_LABEL = accelerators.CPU_NODE_LABEL
ROLE = accelerators.CPU_NODE_VALUE
TAINT = {"key": ROLE_LABEL, "value": ROLE, "effect": "NoSchedule"}
CLUSTER_DOMAIN = "cluster.local"
KUBELET_PORT = 10250  # on the bridge's address only
CGROUP_PARENT = "gemmalab"  # the kubelet's cgroupRoot: every container's cgroup lies below it
CNI_PLUGINS = Path("/usr/lib/cni")  # Debian's containernetworking-plugins
# What the kubelet sets (container_manager_linux.go, setupKernelTunables) and what it reads in
# its own mount namespace instead.
KERNEL_SETTINGS = {"vm/overcommit_memory": "1", "vm/panic_on_oom": "0", "kernel/panic": "10",
                   "kernel/panic_on_oops": "1", "kernel/keys/root_maxkeys": "1000000",
                   "kernel/keys/root_maxbytes": "25000000"}
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes; containerd adds ".ttrpc"
INSTALL_FIX = "run scripts/install-node-packages (make cluster runs it)"


@dataclasses.dataclass(frozen=True)
class NodePaths:
    """Where the node keeps everything: below ``<cluster folder>/node``."""

    root: Path
    socket: Path  # containerd's
    containerd_root: Path
    containerd_state: Path
    containerd_config: Path
    runc_root: Path
    cni_conf_dir: Path
    ipam_dir: Path
    kubelet_root: Path
    kubelet_config: Path
    pod_logs: Path
    container_logs: Path
    volume_plugins: Path
    kernel_settings: Path
    var_lib: Path  # the upper and work folders of the kubelet's /var/lib
    corefile: Path
    images: Path

    @classmethod
    def of(cls, layout: Layout) -> NodePaths:
        root = layout.root / "node"
        return cls(
            root=root, socket=root / "containerd.sock",
            # Beside the cluster's folder, not in it: `down` keeps the images loaded into the
            # node (the 4 GB cpu image takes minutes to load again), as it keeps the programs.
            containerd_root=layout.root.parent / f"{layout.root.name}-node-images",
            containerd_state=root / "containerd" / "state",
            containerd_config=root / "containerd.toml", runc_root=root / "runc",
            cni_conf_dir=root / "cni" / "net.d", ipam_dir=root / "cni" / "ipam",
            kubelet_root=root / "kubelet", kubelet_config=root / "kubelet.yaml",
            pod_logs=root / "logs" / "pods", container_logs=root / "logs" / "containers",
            volume_plugins=root / "volume-plugins", kernel_settings=root / "kernel-settings",
            var_lib=root / "var-lib", corefile=root / "Corefile", images=root / "images")


# --- whether and where it can run -----------------------------------------------------------

def _other_node(layout: Layout) -> str | None:
    """The folder of another cluster whose CPU node runs on this machine (it holds the bridge
    and the machine-wide state: one CPU node per machine), or None."""
    owner = network.bridge_owner()
    if not owner or owner == str(layout.root):
        return None
    other = Layout(Path(owner), layout.base_port)
    running = any(processes.alive(other, name) is not None for name in COMPONENTS)
    return owner if running or _busy(other) else None


def _busy(layout: Layout) -> bool:
    """Whether an ``up`` or ``down`` of that cluster holds its lock now (stack._locked)."""
    try:
        with open(layout.root / ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def disabled_reason(layout: Layout) -> str | None:
    """Why ``make cluster`` starts no CPU node here, or None when it does."""
    if os.environ.get("CLUSTER_CPU_NODE", "1").lower() in ("0", "false", "no", "off"):
        return "CLUSTER_CPU_NODE=0"
    if os.geteuid() != 0:
        return "it needs root (network namespaces, mounts, cgroups)"
    if (other := _other_node(layout)) is not None:
        return f"the cluster in {other} runs this machine's one CPU node"
    return None


def check(layout: Layout) -> None:
    """The cheap refusals, before anything builds: missing packages, a socket path too long,
    a pod subnet routed elsewhere."""
    missing = [tool for tool in ("runc", "nft", "unshare") if network.find_tool(tool) is None]
    if not all((CNI_PLUGINS / p).is_file() for p in ("bridge", "host-local", "loopback")):
        missing.append(f"the CNI plugins in {CNI_PLUGINS}")
    if missing:
        raise ClusterError(f"the CPU node needs {', '.join(missing)}, not installed", INSTALL_FIX)
    socket = NodePaths.of(layout).socket
    if len(str(socket)) + len(".ttrpc") > MAX_SOCKET_PATH:
        raise ClusterError(f"containerd's socket path {socket} is too long for a unix socket",
                           "use a shorter GEMMALAB_CLUSTER_HOME")
    network.check_free(str(layout.root))


# --- configuration --------------------------------------------------------------------------

def containerd_config(paths: NodePaths, runc: Path) -> str:
    """containerd's TOML: everything below the node's folder, no NRI or CDI, the imported pause
    as the sandbox image, the CNI bridge, runc with cgroupfs."""
    cri_runtime = 'plugins."io.containerd.cri.v1.runtime"'
    runc_runtime = f"{cri_runtime}.containerd.runtimes.runc"
    return f"""version = 3
root = "{paths.containerd_root}"
state = "{paths.containerd_state}"
# NRI would serve a socket in /var/run/nri; CDI reads /etc/cdi. The node needs neither.
disabled_plugins = ["io.containerd.nri.v1.nri"]

[grpc]
  address = "{paths.socket}"
[ttrpc]
  address = "{paths.socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{paths.root / 'containerd' / 'opt'}"
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "{images.PAUSE_IMAGE}"
[{cri_runtime}]
  # Without CAP_SYS_RESOURCE runc cannot lower a process's oom_score_adj below its own: every
  # sandbox failed ("can't get final child's PID from pipe: EOF").
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  enable_cdi = false
  [{cri_runtime}.containerd]
    default_runtime_name = "runc"
  [{runc_runtime}]
    runtime_type = "io.containerd.runc.v2"
  [{runc_runtime}.options]
    BinaryName = "{runc}"
    Root = "{paths.runc_root}"
    SystemdCgroup = false
  [{cri_runtime}.cni]
    bin_dirs = ["{CNI_PLUGINS}"]
    conf_dir = "{paths.cni_conf_dir}"
    max_conf_num = 1
"""


def kubelet_config(layout: Layout, paths: NodePaths) -> dict[str, Any]:
    """The kubelet's KubeletConfiguration: serving on the bridge's address only, cgroupfs on
    cgroup v1 without QoS cgroups, DNS through CoreDNS, the images it cannot pull never
    collected, no iptables chains."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": network.NODE_IP, "port": KUBELET_PORT, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": layout.port("kubelet-healthz"),
        # The API server (logs, exec) comes with the admin certificate of the cluster's CA.
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                           "x509": {"clientCAFile": str(layout.pki / "ca.crt")}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{paths.socket}",
        # cgroup v1 here (v2 only mounted beside it). The QoS tiers and the pods' cgroups lie
        # below /gemmalab/kubepods, whose limit is the node's allocatable (as on GKE).
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupsPerQOS": True,
        "cgroupRoot": f"/{CGROUP_PARENT}", "enforceNodeAllocatable": ["pods"],
        "clusterDNS": [network.NODE_IP], "clusterDomain": CLUSTER_DOMAIN,
        "resolvConf": "",  # the host's resolver means nothing inside
        "podLogsDir": str(paths.pod_logs), "volumePluginDir": str(paths.volume_plugins),
        "makeIPTablesUtilChains": False,
        # Imported images cannot be pulled again: never garbage-collect them.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        # The node shares the machine's disk with everything else on it (image builds, caches):
        # the default thresholds (15% of the image disk free) put it under disk pressure, its
        # pods Pending, on a disk that still holds tens of GB. Evict only when it is nearly full.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2Gi",
                         "imagefs.available": "2Gi", "nodefs.inodesFree": "1%"},
        "registerWithTaints": [TAINT],
        "serializeImagePulls": False, "rotateCertificates": False,
        "failSwapOn": False,  # a machine with swap keeps its swap; the pods get none
    }


def kubelet_argv(layout: Layout, paths: NodePaths, kubelet: Path) -> list[str]:
    """The kubelet's command: in a mount namespace of its own where the kernel settings it
    would change read as it wants them (flags as --flag=value: the kubelet takes a bare
    value for a command)."""
    labels = {ROLE_LABEL: ROLE, "node.kubernetes.io/instance-type": "local-cpu"}
    args = [str(kubelet), f"--config={paths.kubelet_config}",
            f"--kubeconfig={layout.kubeconfig}", f"--root-dir={paths.kubelet_root}",
            f"--cert-dir={paths.kubelet_root / 'pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={network.NODE_IP}",
            f"--node-labels={','.join(f'{k}={v}' for k, v in labels.items())}", "--v=1"]
    mount = shlex.quote(str(network.find_tool("mount")))
    masks = [f"{mount} --bind {shlex.quote(str(paths.kernel_settings / name.replace('/', '.')))}"
             f" /proc/sys/{name}" for name in KERNEL_SETTINGS]
    upper, work = (shlex.quote(str(paths.var_lib / part)) for part in ("upper", "work"))
    script = " && ".join([
        # Nothing mounted here from now on reaches the host's namespace (the kubelet's root,
        # a mount of its own, stays shared).
        f"{mount} --make-private /", f"{mount} --make-rprivate /proc", *masks,
        # The device manager's socket is /var/lib/kubelet/device-plugins/kubelet.sock, fixed
        # in the kubelet: its /var/lib is the host's with its writes kept in the node's folder.
        f"{mount} -t overlay overlay -o lowerdir=/var/lib,upperdir={upper},workdir={work} "
        "/var/lib", 'exec "$@"'])
    return [str(network.find_tool("unshare")), "--mount", "--propagation", "unchanged", "--",
            "/bin/sh", "-c", script, "kubelet", *args]


def corefile(layout: Layout) -> str:
    """CoreDNS on the bridge's address: the cluster's names from the API server, nothing else
    (no forwarding: the pods have no way out)."""
    return f"""{CLUSTER_DOMAIN}:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {network.NODE_IP}
    errors
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {layout.kubeconfig} gemmalab-local
        pods insecure
        ttl 5
    }}
}}
"""


# --- start ----------------------------------------------------------------------------------

def _ctr(ctr: Path, paths: NodePaths, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ctr), f"--address={paths.socket}",
                           f"--namespace={images.NAMESPACE}", *args],
                          capture_output=True, text=True, timeout=60)


def _kubelet_healthy(layout: Layout) -> Callable[[], bool]:
    def check() -> bool:
        url = f"http://127.0.0.1:{layout.port('kubelet-healthz')}/healthz"
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as answer:
            return answer.read() == b"ok"
        return False
    return check


def _make_bucket_folders() -> None:
    """The folders the CPU profile mounts at /data and /outputs (``k8s.config.local_volumes``),
    standing for the buckets: writable by the image's user, and kept by ``down`` (a run's
    outputs outlive the cluster, as a bucket's do)."""
    from gemmalab.k8s.config import RUN_AS_USER, local_volumes

    for folder in local_volumes():
        folder.mkdir(parents=True, exist_ok=True)
        os.chown(folder, RUN_AS_USER, RUN_AS_USER)


def start(layout: Layout, binaries: dict[str, Path], log: Callable[[str], None]) -> None:
    """The bridge, containerd (with the pause image), the kubelet and CoreDNS; returns once the
    kubelet answers (the node registers and turns Ready a moment later)."""
    paths, started = NodePaths.of(layout), time.monotonic()
    runc = network.find_tool("runc")
    if runc is None:
        raise ClusterError("the CPU node needs runc, not installed", INSTALL_FIX)
    for folder in (paths.cni_conf_dir, paths.ipam_dir, paths.pod_logs, paths.container_logs,
                   paths.volume_plugins, paths.kernel_settings, paths.images,
                   paths.var_lib / "upper", paths.var_lib / "work"):
        folder.mkdir(parents=True, exist_ok=True)
    _make_bucket_folders()
    network.setup(str(layout.root), layout.port("kube-apiserver"))
    (paths.cni_conf_dir / "10-gemmalab.conflist").write_text(
        json.dumps(network.cni_config(paths.ipam_dir), indent=2))
    paths.containerd_config.write_text(containerd_config(paths, runc))
    path = os.pathsep.join([str(binaries["containerd-shim-runc-v2"].parent), str(runc.parent),
                            "/usr/sbin:/usr/bin:/sbin:/bin"])
    processes.start(layout, "containerd",
                    [str(binaries["containerd"]), f"--config={paths.containerd_config}"],
                    {"PATH": path})
    processes.wait("containerd", lambda: paths.socket.exists() and _ctr(
        binaries["ctr"], paths, "version").returncode == 0, layout, "containerd")
    images.import_archive(binaries["ctr"], paths.socket,
                          images.pause_archive(paths.images / "pause.tar", binaries["pause"]))

    for name, value in KERNEL_SETTINGS.items():
        (paths.kernel_settings / name.replace("/", ".")).write_text(value + "\n")
    paths.kubelet_config.write_text(yaml.safe_dump(kubelet_config(layout, paths),
                                                   sort_keys=False))
    host.share(paths.kubelet_root, network.find_tool("mount"))
    host.make_cgroup(CGROUP_PARENT)
    processes.start(layout, "kubelet", kubelet_argv(layout, paths, binaries["kubelet"]),
                    {"GEMMALAB_CONTAINER_LOGS_DIR": str(paths.container_logs)})
    paths.corefile.write_text(corefile(layout))
    processes.start(layout, "coredns", [str(binaries["coredns"]), "-conf", str(paths.corefile)])
    processes.wait("the kubelet", _kubelet_healthy(layout), layout, "kubelet")
    processes.wait("CoreDNS", processes.listening(53, network.NODE_IP), layout, "coredns")
    log(f"CPU node {NODE_NAME} up in {time.monotonic() - started:.1f} s: kubelet "
        f"{build.KUBERNETES_VERSION}, containerd "
        f"{build.CONTAINERD_VERSION}, CoreDNS {build.COREDNS_VERSION}; pods on "
        f"{network.BRIDGE} {network.POD_SUBNET}, label/taint {ROLE_LABEL}={ROLE}")


def pod_placement() -> dict[str, Any]:
    """The pod-spec fields that put a pod on the CPU node: its selector and toleration."""
    return {"nodeSelector": {ROLE_LABEL: ROLE},
            "tolerations": [{"key": ROLE_LABEL, "operator": "Equal", "value": ROLE,
                             "effect": "NoSchedule"}]}


# --- stop and clean up ----------------------------------------------------------------------

def stop(layout: Layout) -> list[str]:
    """Stop CoreDNS and the kubelet, kill and delete every container, stop containerd; the
    components that ran."""
    paths = NodePaths.of(layout)
    stopped = [name for name in ("coredns", "kubelet") if processes.stop(layout, name)]
    if processes.alive(layout, "containerd") is not None:
        ctr = build.CTR.path()
        if ctr.is_file():
            tasks = _ctr(ctr, paths, "tasks", "ls", "-q").stdout.split()
            if tasks:
                _ctr(ctr, paths, "tasks", "rm", "-f", *tasks)
            containers = _ctr(ctr, paths, "containers", "ls", "-q").stdout.split()
            if containers:
                _ctr(ctr, paths, "containers", "rm", *containers)
            deadline = time.monotonic() + 5  # the shims end once their tasks are gone
            while host.shims(paths.socket) and time.monotonic() < deadline:
                time.sleep(0.1)
        processes.stop(layout, "containerd")
        stopped.append("containerd")
    return stopped


def cleanup(layout: Layout, *, wipe: bool) -> list[str]:
    """Take away what the node leaves when it stops or dies: shims and containers, mounts
    below its folder, its cgroups, the bridge and its table, the shims' socket folder; with
    ``wipe`` its folder too (containerd's image store, beside it, stays). What was removed, for
    the log."""
    paths = NodePaths.of(layout)
    if os.geteuid() != 0:
        return []
    # The machine-wide state (cgroups, bridge, table) is another cluster's while its node runs.
    machine_wide = _other_node(layout) is None
    removed = []
    # What a killed containerd left: its shims (named by its socket; their sockets too) and
    # the containers' processes (by their cgroups).
    shims = host.shims(paths.socket)
    if leftovers := set(shims) | (host.cgroup_pids(CGROUP_PARENT) if machine_wide else set()):
        host.kill(leftovers)
        removed.append(f"{len(leftovers)} leftover processes")
    for socket in shims.values():
        socket.unlink(missing_ok=True)
    for folder in (paths.root, paths.containerd_root):
        if folder.exists() and (left := host.unmount_below(folder)):
            raise ClusterError(f"{len(left)} mounts below {folder} stay mounted "
                               f"(first: {left[0]})", "unmount them (umount -l), then retry")
    if machine_wide:
        if cgroups := host.remove_cgroup(CGROUP_PARENT):
            removed.append(f"{cgroups} cgroups")
        removed += network.teardown()
        for folder in (host.SHIM_SOCKETS / "s", host.SHIM_SOCKETS):  # only if empty
            with contextlib.suppress(OSError):
                folder.rmdir()
    if wipe and paths.root.exists():
        shutil.rmtree(paths.root)
    return removed


def load_image(archive: Path, layout: Layout | None = None, base_name: str | None = None
               ) -> list[str]:
    """Import an OCI or ``docker save`` archive into the CPU node's containerd (no registry);
    the image names it brought. Pods on the node use them with ``imagePullPolicy: Never`` or
    ``IfNotPresent`` (a ``:latest`` tag defaults to Always, and a pull fails here)."""
    layout = layout or Layout.default()
    if processes.alive(layout, "containerd") is None:
        raise ClusterError("the cluster's CPU node is not running", "make cluster")
    ctr = build.CTR.path()
    return images.import_archive(ctr, NodePaths.of(layout).socket, archive, base_name)


def image_labels(name: str, layout: Layout | None = None) -> dict[str, str]:
    """The node's containerd labels of image ``name`` ({} if it does not hold it)."""
    return images.labels(build.CTR.path(), NodePaths.of(layout or Layout.default()).socket, name)


def label_image(name: str, key: str, value: str, layout: Layout | None = None) -> None:
    images.set_label(build.CTR.path(), NodePaths.of(layout or Layout.default()).socket, name,
                     key, value)


def rss_mib(layout: Layout) -> dict[str, float]:
    """The resident memory of the node's processes, MiB (the report's and the tests')."""
    sizes = {}
    for name in COMPONENTS:
        if (pid := processes.alive(layout, name)) is not None:
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{pid}/status").read_text()
                kib = next(int(line.split()[1]) for line in status.splitlines()
                           if line.startswith("VmRSS:"))
                sizes[name] = kib / 1024
    return sizes
