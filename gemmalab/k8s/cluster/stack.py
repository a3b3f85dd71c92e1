"""Start, check and stop the local cluster's processes.

Everything runs as plain processes of the user's, on 127.0.0.1 ports from ``CLUSTER_PORT``
(default 16400) up, with its state (etcd's data, keys, logs, pid files, the kubeconfig) in
``<cluster home>/run``. ``up`` is idempotent: a cluster that answers is reused. As root, the
stack includes a real CPU node (``node``: containerd, kubelet, CoreDNS on the bridge
``gemmalab0``); ``down`` takes away everything it made on the machine.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import fcntl
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from gemmalab.k8s.cluster import build, network, node, nodes, pki, processes
from gemmalab.k8s.cluster.errors import ClusterError
from gemmalab.k8s.cluster.layout import DEFAULT_BASE_PORT, PORT_OFFSETS, Layout

__all__ = ["DEFAULT_BASE_PORT", "PORT_OFFSETS", "Layout", "up", "down", "running_components"]

CONTROL_PLANE_COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager",
                            "kube-scheduler", "jobset", "kueue", "kwok")
COMPONENTS = CONTROL_PLANE_COMPONENTS + node.COMPONENTS  # in start order
# What `make cluster` applies once the controllers run, as scripts/gke/*.sh do on GKE: the
# runs' service account (GKE: setup-storage.sh) and the queue (install-kueue.sh).
RUNNER_SERVICE_ACCOUNT = "gemmalab-runner"
QUEUE_MANIFEST = build.REPO_ROOT / "k8s" / "kueue-v6e.yaml"
# Pods start at once (the fast set's pod-ready; the general set's four start-up stages cost
# ~15 s of jitter), then complete after the general pod-complete's delay (1 s + up to 5 s,
# or a pod's own: annotation pod-complete.stage.kwok.x-k8s.io/delay), or fail on demand (the
# chaos stage: label pod-container-running-failed.stage.kwok.x-k8s.io=true).
KWOK_STAGES = ("node/fast/node-initialize.yaml", "node/heartbeat/node-heartbeat.yaml",
               "pod/fast/pod-ready.yaml", "pod/general/pod-complete.yaml",
               "pod/chaos/pod-container-running-failed.yaml")  # + cluster/kwok-stages.yaml
LOCAL_STAGES = build.REPO_ROOT / "cluster" / "kwok-stages.yaml"
FAKE_CONTAINER_LOG = build.REPO_ROOT / "cluster" / "fake-container.log"
# Kueue's webhooks for the kinds gemmalab submits and Kueue's own; the others (pods,
# deployments, Ray, ...) would intercept objects of frameworks this cluster does not run.
KUEUE_WEBHOOK_GROUPS = {"batch", "jobset.x-k8s.io", "kueue.x-k8s.io"}
KUEUE_CERT_SECRET = "kueue-webhook-server-cert"
KUEUE_CONVERTED_CRDS = ("localqueues", "clusterqueues", "cohorts", "workloads",
                        "multikueueclusters")


def _tls_context(layout: Layout) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    context.load_cert_chain(layout.pki / "admin.crt", layout.pki / "admin.key")
    return context


def api_ready(layout: Layout, timeout_s: float = 2.0) -> bool:
    """Whether the API server at the layout's port answers /readyz with this cluster's CA."""
    if not (layout.pki / "ca.crt").is_file():
        return False
    try:
        with urllib.request.urlopen(f"{layout.server}/readyz", timeout=timeout_s,
                                    context=_tls_context(layout)) as response:
            return response.read().strip() == b"ok"
    except (OSError, ssl.SSLError):
        return False


def _port_holder(port: int) -> str | None:
    """None if 127.0.0.1:port can be bound now, else a description of the problem."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_ports(layout: Layout) -> None:
    for name, offset in PORT_OFFSETS.items():
        port = layout.base_port + offset
        if (problem := _port_holder(port)) is not None:
            raise ClusterError(
                f"port {port} (for {name}) on 127.0.0.1 cannot be used: {problem}",
                f"stop what listens there (ss -ltnp 'sport = :{port}'), or move the cluster's "
                f"ports: make cluster CLUSTER_PORT={layout.base_port + 100} (and the same "
                "CLUSTER_PORT for make cluster-down and make test)")


# --- kubectl -------------------------------------------------------------------------------

