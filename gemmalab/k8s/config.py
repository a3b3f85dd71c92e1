"""ClusterConfig: where and on what the training notebook runs on GKE, validated in one place.

Placeholder convention (see k8s/README.md): the project is ``my-project``; buckets, image and
service account are derived from it unless given, so rendering for your own project is one
``--project`` flag (plus ``--region``/``--zone`` where v6e is offered to you).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gemmalab.config import FLAT_NAMES, TrainConfig
from gemmalab.data_parallel import batch_ways, check_batch_split, check_expert_axis
from gemmalab.errors import ConfigError, require
from gemmalab.k8s import accelerators
from gemmalab.k8s.accelerators import HostResources, TpuSlice
from gemmalab.k8s.notebook import NOTEBOOK, notebook_parameters
from gemmalab.weights import resolution

DEFAULT_PROJECT = "my-project"
DEFAULT_REGION = "us-east5"
DEFAULT_ZONE = "us-east5-b"
DEFAULT_SERVICE_ACCOUNT = "gemmalab-runner"
ARTIFACT_REPOSITORY = "gemmalab"

DATA_MOUNT = "/data"  # data bucket, read-only
OUTPUTS_MOUNT = "/outputs"  # outputs bucket: run outputs, checkpoints, xprof traces
CACHE_MOUNT = "/cache"  # emptyDir: corpora, tokenizers, token caches
# JAX's compiled programs in the outputs bucket: a pod that JobSet restarts after a preemption,
# and the next job of the same shape, load their steps instead of compiling them again.
COMPILE_CACHE_DIR = f"{OUTPUTS_MOUNT}/.jax-compile"
RUN_AS_USER = 1000  # the image's non-root user (Dockerfile: useradd --uid 1000)
PROFILER_PORT = 9002  # jax.profiler server, for XProf's "capture profile"
JAX_COORDINATOR_PORT = 1234  # GPU multi-node: jax.distributed coordinator on process 0
REPLICATED_JOB = "slice"  # JobSet replicatedJob name: one child Job per TPU slice
MAX_NAME = 63  # DNS label limit (pod hostnames, label values, service names)

# The image `make image` builds and loads into the local cluster's node: buildah's name for a
# local image, which the node's containerd keeps (no registry, nothing pulled).
LOCAL_CPU_IMAGE = "localhost/gemmalab-cpu:{version}"


def local_volumes() -> tuple[Path, Path]:
    """The local cluster's directories standing for the data and outputs buckets (/data and
    /outputs in its CPU pods; writable by the image's user)."""
    from gemmalab.k8s.cluster.build import cluster_home

    return cluster_home() / "volumes" / "data", cluster_home() / "volumes" / "outputs"


# Set from the cluster config, never by the user: the container's paths.
MANAGED_PARAMS = ("output_dir", "cache_dir", "compile_cache_dir")

