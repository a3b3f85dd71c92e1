"""Kubernetes objects that run the training notebook: a Job on one host, a JobSet across hosts.

On GKE's TPU and GPU node pools; the same objects, but for the node, the resources and the
volumes, on the local cluster's real CPU node (``accelerator="cpu"``).

``build(config)`` picks the right one. Jobs are ``kubernetes.client`` models; the JobSet is a
custom resource, so it is a plain dict whose child-Job template is a serialised ``V1JobSpec``.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client

from gemmalab.k8s import accelerators, gcsfuse
from gemmalab.k8s.config import (
    CACHE_MOUNT,
    COMPILE_CACHE_DIR,
    JAX_COORDINATOR_PORT,
    PROFILER_PORT,
    REPLICATED_JOB,
    RUN_AS_USER,
    ClusterConfig,
)
from gemmalab.k8s.kueue import QUEUE_LABEL
from gemmalab.k8s.notebook import papermill_argv
from gemmalab.k8s.run_notebook import PREEMPTED_EXIT_CODE

JOBSET_API_VERSION = "jobset.x-k8s.io/v1alpha2"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"
COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
INSTANCE_LABEL = "app.kubernetes.io/instance"
CONTAINER = "train"
TPU_RUNTIME_PORT = 8471  # libtpu's port between the hosts of a slice

# gemmalab's papermill runner: it makes the output folder (papermill does not; an unwritable
# bucket is one line), and hands SIGTERM to the training loop (save, then exit
# PREEMPTED_EXIT_CODE). Kubernetes itself expands $(VAR) in the arguments: no shell.
ENTRYPOINT = ["python", "-m", "gemmalab.k8s.run_notebook"]


def labels(config: ClusterConfig) -> dict[str, str]:
    return {"app.kubernetes.io/name": "gemmalab", "app.kubernetes.io/component": "training",
            INSTANCE_LABEL: config.job_name}


def object_labels(config: ClusterConfig) -> dict[str, str]:
    """The Job's or JobSet's own labels: ``labels`` plus, for a queued run, Kueue's queue label.

    Only there (Kueue's docs: the JobSet's or Job's ``metadata.labels``): on the pod template
    it would make Kueue's pod integration queue every pod again on its own. The run is not
    created suspended: Kueue's webhook suspends it on creation and unsuspends it on admission.
    """
    if not config.queue:
        return labels(config)
    return {**labels(config), QUEUE_LABEL: config.queue}


def notebook_params(config: ClusterConfig) -> dict[str, Any]:
    """The user's papermill parameters, plus what the cluster shape implies (multislice:
    ``num_slices``, so the mesh's data axis spans the slices)."""
    params = dict(config.params)
    if config.num_slices > 1:
        params.setdefault("num_slices", config.num_slices)
    return params


def _field_env(name: str, field_path: str) -> client.V1EnvVar:
    return client.V1EnvVar(name=name, value_from=client.V1EnvVarSource(
        field_ref=client.V1ObjectFieldSelector(field_path=field_path)))


def _env(config: ClusterConfig) -> list[client.V1EnvVar]:
    env = [
        client.V1EnvVar(name="GEMMALAB_OUTPUT_DIR", value=config.output_dir),
        client.V1EnvVar(name="GEMMALAB_CACHE_DIR", value=CACHE_MOUNT),
        # The accelerator first: at start-up the notebook stops if JAX's backend is another
        # (distributed.require_requested_accelerator; JAX itself skips a missing cuda).
        client.V1EnvVar(name="JAX_PLATFORMS", value=_jax_platforms(config)),
        client.V1EnvVar(name="PYTHONUNBUFFERED", value="1"),
        client.V1EnvVar(name="TF_CPP_MIN_LOG_LEVEL", value="3"),
        _field_env("POD_NAME", "metadata.name"),
    ]
    if config.multi_host:
        env += [
            _field_env("GEMMALAB_SLICE", f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"),
            _field_env("GEMMALAB_HOST", f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"),
        ]
    if config.multi_host and _coordinated(config):
        # On GPUs (and the local CPU node) nothing injects the cluster layout: process 0 of the
        # JobSet is the coordinator, reachable through the JobSet's headless service as
        # <jobset>-<replicatedJob>-0-0.<jobset>.
        coordinator = f"{config.job_name}-{REPLICATED_JOB}-0-0.{config.job_name}"
        env += [
            client.V1EnvVar(name="JAX_COORDINATOR_ADDRESS",
                            value=f"{coordinator}:{JAX_COORDINATOR_PORT}"),
            client.V1EnvVar(name="JAX_NUM_PROCESSES", value=str(config.total_hosts)),
            _field_env("JAX_PROCESS_ID", f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"),
        ]
    # On TPUs nothing is set here on purpose: GKE's TPU webhook gives every pod of a JobSet
    # TPU_WORKER_ID and TPU_WORKER_HOSTNAMES (and MEGASCALE_* across slices), which
    # jax.distributed.initialize() reads on its own.
    if config.profiling:
        env += [
            client.V1EnvVar(name="GEMMALAB_PROFILER_PORT", value=str(PROFILER_PORT)),
            client.V1EnvVar(name="GEMMALAB_XPROF_DIR", value=f"{config.output_dir}/tensorboard"),
        ]
    return env


def _jax_platforms(config: ClusterConfig) -> str:
    if config.is_cpu:
        return "cpu"
    return "cuda,cpu" if config.is_gpu else "tpu,cpu"


def _coordinated(config: ClusterConfig) -> bool:
    """Whether the run's processes find their coordinator from our env (GPUs, CPUs), not from
    what GKE's TPU webhook injects."""
    return config.is_gpu or config.is_cpu


def _ports(config: ClusterConfig) -> list[client.V1ContainerPort] | None:
    ports = []
    if config.multi_host and not _coordinated(config):
        ports.append(client.V1ContainerPort(name="tpu-runtime", container_port=TPU_RUNTIME_PORT))
    if config.multi_host and _coordinated(config):
        ports.append(client.V1ContainerPort(name="coordinator",
                                            container_port=JAX_COORDINATOR_PORT))
    if config.profiling:
        ports.append(client.V1ContainerPort(name="xprof", container_port=PROFILER_PORT))
    return ports or None


def output_notebook(config: ClusterConfig) -> str:
    if config.multi_host:  # one executed notebook per host, stable across restarts
        return f"{config.output_dir}/train-slice$(GEMMALAB_SLICE)-host$(GEMMALAB_HOST).ipynb"
    return f"{config.output_dir}/train.ipynb"


def _resources(config: ClusterConfig) -> client.V1ResourceRequirements:
    host = config.host_resources
    resources = {"cpu": host.cpu, "memory": host.memory}
    if config.is_cpu:
        # Requests only: the pods of a run share the local node's cores, memory and disk.
        return client.V1ResourceRequirements(requests=resources)
    resources["ephemeral-storage"] = f"{config.cache_size_gi + 5}Gi"  # cache + logs, tmp
    resources[config.accelerator_resource] = str(config.devices_per_host)
    # Requests = limits: the accelerator must be (extended resources allow nothing else), and
    # equal CPU/memory make the pod Guaranteed, the last to be evicted.
    return client.V1ResourceRequirements(requests=dict(resources), limits=dict(resources))


def container(config: ClusterConfig) -> client.V1Container:
    mounts = gcsfuse.volume_mounts()
    if config.is_gpu:
        mounts.append(client.V1VolumeMount(name="dshm", mount_path="/dev/shm"))
    return client.V1Container(
        name=CONTAINER,
        image=config.resolved_image,
        image_pull_policy="IfNotPresent",
        command=ENTRYPOINT,
        args=papermill_argv(notebook=config.notebook, output_notebook=output_notebook(config),
                            output_dir=config.output_dir, cache_dir=CACHE_MOUNT,
                            compile_cache_dir=COMPILE_CACHE_DIR,
                            params=notebook_params(config)),
        env=_env(config),
        ports=_ports(config),
        resources=_resources(config),
        volume_mounts=mounts,
        # Not privileged: since GKE 1.28 the TPU device plugin hands the chips' device files to
        # the container (as the NVIDIA plugin does for GPUs), so the privileged mode older TPU
        # examples ask for is no longer needed; nothing here needs extra capabilities either.
        security_context=client.V1SecurityContext(
            privileged=False, allow_privilege_escalation=False, run_as_non_root=True),
    )


def _volumes(config: ClusterConfig) -> list[client.V1Volume]:
    """The buckets through GCS FUSE on GKE; on the local node its directories standing for
    them (the same volume names and mounts)."""
    if not config.is_cpu:
        return gcsfuse.volumes(config)
    data, outputs = config.resolved_local_volumes()
    return [
        client.V1Volume(name=gcsfuse.DATA_VOLUME, host_path=client.V1HostPathVolumeSource(
            path=data, type="Directory")),
        client.V1Volume(name=gcsfuse.OUTPUTS_VOLUME, host_path=client.V1HostPathVolumeSource(
            path=outputs, type="Directory")),
        client.V1Volume(name=gcsfuse.CACHE_VOLUME, empty_dir=client.V1EmptyDirVolumeSource(
            size_limit=f"{config.cache_size_gi}Gi")),
    ]


def _tolerations(config: ClusterConfig) -> list[client.V1Toleration]:
    if config.is_cpu:  # the local node's own taint keeps every other pod off it
        return [client.V1Toleration(key=accelerators.CPU_NODE_LABEL, operator="Equal",
                                    value=accelerators.CPU_NODE_VALUE, effect="NoSchedule")]
    # GKE taints accelerator nodes; it adds these tolerations itself, stated for clarity.
    return [client.V1Toleration(key=config.accelerator_resource, operator="Exists",
                                effect="NoSchedule")]


def pod_template(config: ClusterConfig) -> client.V1PodTemplateSpec:
    volumes = _volumes(config)
    if config.is_gpu:  # NCCL exchanges data through /dev/shm; the default 64 MiB is too small
        volumes.append(client.V1Volume(name="dshm", empty_dir=client.V1EmptyDirVolumeSource(
            medium="Memory", size_limit="32Gi")))
    return client.V1PodTemplateSpec(
        metadata=client.V1ObjectMeta(
            labels=labels(config),
            annotations=None if config.is_cpu else gcsfuse.pod_annotations()),
        spec=client.V1PodSpec(
            service_account_name=config.service_account,
            restart_policy="Never",
            termination_grace_period_seconds=config.termination_grace_period_s,
            node_selector=config.node_selector,
            tolerations=_tolerations(config),
            security_context=client.V1PodSecurityContext(
                run_as_non_root=True, run_as_user=RUN_AS_USER, run_as_group=RUN_AS_USER,
                fs_group=RUN_AS_USER,
                seccomp_profile=client.V1SeccompProfile(type="RuntimeDefault")),
            containers=[container(config)],
            volumes=volumes,
        ),
    )


def _disruption(action: str) -> list[client.V1PodFailurePolicyRule]:
    """Preemption or node maintenance (pod condition DisruptionTarget), or a stop on SIGTERM
    after saving a checkpoint (exit PREEMPTED_EXIT_CODE), is not the run's fault."""
    return [
        client.V1PodFailurePolicyRule(action=action, on_pod_conditions=[
            client.V1PodFailurePolicyOnPodConditionsPattern(type="DisruptionTarget",
                                                            status="True")]),
        client.V1PodFailurePolicyRule(action=action, on_exit_codes=(
            client.V1PodFailurePolicyOnExitCodesRequirement(
                container_name=CONTAINER, operator="In", values=[PREEMPTED_EXIT_CODE]))),
    ]


def job(config: ClusterConfig) -> client.V1Job:
    """A batch/v1 Job: one pod on one host (TPU 1x1/2x2, or one GPU node)."""
    if config.multi_host:
        raise ValueError(f"{config.describe()} spans {config.total_hosts} hosts: use jobset()")
    return client.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=client.V1ObjectMeta(name=config.job_name, namespace=config.namespace,
                                     labels=object_labels(config)),
        spec=client.V1JobSpec(
            backoff_limit=config.backoff_limit,
            # An evicted pod is replaced without spending the backoff limit.
            pod_failure_policy=client.V1PodFailurePolicy(rules=_disruption("Ignore")),
            ttl_seconds_after_finished=config.ttl_after_finished_s,
            active_deadline_seconds=config.active_deadline_s,
            template=pod_template(config),
        ),
    )


def jobset(config: ClusterConfig) -> dict[str, Any]:
    """A JobSet: one Indexed child Job per slice, one pod per host, DNS names for every pod."""
    hosts = config.hosts_per_slice
    child = client.V1JobTemplateSpec(spec=client.V1JobSpec(
        parallelism=hosts,
        completions=hosts,
        completion_mode="Indexed",
        backoff_limit=0,  # one lost host stops the slice; the JobSet restarts all of them
        # A disruption fails the child Job with reason PodFailurePolicy, which the JobSet's
        # failure policy below restarts without counting it against maxRestarts.
        pod_failure_policy=client.V1PodFailurePolicy(rules=_disruption("FailJob")),
        active_deadline_seconds=config.active_deadline_s,
        template=pod_template(config),
    ))
    annotations = {}
    if not _coordinated(config):  # TPU slices
        # Every child Job (= slice) gets a node pool (= physical slice) of its own, and all
        # pods of a slice land in the same node pool; without it pods of a slice can be
        # scattered over several node pools of the same topology and never see each other.
        annotations[EXCLUSIVE_TOPOLOGY] = NODEPOOL_LABEL
    metadata: dict[str, Any] = {"name": config.job_name, "namespace": config.namespace,
                                "labels": object_labels(config)}
    if annotations:
        metadata["annotations"] = annotations
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "ttlSecondsAfterFinished": config.ttl_after_finished_s,
            "failurePolicy": {
                "maxRestarts": config.max_restarts,
                "rules": _jobset_failure_rules(config),
            },
            # A headless service named after the JobSet: pods resolve each other as
            # <jobset>-<replicatedJob>-<slice>-<host>.<jobset>, as the TPU runtime expects.
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": config.num_slices,
                "template": client.ApiClient().sanitize_for_serialization(child),
            }],
        },
    }


def _jobset_failure_rules(config: ClusterConfig) -> list[dict[str, Any]]:
    """What a child Job's failure does to the JobSet, first match wins; a failure no rule matches
    restarts the set, counted against ``maxRestarts``. JobSet's webhook refuses rule names other
    than ``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$`` (no hyphens)."""
    rules = []
    if config.active_deadline_s is not None:
        # A child Job past its activeDeadlineSeconds: the run is over, not restarted with a
        # fresh deadline.
        rules.append({"name": "failAtDeadline", "action": "FailJobSet",
                      "onJobFailureReasons": ["DeadlineExceeded"]})
    rules.append({"name": "restartAfterDisruption", "action": "RestartJobSetAndIgnoreMaxRestarts",
                  "onJobFailureReasons": ["PodFailurePolicy"]})
    return rules


def build(config: ClusterConfig) -> list[Any]:
    """The objects to submit for ``config``: a Job on one host, a JobSet on several."""
    return [jobset(config) if config.multi_host else job(config)]