def kubectl(layout: Layout, *args: str, stdin: str | None = None) -> str:
    binary = build.CONTROL_PLANE.path()
    done = subprocess.run([str(binary), "kubectl", f"--kubeconfig={layout.kubeconfig}",
                           f"--cache-dir={layout.root / 'kubectl-cache'}", *args],
                          input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"kubectl {' '.join(args[:2])} failed: "
                           f"{(done.stderr.strip().splitlines() or ['?'])[-1][:300]}",
                           f"read the logs in {layout.root / 'logs'}")
    return done.stdout


def _apply(layout: Layout, docs: list[dict[str, Any]], *, server_side: bool = False) -> None:
    args = ["apply", "-f", "-"] + (["--server-side", "--force-conflicts"] if server_side else [])
    kubectl(layout, *args, stdin=yaml.safe_dump_all(docs, sort_keys=False))


# --- what the controllers' releases ship, made to run on loopback ---------------------------

def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _on_loopback(webhook: dict[str, Any], port: int, ca_bundle: str) -> dict[str, Any]:
    webhook = copy.deepcopy(webhook)
    path = webhook["clientConfig"]["service"].get("path", "")
    webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca_bundle}
    return webhook


def jobset_objects(source: Path, layout: Layout, ca_bundle: str) -> list[dict[str, Any]]:
    """JobSet's CRD and webhook configurations from its module, as its kustomization patches
    them (the pod webhooks only for JobSet's pods), served on loopback."""
    components = source / "config" / "components"
    crds = _load(components / "crd" / "bases" / "jobset.x-k8s.io_jobsets.yaml")
    patches = {doc["value"]["name"]: doc["value"] for path in
               sorted((components / "webhook" / "patches").glob("*.yaml"))
               for doc in yaml.safe_load(path.read_text())}
    port = layout.port("jobset-webhook")
    configs = []
    for config in _load(components / "webhook" / "manifests.yaml"):
        config["metadata"]["name"] = f"jobset-{config['metadata']['name']}"
        config["webhooks"] = [_on_loopback(patches.get(w["name"], w), port, ca_bundle)
                              for w in config["webhooks"]]
        configs.append(config)
    return crds + configs


def kueue_objects(source: Path, layout: Layout, ca_bundle: str) -> list[dict[str, Any]]:
    """Kueue's CRDs (with their conversion webhook, as its kustomization sets it) and the webhooks
    for Jobs, JobSets and Kueue's own objects, served on loopback."""
    components = source / "config" / "components"
    port = layout.port("kueue-webhook")
    crds = [doc for path in sorted((components / "crd" / "bases").glob("*.yaml"))
            for doc in _load(path)]
    for crd in crds:
        if crd["spec"]["names"]["plural"] in KUEUE_CONVERTED_CRDS:
            crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "conversionReviewVersions": ["v1"],
                "clientConfig": {"url": f"https://127.0.0.1:{port}/convert",
                                 "caBundle": ca_bundle}}}
    not_system = {"matchExpressions": [{"key": "kubernetes.io/metadata.name",
                                        "operator": "NotIn",
                                        "values": ["kube-system", "kueue-system"]}]}
    configs = []
    for config in _load(components / "webhook" / "manifests.yaml"):
        config["metadata"]["name"] = f"kueue-{config['metadata']['name']}"
        kept = []
        for webhook in config["webhooks"]:
            groups = {g for rule in webhook.get("rules", []) for g in rule.get("apiGroups", [])}
            if groups & KUEUE_WEBHOOK_GROUPS:
                webhook = _on_loopback(webhook, port, ca_bundle)
                if groups - {"kueue.x-k8s.io"}:
                    webhook["namespaceSelector"] = not_system
                kept.append(webhook)
        config["webhooks"] = kept
        configs.append(config)
    return crds + configs


def kwok_config(source: Path) -> list[dict[str, Any]]:
    """kwok's stages (its own and ours) and its logs: every fake container's log is one file
    that says it is fake (the API server reads it through the node, as a kubelet's)."""
    stages = [doc for name in KWOK_STAGES
              for doc in _load(source / "kustomize" / "stage" / name)]
    logs = {"apiVersion": "kwok.x-k8s.io/v1alpha1", "kind": "ClusterLogs",
            "metadata": {"name": "fake-containers"},
            "spec": {"logs": [{"logsFile": str(FAKE_CONTAINER_LOG)}]}}
    return stages + _load(LOCAL_STAGES) + [logs]


# --- the components -------------------------------------------------------------------------