_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_PROJECT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_SERVICE_ACCOUNT = re.compile(r"^[a-z][-a-z0-9]{4,28}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_BUCKET = re.compile(r"^[a-z0-9][-a-z0-9_.]{1,61}[a-z0-9]$")
_IMAGE = re.compile(
    r"^[a-z0-9]+([._-][a-z0-9]+)*(\.[a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-]+[a-z0-9]+)*)+"
    r"(?P<ref>:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$"
)


def is_dns_1035_label(name: str) -> bool:
    """A valid Job/JobSet/Service name: lowercase letters, digits, '-', a letter first."""
    return isinstance(name, str) and bool(_DNS_1035.match(name)) and len(name) <= MAX_NAME


def package_version() -> str:
    """gemmalab's version: the tag of the placeholder image."""
    return importlib.metadata.version("gemmalab")


def check_notebook_params(params: Any, notebook: str = NOTEBOOK, *,
                          managed: tuple[str, ...] = MANAGED_PARAMS,
                          managed_by: str = "the cluster config",
                          managed_fix: str = f"leave it out: outputs go to {OUTPUTS_MOUNT}/"
                                             f"<job_name>, the cache to {CACHE_MOUNT}, "
                                             f"compiled steps to {COMPILE_CACHE_DIR}"
                          ) -> tuple[TrainConfig, dict[str, Any] | None]:
    """Check papermill parameters for ``notebook`` before anything runs: names the notebook
    takes (its parameters cell and every TrainConfig field) and not ``managed`` by the caller
    (``managed_by``), values TrainConfig accepts. Returns the resolved TrainConfig and the
    notebook's defaults (None when the notebook is not at hand, e.g. inside the image)."""
    if not isinstance(params, Mapping):
        raise ConfigError("params", f"{type(params).__name__} is not a dict",
                          "pass papermill parameters as {name: value}")
    # The repository's notebook when it is at hand (not inside the image): unknown names
    # would be injected by papermill and silently ignored by the notebook.
    defaults = notebook_parameters() if notebook == NOTEBOOK else None
    # The notebook takes the names of its parameters cell and every TrainConfig field.
    known = None if defaults is None else {*defaults, *FLAT_NAMES}
    for name in params:
        require(isinstance(name, str) and name.isidentifier(), "params",
                f"{name!r} is not a parameter name", "use the notebook's variable names")
        require(name not in managed, f"params.{name}", f"is set from {managed_by}",
                managed_fix)
        if known is not None:
            require(name in known, f"params.{name}", f"is not a parameter of {notebook}",
                    f"use one of {', '.join(sorted(set(known) - set(managed)))}")
    try:
        # As the notebook builds it: its recipe (its own default, or the one given), then fields.
        resolved = resolution.resolve(
            TrainConfig.from_parameters({**(defaults or {}), **params})).config
    except ConfigError as e:
        raise ConfigError(f"params.{e.parameter}", e.problem, e.fix) from None
    except TypeError as e:
        raise ConfigError("params", f"a value has the wrong type ({e})",
                          "use the types of the notebook's defaults") from None
    return resolved, defaults


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """One training run on GKE, or on the local cluster's CPU node (``accelerator="cpu"``, `make
    cluster`: the same objects but for the node, the resources and the volumes). Every field is
    checked on construction (one-line ConfigError)."""

    job_name: str = "gemma3-train"
    # "" = <region>-docker.pkg.dev/<project>/gemmalab/gemmalab-<tpu|gpu>:<version>, or for the
    # CPU node the image `make image` loads into it (LOCAL_CPU_IMAGE).
    image: str = ""
    project: str = DEFAULT_PROJECT
    region: str = DEFAULT_REGION
    zone: str = DEFAULT_ZONE
    namespace: str = "default"
    service_account: str = DEFAULT_SERVICE_ACCOUNT  # Kubernetes SA = Google SA account id
    data_bucket: str = ""  # "" = <project>-gemmalab-data (mounted read-only at /data)
    outputs_bucket: str = ""  # "" = <project>-gemmalab-outputs (read-write at /outputs)

    # TPU: generation + topology (+ slices). GPU: type + GPUs per node + nodes. CPU: hosts
    # (pods, one JAX process each) as nodes, on the local cluster's node.
    accelerator: str = "v6e"  # v5e | v5p | v6e | h100 | h200 | cpu
    topology: str = "1x1"  # TPU only
    num_slices: int = 1  # TPU only; > 1 is multislice (one node pool per slice)
    chips_per_host: int | None = None  # TPU only; None = GKE's usual machine type
    gpus_per_node: int = 8  # GPU only
    num_nodes: int = 1  # GPU and CPU only
    # CPU only: the node's directories mounted at /data (read-only) and /outputs, standing for
    # the GCS FUSE buckets ("" = the local cluster's, under its home: LOCAL_VOLUMES).
    local_data_dir: str = ""
    local_outputs_dir: str = ""

    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # papermill parameters
    notebook: str = NOTEBOOK
    profiling: bool = False  # expose the jax.profiler port
    termination_grace_period_s: int = 120
    backoff_limit: int = 0  # single-host Job: pod retries
    max_restarts: int = 0  # JobSet: restarts of the whole set after a failure
    ttl_after_finished_s: int = 3 * 24 * 3600  # keep finished jobs (and logs) for 3 days
    active_deadline_s: int | None = None  # wall-clock limit of an attempt; past it the run fails
    cache_size_gi: int = 20  # emptyDir for the cache dir (node boot disk)

    # Kueue (gemmalab.k8s.kueue): the LocalQueue a run is submitted to ("" = not queued: the run
    # starts as soon as it is created). For rendering the queue itself: how many slices of each
    # topology it admits at once (the google.com/tpu quota), and whether admission waits for
    # GKE's flex-start (Dynamic Workload Scheduler) to provision the nodes.
    queue: str = ""
    queue_quota: Mapping[str, int] = dataclasses.field(default_factory=dict)
    flex_start: bool = False

    def __post_init__(self) -> None:
        self._check_names()
        self._check_accelerator()
        self._check_params()
        self._check_lifecycle()
        self._check_queue()

    # ---- validation -------------------------------------------------------------------------

    def _check_names(self) -> None:
        require(bool(_DNS_1035.match(self.job_name)), "job_name",
                f"{self.job_name!r} is not a DNS-1035 label",
                "use lowercase letters, digits and '-', starting with a letter")
        require(bool(_DNS_1123.match(self.namespace)) and len(self.namespace) <= MAX_NAME,
                "namespace", f"{self.namespace!r} is not a DNS-1123 label",
                "use lowercase letters, digits and '-' (at most 63)")
        require(bool(_PROJECT.match(self.project)), "project",
                f"{self.project!r} is not a Google Cloud project id",
                "use the id (6-30 lowercase letters, digits, '-'), not the display name")
        require(bool(_REGION.match(self.region)), "region", f"{self.region!r} is not a region",
                "use e.g. us-east5")
        require(bool(re.fullmatch(re.escape(self.region) + r"-[a-z]", self.zone)), "zone",
                f"{self.zone!r} is not a zone of region {self.region}",
                f"use e.g. {self.region}-b (a zone that offers your accelerator)")
        require(bool(_SERVICE_ACCOUNT.match(self.service_account)), "service_account",
                f"{self.service_account!r} cannot name both a Kubernetes and a Google service "
                "account", "use 6-30 lowercase letters, digits and '-', starting with a letter")
        for field, bucket in (("data_bucket", self.resolved_data_bucket),
                              ("outputs_bucket", self.resolved_outputs_bucket)):
            require(bool(_BUCKET.match(bucket)) and not bucket.startswith("goog")
                    and ".." not in bucket, field, f"{bucket!r} is not a bucket name",
                    "use 3-63 lowercase letters, digits, '-', '_' or '.', without the gs:// "
                    "prefix")
        require(self.resolved_data_bucket != self.resolved_outputs_bucket, "outputs_bucket",
                "is the data bucket", "use a separate bucket: data is mounted read-only")
        match = _IMAGE.match(self.resolved_image)
        require(match is not None, "image",
                f"{self.resolved_image!r} is not an image reference with a tag or digest",
                "use e.g. us-east5-docker.pkg.dev/PROJECT/gemmalab/gemmalab-tpu:0.1.0")
        require(match is not None and match["ref"] != ":latest", "image",
                "':latest' makes every host pull whatever was pushed last",
                "push and use a version tag or an @sha256 digest")

    def _check_accelerator(self) -> None:
        require(isinstance(self.num_slices, int) and self.num_slices >= 1, "num_slices",
                f"{self.num_slices!r} < 1", "use 1, or the number of TPU slices")
        require(self.is_cpu or not (self.local_data_dir or self.local_outputs_dir),
                "local_data_dir" if self.local_data_dir else "local_outputs_dir",
                "is for the local cluster's CPU node", "use the buckets, or accelerator='cpu'")
        if self.is_cpu:
            require(self.num_slices == 1 and self.chips_per_host is None
                    and self.topology == "1x1", "num_slices" if self.num_slices != 1
                    else "chips_per_host" if self.chips_per_host is not None else "topology",
                    "is for TPU slices", "use num_nodes for several CPU hosts")
            require(self.gpus_per_node == accelerators.MAX_GPUS_PER_NODE, "gpus_per_node",
                    "is for GPUs", "leave it at its default with accelerator='cpu'")
            require(isinstance(self.num_nodes, int) and self.num_nodes >= 1, "num_nodes",
                    f"{self.num_nodes!r} < 1", "use 1 or more")
            for field in ("local_data_dir", "local_outputs_dir"):
                value = getattr(self, field)
                require(value == "" or value.startswith("/"), field,
                        f"{value!r} is not an absolute path", "give the node's absolute path")
        elif self.is_gpu:
            accelerators.gpu_type(self.accelerator)
            require(self.num_slices == 1, "num_slices", "is for TPU slices",
                    "use num_nodes for several GPU nodes")
            require(self.chips_per_host is None, "chips_per_host", "is for TPUs",
                    "use gpus_per_node")
            require(1 <= self.gpus_per_node <= accelerators.MAX_GPUS_PER_NODE, "gpus_per_node",
                    f"{self.gpus_per_node} is outside 1..{accelerators.MAX_GPUS_PER_NODE}",
                    "use 8 (a whole a3 node) or fewer")
            require(self.num_nodes >= 1, "num_nodes", f"{self.num_nodes} < 1",
                    "use 1 or more")
            require(self.num_nodes == 1 or self.gpus_per_node == accelerators.MAX_GPUS_PER_NODE,
                    "gpus_per_node", "partial nodes in a multi-node run leave GPUs idle",
                    "use gpus_per_node=8 with num_nodes > 1")
        else:
            accelerators.tpu_slice(self.accelerator, self.topology, self.chips_per_host)
            require(self.num_nodes == 1, "num_nodes", "is for GPUs",
                    "choose a bigger TPU topology or num_slices")
            require(self.gpus_per_node == accelerators.MAX_GPUS_PER_NODE, "gpus_per_node",
                    "is for GPUs", "leave it at its default with a TPU accelerator")
            require(self.num_slices == 1 or self.tpu.hosts > 1, "num_slices",
                    f"multislice needs multi-host slices and {self.topology} has one host",
                    "use a multi-host topology (e.g. v6e 2x4) or num_slices=1")
        pod = self.longest_pod_name
        require(len(pod) <= MAX_NAME, "job_name",
                f"pod name {pod!r} would be {len(pod)} characters (limit 63)",
                f"shorten job_name by {len(pod) - MAX_NAME} characters")

    def _check_params(self) -> None:
        resolved, _ = check_notebook_params(self.params, self.notebook)
        object.__setattr__(self, "params", types.MappingProxyType(dict(self.params)))
        batch = resolved.trainer.batch_size  # given, the recipe's, or the model's
        accum = resolved.trainer.grad_accum_steps
        ways = self._data_parallel_size()
        try:
            check_batch_split(batch, ways, accum, where=self.describe())
            check_expert_axis(self._mesh_sizes(), resolved.model.preset,
                              resolved.model.expert_capacity_factor)
        except ConfigError as e:  # the notebook's parameter
            raise ConfigError(f"params.{e.parameter}", e.problem, e.fix) from None

    def _data_parallel_size(self) -> int:
        """How many ways the batch splits on this cluster (the mesh's data x fsdp x expert)."""
        return self.num_slices * batch_ways(self._mesh_sizes())

    def _mesh_sizes(self) -> dict[str, int]:
        """The mesh axes' sizes on one slice of this cluster."""
        from gemmalab.config import resolve_mesh_shape

        per_slice = self.total_devices // self.num_slices
        try:
            return resolve_mesh_shape(self.params.get("mesh"), per_slice)
        except ConfigError as e:
            raise ConfigError(f"params.{e.parameter}", f"{e.problem} (per slice of "
                              f"{self.describe()})", e.fix) from None

    def _check_lifecycle(self) -> None:
        for field in ("termination_grace_period_s", "backoff_limit", "max_restarts",
                      "ttl_after_finished_s"):
            value = getattr(self, field)
            require(isinstance(value, int) and value >= 0, field, f"{value!r} is negative",
                    "use 0 or more")
        if self.active_deadline_s is not None:
            require(self.active_deadline_s > 0, "active_deadline_s", "is not positive",
                    "use seconds, or None for no deadline")
        require(self.cache_size_gi >= 1, "cache_size_gi", "is below 1",
                "use e.g. 20 (GiB of node disk for corpora and token caches)")
        require(isinstance(self.profiling, bool), "profiling", "is not a bool",
                "use True or False")

    def _check_queue(self) -> None:
        require(isinstance(self.queue, str) and (self.queue == "" or (
            bool(_DNS_1123.match(self.queue)) and len(self.queue) <= MAX_NAME)), "queue",
            f"{self.queue!r} is not a LocalQueue name",
            "use lowercase letters, digits and '-' (at most 63), or '' for no queue")
        require(isinstance(self.queue_quota, Mapping), "queue_quota",
                f"{type(self.queue_quota).__name__} is not a dict",
                "use {topology: slices}, e.g. {'2x4': 2}")
        object.__setattr__(self, "queue_quota", types.MappingProxyType(dict(self.queue_quota)))
        for topology, slices in self.queue_quota.items():
            require(not self.is_gpu, "queue_quota", "is rendered for TPU slices",
                    "use a TPU accelerator (e.g. v6e)")
            if self.is_cpu:  # the local node's pods: {"cpu": hosts at once}
                require(topology == accelerators.CPU_ACCELERATOR, "queue_quota",
                        f"{topology!r} is not the CPU node's", "use {'cpu': <pods at once>}")
            else:
                accelerators.tpu_slice(self.accelerator, str(topology))
            require(isinstance(slices, int) and not isinstance(slices, bool) and slices >= 1,
                    f"queue_quota.{topology}", f"{slices!r} is not a number of slices",
                    "use 1 or more (how many slices of that topology may run at once)")
        require(isinstance(self.flex_start, bool), "flex_start", "is not a bool",
                "use True or False")

    def require_queue_setup(self) -> None:
        """What rendering the Kueue objects needs beyond a run's fields."""
        require(bool(self.queue), "queue", "is empty", "name the queue, e.g. gemmalab")
        require(bool(self.queue_quota), "queue_quota", "is empty",
                "give the slices the queue admits at once, e.g. {'1x1': 4, '2x4': 2}")

    # ---- derived values ---------------------------------------------------------------------

    @property
    def is_gpu(self) -> bool:
        return self.accelerator in accelerators.GPU_TYPES

    @property
    def is_cpu(self) -> bool:
        """The local cluster's real node (`make cluster`), not a GKE node pool."""
        return self.accelerator == accelerators.CPU_ACCELERATOR

    @property
    def tpu(self) -> TpuSlice:
        if self.is_gpu or self.is_cpu:
            raise ValueError(f"{self.accelerator} is not a TPU")
        return accelerators.tpu_slice(self.accelerator, self.topology, self.chips_per_host)

    @property
    def hosts_per_slice(self) -> int:
        return self.num_nodes if self.is_gpu or self.is_cpu else self.tpu.hosts

    @property
    def total_hosts(self) -> int:
        return self.hosts_per_slice * self.num_slices

    @property
    def devices_per_host(self) -> int:
        if self.is_cpu:
            return 1  # one JAX process a pod, one CPU device
        return self.gpus_per_node if self.is_gpu else self.tpu.chips_per_host

    @property
    def total_devices(self) -> int:
        return self.devices_per_host * self.total_hosts

    @property
    def multi_host(self) -> bool:
        """One pod per host: a JobSet when more than one, a plain Job otherwise."""
        return self.total_hosts > 1

    @property
    def accelerator_resource(self) -> str | None:
        """The extended resource a pod asks for its devices (none for CPUs)."""
        if self.is_cpu:
            return None
        return accelerators.GPU_RESOURCE if self.is_gpu else accelerators.TPU_RESOURCE

    @property
    def node_selector(self) -> dict[str, str]:
        if self.is_cpu:
            return {accelerators.CPU_NODE_LABEL: accelerators.CPU_NODE_VALUE}
        if self.is_gpu:
            return {accelerators.GPU_ACCELERATOR_LABEL:
                    accelerators.gpu_type(self.accelerator).accelerator}
        return self.tpu.node_selector

    @property
    def host_resources(self) -> HostResources:
        if self.is_cpu:
            return accelerators.CPU_HOST_REQUESTS
        if self.is_gpu:
            per_gpu = accelerators.gpu_type(self.accelerator).per_gpu
            return HostResources(accelerators.scale_quantity(per_gpu.cpu, self.gpus_per_node),
                                 accelerators.scale_quantity(per_gpu.memory, self.gpus_per_node))
        return self.tpu.host_resources

    @property
    def longest_pod_name(self) -> str:
        """The longest pod name the Job/JobSet controllers will generate (JobSet checks it)."""
        suffix = "-abcde"  # the controllers' random suffix
        if self.multi_host:
            return (f"{self.job_name}-{REPLICATED_JOB}-{self.num_slices - 1}-"
                    f"{self.hosts_per_slice - 1}{suffix}")
        return self.job_name + suffix

    @property
    def output_dir(self) -> str:
        return f"{OUTPUTS_MOUNT}/{self.job_name}"

    @property
    def resolved_data_bucket(self) -> str:
        return self.data_bucket or f"{self.project}-gemmalab-data"

    @property
    def resolved_outputs_bucket(self) -> str:
        return self.outputs_bucket or f"{self.project}-gemmalab-outputs"

    @property
    def resolved_image(self) -> str:
        if self.image:
            return self.image
        if self.is_cpu:
            return LOCAL_CPU_IMAGE.format(version=package_version())
        kind = "gpu" if self.is_gpu else "tpu"
        return (f"{self.region}-docker.pkg.dev/{self.project}/{ARTIFACT_REPOSITORY}/"
                f"gemmalab-{kind}:{package_version()}")

    @property
    def google_service_account(self) -> str:
        return f"{self.service_account}@{self.project}.iam.gserviceaccount.com"

    def resolved_local_volumes(self) -> tuple[str, str]:
        """The CPU node's directories behind /data and /outputs."""
        data, outputs = local_volumes()
        return self.local_data_dir or str(data), self.local_outputs_dir or str(outputs)

    def describe(self) -> str:
        if self.is_cpu:
            return f"{self.num_nodes} x cpu (local node)"
        if self.is_gpu:
            return f"{self.num_nodes} x {self.gpus_per_node} {self.accelerator.upper()}"
        slices = f"{self.num_slices} x " if self.num_slices > 1 else ""
        return f"{slices}{self.accelerator} {self.topology}"