def _control_plane_args(layout: Layout, kube: Path) -> dict[str, list[str]]:
    p, pki_dir, kubeconfig = layout.port, layout.pki, str(layout.kubeconfig)
    client_auth = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                   f"--authorization-kubeconfig={kubeconfig}", "--bind-address=127.0.0.1",
                   "--leader-elect=false"]
    return {
        "etcd": [
            shutil.which("etcd") or "etcd", "--name=gemmalab",
            f"--data-dir={layout.root / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{p('etcd')}",
            f"--advertise-client-urls=http://127.0.0.1:{p('etcd')}",
            f"--listen-peer-urls=http://127.0.0.1:{p('etcd-peer')}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{p('etcd-peer')}",
            f"--initial-cluster=gemmalab=http://127.0.0.1:{p('etcd-peer')}",
            # Without progress notifications the API server's watch cache goes stale on etcd
            # 3.4 (watches answer 504 "Too large resource version" and watchers hang).
            "--experimental-watch-progress-notify-interval=1s", "--log-level=warn"],
        "kube-apiserver": [
            str(kube), "kube-apiserver", f"--etcd-servers=http://127.0.0.1:{p('etcd')}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
            f"--secure-port={p('kube-apiserver')}", f"--cert-dir={layout.root / 'apiserver'}",
            f"--tls-cert-file={pki_dir / 'serving.crt'}",
            f"--tls-private-key-file={pki_dir / 'serving.key'}",
            f"--client-ca-file={pki_dir / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki_dir / 'service-accounts.pub'}",
            f"--service-account-signing-key-file={pki_dir / 'service-accounts.key'}",
            f"--service-cluster-ip-range={network.SERVICE_CIDR}", "--authorization-mode=RBAC",
            "--allow-privileged=true", "--profiling=false",
            # Logs and exec through the CPU node's kubelet, which asks for a client certificate
            # of the cluster's CA, at its InternalIP (its Hostname, cpu-0, resolves nowhere).
            f"--kubelet-client-certificate={pki_dir / 'admin.crt'}",
            f"--kubelet-client-key={pki_dir / 'admin.key'}",
            "--kubelet-preferred-address-types=InternalIP,Hostname",
            # Streaming lists (WatchList) need etcd's progress requests, which Debian's etcd
            # 3.4 lacks: watches that asked for them ended at once, and kwok, relisting after
            # each, saw pods 30-60 s late. Off, the API server serves plain list + watch.
            "--feature-gates=WatchList=false"],
        "kube-controller-manager": [
            str(kube), "kube-controller-manager", *client_auth,
            f"--secure-port={p('kube-controller-manager')}",
            f"--service-account-private-key-file={pki_dir / 'service-accounts.key'}",
            f"--root-ca-file={pki_dir / 'ca.crt'}", "--use-service-account-credentials=false",
            # kwok's heartbeat comes every 20-45 s; the default 50 s grace would flap nodes.
            "--node-monitor-grace-period=120s", "--profiling=false",
            # Its default, /usr/libexec/kubernetes/kubelet-plugins/volume/exec, it would make.
            f"--flex-volume-plugin-dir={layout.root / 'flex-volume-plugins'}"],
        "kube-scheduler": [
            str(kube), "kube-scheduler", *client_auth, f"--secure-port={p('kube-scheduler')}",
            "--profiling=false"],
    }


def _controller_configs(layout: Layout) -> dict[str, dict[str, Any]]:
    # "0" turns the metrics and health endpoints off: nothing else listens.
    off = {"metrics": {"bindAddress": "0"}, "health": {"healthProbeBindAddress": "0"},
           "leaderElection": {"leaderElect": False}}
    return {
        "jobset": {"apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
                   **off, "internalCertManagement": {"enable": False},
                   "webhook": {"host": "127.0.0.1", "port": layout.port("jobset-webhook"),
                               "certDir": str(layout.pki / "webhook")}},
        # Without its own certificate management Kueue reads a metrics certificate from
        # /etc/kueue/metrics/certs, whatever its configuration says: it manages them, and keeps
        # the ones it finds in its Secret (kueue_secret), which are this cluster's.
        "kueue": {"apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
                  "namespace": "kueue-system", **off,
                  "internalCertManagement": {"enable": True,
                                             "webhookServiceName": "kueue-webhook-service",
                                             "webhookSecretName": KUEUE_CERT_SECRET},
                  "webhook": {"host": "127.0.0.1", "port": layout.port("kueue-webhook"),
                              # the Secret's files, as a pod would mount them
                              "certDir": str(layout.pki / "webhook")},
                  "integrations": {"frameworks": ["batch/job", "jobset.x-k8s.io/jobset"]}},
    }


def kueue_secret(layout: Layout) -> dict[str, Any]:
    def encoded(name: str) -> str:
        return base64.b64encode((layout.pki / name).read_bytes()).decode()

    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": KUEUE_CERT_SECRET, "namespace": "kueue-system"},
            "data": {"ca.crt": encoded("ca.crt"), "ca.key": encoded("ca.key"),
                     "tls.crt": encoded("serving.crt"), "tls.key": encoded("serving.key")}}


@contextlib.contextmanager
def _locked(layout: Layout) -> Iterator[None]:
    """One ``up`` or ``down`` at a time (test workers, a second terminal)."""
    layout.root.mkdir(parents=True, exist_ok=True)
    with open(layout.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def running_components(layout: Layout) -> list[str]:
    return [name for name in COMPONENTS if processes.alive(layout, name) is not None]


def expected_components(layout: Layout) -> list[str]:
    """What a whole cluster runs here: the control plane, and the CPU node where it can run
    (root, CLUSTER_CPU_NODE not 0, no other cluster's node on this machine)."""
    with_node = (node.disabled_reason(layout) is None
                 or processes.alive(layout, "kubelet") is not None)
    return list(COMPONENTS if with_node else CONTROL_PLANE_COMPONENTS)


def up(layout: Layout | None = None, log: Callable[[str], None] = print) -> Layout:
    """Build what is missing, start what is not running, and return the cluster's layout."""
    layout = layout or Layout.default()
    with _locked(layout):
        if running_components(layout) == expected_components(layout) and api_ready(layout):
            log(f"reusing the cluster already running at {layout.server}")
            return layout
        # The cheap checks first: a busy port or a missing etcd is said before a long build.
        _stop_all(layout)
        if removed := node.cleanup(layout, wipe=False):  # what a killed node left
            log(f"removed what the last CPU node left: {', '.join(removed)}")
        check_ports(layout)
        if shutil.which("etcd") is None:
            raise ClusterError("etcd is not installed",
                               "install Debian's etcd-server (sudo apt-get install etcd-server)")
        go = build.go_command()
        without_node = node.disabled_reason(layout)
        if without_node is None:
            node.check(layout)
        binaries = build.build_all(log, go, node=without_node is None)
        started = time.monotonic()
        _start_stack(layout, binaries, go, log, with_node=without_node is None)
        if without_node is not None:
            log(f"no CPU node: {without_node}")
        log(f"cluster up in {time.monotonic() - started:.1f} s")
        return layout


def _start_stack(layout: Layout, binaries: dict[str, Path], go: str,
                 log: Callable[[str], None], *, with_node: bool) -> None:
    pki.ensure(layout.pki)
    layout.kubeconfig.write_text(pki.kubeconfig(layout.pki, layout.server))
    ca_bundle = base64.b64encode((layout.pki / "ca.crt").read_bytes()).decode()
    args = _control_plane_args(layout, binaries["kube"])
    kube_env = {"KUBECONFIG": str(layout.kubeconfig)}

    processes.start(layout, "etcd", args["etcd"])
    processes.wait("etcd", processes.listening(layout.port("etcd")), layout, "etcd")
    processes.start(layout, "kube-apiserver", args["kube-apiserver"])
    processes.wait("the API server", lambda: api_ready(layout), layout, "kube-apiserver")
    for name in ("kube-controller-manager", "kube-scheduler"):
        processes.start(layout, name, args[name])
    if with_node:  # it registers while the controllers start
        node.start(layout, binaries, log)

    jobset_source = build.module_dir(go, "sigs.k8s.io/jobset", build.JOBSET_VERSION)
    kueue_source = build.module_dir(go, "sigs.k8s.io/kueue", build.KUEUE_VERSION)
    kwok_source = build.module_dir(go, "sigs.k8s.io/kwok", build.KWOK_VERSION)
    namespaces = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
                  for name in ("jobset-system", "kueue-system")]
    # The CRDs are too large for client-side apply's annotation (JobSet's is ~820 KB). The
    # webhooks are registered before either controller starts: no JobSet is ever created
    # without JobSet's defaulting (its controller panics on a nil successPolicy).
    _apply(layout, namespaces + jobset_objects(jobset_source, layout, ca_bundle)
           + kueue_objects(kueue_source, layout, ca_bundle) + [kueue_secret(layout)],
           server_side=True)
    kubectl(layout, "wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")

    for name, config in _controller_configs(layout).items():
        path = layout.root / f"{name}-config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        extra = ["--feature-gates=VisibilityOnDemand=false"] if name == "kueue" else []
        processes.start(layout, name, [str(binaries[name]), f"--config={path}", *extra], kube_env)
    (layout.root / "kwok.yaml").write_text(
        yaml.safe_dump_all(kwok_config(kwok_source), sort_keys=False))
    # The nodes' kubelet endpoint is kwok's own server on loopback: the API server reads pod
    # logs from it (kubectl logs, client.tail_logs) as it would from a kubelet.
    processes.start(layout, "kwok", [
        str(binaries["kwok"]), f"--kubeconfig={layout.kubeconfig}",
        f"--config={layout.root / 'kwok.yaml'}", "--manage-all-nodes=false",
        f"--manage-nodes-with-annotation-selector={nodes.KWOK_ANNOTATION}=fake",
        "--node-lease-duration-seconds=0", f"--cidr={network.KWOK_POD_CIDR}", "--node-ip=127.0.0.1",
        f"--node-port={layout.port('kwok')}",
        f"--server-address=127.0.0.1:{layout.port('kwok')}",
        f"--tls-cert-file={layout.pki / 'serving.crt'}",
        f"--tls-private-key-file={layout.pki / 'serving.key'}"])
    for name, port in (("jobset", "jobset-webhook"), ("kueue", "kueue-webhook")):
        processes.wait(f"{name}'s webhook server", processes.listening(layout.port(port)),
                       layout, name, timeout_s=120)
    _apply(layout, nodes.fake_nodes())
    kubectl(layout, "wait", "--for=condition=Ready", "--timeout=60s", "node", "--all")
    _apply(layout, [{"apiVersion": "v1", "kind": "ServiceAccount",
                     "metadata": {"name": RUNNER_SERVICE_ACCOUNT, "namespace": "default"}}])
    _apply_with_retry(layout, _load(QUEUE_MANIFEST))
    if with_node:
        _wait_for_node(layout, node.NODE_NAME)
    log(f"nodes: {len(nodes.fake_nodes())} fake TPU v6e hosts ({', '.join(
        f'{p.slices} x {p.topology}' for p in nodes.DEFAULT_POOLS)} slices)"
        + (f", 1 real CPU node ({node.NODE_NAME})" if with_node else "")
        + f"; queue: {QUEUE_MANIFEST.relative_to(build.REPO_ROOT)}")


def _wait_for_node(layout: Layout, name: str, timeout_s: float = 90) -> None:
    """Until the kubelet's node has registered and turned Ready."""
    def registered() -> bool:
        return bool(kubectl(layout, "get", "node", "--ignore-not-found", "-o", "name",
                            f"--field-selector=metadata.name={name}").strip())
    processes.wait(f"node {name}", registered, layout, "kubelet", timeout_s=timeout_s)
    kubectl(layout, "wait", "--for=condition=Ready", f"--timeout={timeout_s:.0f}s",
            f"node/{name}")


def _apply_with_retry(layout: Layout, docs: list[dict[str, Any]], timeout_s: float = 60) -> None:
    """Kueue's webhooks answer a moment after its port opens (its caches sync first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _apply(layout, docs)
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _stop_all(layout: Layout, timeout_s: float = 15) -> list[str]:
    # The node first (its containers before containerd), then controllers, etcd last.
    stopped = node.stop(layout)
    for name in reversed(CONTROL_PLANE_COMPONENTS):
        if processes.stop(layout, name, timeout_s):
            stopped.append(name)
    return stopped


def down(layout: Layout | None = None, *, wipe: bool = True,
         log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Stop every component and take away what the CPU node made on this machine (containers,
    mounts, cgroups, the bridge, its nftables table); ``wipe`` also removes etcd's data and the
    node's images (the next ``up`` starts empty). The built binaries stay in the cache."""
    layout = layout or Layout.default()
    with _locked(layout):
        stopped = _stop_all(layout)
        if removed := node.cleanup(layout, wipe=wipe):
            log(f"removed {', '.join(removed)}")
        if wipe:
            shutil.rmtree(layout.root / "etcd", ignore_errors=True)
        return stopped
