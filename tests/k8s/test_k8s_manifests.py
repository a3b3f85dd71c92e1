"""The committed k8s/*.yaml: schema-valid offline, semantically right, and exactly what the code
renders (no cluster needed: Kubernetes' OpenAPI schemas and the JobSet CRD schema are local)."""

from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from gemmalab.errors import ConfigError
from gemmalab.k8s import gcsfuse, manifests, standard
from gemmalab.k8s.config import DATA_MOUNT, OUTPUTS_MOUNT, RUN_AS_USER, ClusterConfig
from tests.helpers.k8s import (
    HUB_FILE,
    K8S,
    KUBERNETES_VERSION,
    KUEUE_FILES,
    ROOT,
    TRAINING_FILES,
    as_job,
    child_jobs,
    committed_training_docs,
    env_of,
    jobset_validator,
    load_docs,
    pod_metadata,
    pod_specs,
    pods,
    topology_chips,
)

DNS_1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DOCS = committed_training_docs()
IDS = [name for name, _ in DOCS]
# Finished runs are kept 3 days, their logs readable (k8s/README.md).
THREE_DAYS_S = 3 * 24 * 3600


def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:  # the schema dump is pages long
        pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {str(e).splitlines()[0]}")


def test_standard_files_are_committed_and_up_to_date():
    rendered = standard.render_standard()
    assert sorted(rendered) == sorted([*TRAINING_FILES, HUB_FILE, *KUEUE_FILES])
    for name, text in rendered.items():
        committed = (K8S / name).read_text(encoding="utf-8")
        assert committed == text, f"k8s/{name} is stale: run `python -m gemmalab.k8s render`"


def test_cli_check_and_help():
    from gemmalab.k8s.cli import main

    assert main(["render", "--check"]) == 0
    usage = subprocess.run([sys.executable, "-m", "gemmalab.k8s", "render", "--help"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "--project" in usage and "multislice-2x-v6e-2x4.yaml" in usage


def test_cli_renders_for_another_project_into_a_directory(tmp_path):
    from gemmalab.k8s.cli import main

    assert main(["render", "--out-dir", str(tmp_path), "--project", "acme-research",
                 "--region", "europe-west4", "--zone", "europe-west4-a"]) == 0
    text = (tmp_path / "multislice-2x-v6e-2x4.yaml").read_text()
    assert "acme-research-gemmalab-outputs" in text and "my-project" not in text
    assert "europe-west4-docker.pkg.dev/acme-research/gemmalab/gemmalab-tpu:" in text
    assert main(["render", "--check", "--out-dir", str(tmp_path)]) == 1  # placeholders differ


def test_cli_prints_one_run_and_refuses_impossible_ones(capsys):
    from gemmalab.k8s.cli import main

    assert main(["job", "--name", "my-run", "--accelerator", "v6e", "--topology", "2x4",
                 "--slices", "2", "-p", "batch_size", "256", "-p", "model", "gemma3-270m",
                 "-p", "checkpoint", "'123'"]) == 0
    [doc] = yaml.safe_load_all(capsys.readouterr().out)
    assert doc["kind"] == "JobSet" and pods(doc) == 4
    args = pod_specs(doc)[0]["containers"][0]["args"]
    assert "-r" in args and args[args.index("-r") + 1:args.index("-r") + 3] == ["checkpoint",
                                                                               "123"]
    assert main(["job", "--topology", "3x3"]) == 2
    assert "ConfigError: topology: '3x3' is not a v6e topology" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_objects_validate_against_the_kubernetes_schemas(name, doc):
    if doc["kind"] == "Job":
        assert doc["apiVersion"] == "batch/v1"
        _validate(doc)
        return
    assert (doc["apiVersion"], doc["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    errors = [f"{list(e.path)}: {e.message}" for e in jobset_validator().iter_errors(doc)]
    assert not errors
    for _, job_spec in child_jobs(doc):
        _validate(as_job(doc, job_spec))


def test_schema_validation_catches_mistakes():
    [doc] = load_docs(K8S / "multihost-v6e-2x4.yaml")
    doc["spec"]["network"]["enableDnsHostnames"] = True  # misspelt: the CRD would drop it
    assert list(jobset_validator().iter_errors(doc))
    [job] = load_docs(K8S / "single-host-v6e-1x1.yaml")
    job["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_accelerators_add_up(name, doc):
    for replicas, job_spec in child_jobs(doc):
        spec = job_spec["template"]["spec"]
        [container] = spec["containers"]
        resources = container["resources"]
        assert resources["requests"] == resources["limits"]  # incl. cpu, memory, accelerator
        assert {"cpu", "memory", "ephemeral-storage"} <= set(resources["limits"])
        selector = spec["nodeSelector"]
        hosts = job_spec.get("parallelism", 1)
        if "cloud.google.com/gke-tpu-topology" in selector:
            chips_per_pod = int(resources["limits"]["google.com/tpu"])
            assert chips_per_pod * hosts == topology_chips(
                selector["cloud.google.com/gke-tpu-topology"])
            assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v6e-slice"
        else:
            assert selector["cloud.google.com/gke-accelerator"] == "nvidia-h200-141gb"
            assert int(resources["limits"]["nvidia.com/gpu"]) * hosts * replicas == 16
    expected_pods = {"single-host-v6e-1x1.yaml": 1, "multihost-v6e-2x4.yaml": 2,
                     "multislice-2x-v6e-2x4.yaml": 4, "gpu-h200.yaml": 2}
    assert pods(doc) == expected_pods[name]


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_names_are_dns_labels_of_63_characters_at_most(name, doc):
    job_name = doc["metadata"]["name"]
    assert DNS_1123_LABEL.match(job_name) and job_name[0].isalpha()
    for replicas, job_spec in child_jobs(doc):
        if doc["kind"] == "JobSet":
            rjob = doc["spec"]["replicatedJobs"][0]["name"]
            longest = f"{job_name}-{rjob}-{replicas - 1}-{job_spec['parallelism'] - 1}-abcde"
        else:
            longest = f"{job_name}-abcde"
        assert len(longest) <= 63 and DNS_1123_LABEL.match(longest)
        spec = job_spec["template"]["spec"]
        for item in spec["containers"] + spec["volumes"]:
            assert DNS_1123_LABEL.match(item["name"]), item["name"]
        for port in spec["containers"][0].get("ports", []):
            assert len(port["name"]) <= 15


def test_one_service_account_name_everywhere():
    names = {spec["serviceAccountName"] for _, doc in DOCS for spec in pod_specs(doc)}
    [hub] = load_docs(K8S / HUB_FILE)
    names.add(hub["singleuser"]["serviceAccountName"])
    defaults = (ROOT / "scripts/gke/common.sh").read_text()
    names.add(re.search(r'SERVICE_ACCOUNT="\$\{SERVICE_ACCOUNT:-([^}]*)\}"', defaults)[1])
    assert names == {ClusterConfig().service_account}  # no "jaxserviceaccout" drift


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_pods_run_unprivileged_as_the_image_user(name, doc):
    for spec in pod_specs(doc):
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == RUN_AS_USER != 0
        assert pod["fsGroup"] == RUN_AS_USER
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context.get("privileged") is not True
            assert context["allowPrivilegeEscalation"] is False
        assert not spec.get("hostNetwork") and not spec.get("hostPID")
        assert spec["restartPolicy"] == "Never"
        assert spec["terminationGracePeriodSeconds"] > 0


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_data_is_read_only_and_outputs_read_write(name, doc):
    for spec, metadata in zip(pod_specs(doc), pod_metadata(doc), strict=True):
        annotations = metadata["annotations"]
        assert annotations[gcsfuse.VOLUMES_ANNOTATION] == "true"
        for resource in ("cpu", "memory", "ephemeral-storage"):
            assert f"gke-gcsfuse/{resource}-limit" in annotations
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
        data, outputs = mounts[DATA_MOUNT], mounts[OUTPUTS_MOUNT]
        assert data["readOnly"] is True and volumes[data["name"]]["csi"]["readOnly"] is True
        assert outputs["readOnly"] is False and volumes[outputs["name"]]["csi"]["readOnly"] is False
        for mount in (data, outputs):
            csi = volumes[mount["name"]]["csi"]
            assert csi["driver"] == "gcsfuse.csi.storage.gke.io"
            assert "implicit-dirs" in csi["volumeAttributes"]["mountOptions"].split(",")
        assert (volumes[data["name"]]["csi"]["volumeAttributes"]["bucketName"]
                != volumes[outputs["name"]]["csi"]["volumeAttributes"]["bucketName"])
        assert "emptyDir" in volumes[mounts["/cache"]["name"]]


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_jobs_fail_fast_and_jobsets_are_placed_per_slice(name, doc):
    if doc["kind"] == "Job":
        assert doc["spec"]["backoffLimit"] == 0
        assert doc["spec"]["ttlSecondsAfterFinished"] == THREE_DAYS_S
        return
    spec = doc["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    assert spec["failurePolicy"]["maxRestarts"] == 0
    assert spec["ttlSecondsAfterFinished"] == THREE_DAYS_S
    for _, job_spec in child_jobs(doc):
        assert job_spec["completionMode"] == "Indexed"
        assert job_spec["parallelism"] == job_spec["completions"]
        assert job_spec["backoffLimit"] == 0
    is_tpu = "google.com/tpu" in pod_specs(doc)[0]["containers"][0]["resources"]["limits"]
    annotation = doc["metadata"].get("annotations", {}).get(manifests.EXCLUSIVE_TOPOLOGY)
    assert annotation == ("cloud.google.com/gke-nodepool" if is_tpu else None)
    if name.startswith("multislice"):
        assert doc["spec"]["replicatedJobs"][0]["replicas"] == 2


def test_a_jobset_past_its_deadline_fails_instead_of_restarting():
    """Without a rule for DeadlineExceeded the JobSet would restart the set (the default for
    an unmatched failure) with a fresh deadline, as long as maxRestarts allows. That the real
    JobSet controller ends it: test_k8s_cluster.py."""
    config = ClusterConfig(topology="2x4", max_restarts=3, active_deadline_s=3600)
    [doc] = manifests.build(config)
    rules = doc["spec"]["failurePolicy"]["rules"]
    assert rules[0] == {"name": "failAtDeadline", "action": "FailJobSet",
                        "onJobFailureReasons": ["DeadlineExceeded"]}
    assert [job["activeDeadlineSeconds"] for _, job in child_jobs(doc)] == [3600]
    [doc] = manifests.build(ClusterConfig(topology="2x4"))  # no deadline: no rule for it
    assert [rule["name"] for rule in doc["spec"]["failurePolicy"]["rules"]] == [
        "restartAfterDisruption"]


def test_gpu_processes_find_their_coordinator():
    [doc] = load_docs(K8S / "gpu-h200.yaml")
    env = env_of(pod_specs(doc)[0]["containers"][0])
    rjob = doc["spec"]["replicatedJobs"][0]["name"]
    name = doc["metadata"]["name"]
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-{rjob}-0-0.{name}:1234"
    assert env["JAX_NUM_PROCESSES"] == "2"
    assert "job-completion-index" in env["JAX_PROCESS_ID"]["fieldRef"]["fieldPath"]
    assert env["JAX_PLATFORMS"] == "cuda,cpu"


def test_profiling_opens_the_xprof_port():
    [job] = load_docs(K8S / "single-host-v6e-1x1.yaml")
    container = pod_specs(job)[0]["containers"][0]
    assert {"name": "xprof", "containerPort": 9002} in container["ports"]
    assert env_of(container)["GEMMALAB_XPROF_DIR"].startswith(OUTPUTS_MOUNT + "/")
    [jobset] = load_docs(K8S / "multihost-v6e-2x4.yaml")
    ports = pod_specs(jobset)[0]["containers"][0]["ports"]
    assert all(p["containerPort"] != 9002 for p in ports)


@pytest.mark.parametrize(("name", "doc"), DOCS, ids=IDS)
def test_the_container_runs_the_notebook_under_papermill(name, doc):
    container = pod_specs(doc)[0]["containers"][0]
    assert container["command"] == manifests.ENTRYPOINT
    args = container["args"]
    assert (ROOT / args[0]).is_file()  # notebooks/train.ipynb, relative to the image's WORKDIR
    output_dir = f"{OUTPUTS_MOUNT}/{doc['metadata']['name']}"
    assert args[1].startswith(output_dir + "/") and args[1].endswith(".ipynb")
    assert args[2:5] == ["-p", "output_dir", output_dir]
    assert env_of(container)["GEMMALAB_OUTPUT_DIR"] == output_dir
    assert "--log-output" in args
    for value in re.findall(r"\$\((\w+)\)", args[1]):  # kubelet expands $(VAR) from env
        assert value in env_of(container)


def test_build_picks_a_job_for_one_host_and_a_jobset_for_several():
    [single] = manifests.build(ClusterConfig(accelerator="v6e", topology="2x2"))
    assert single.kind == "Job" and single.spec.template.spec.containers[0].resources.limits[
        "google.com/tpu"] == "4"
    [multi] = manifests.build(ClusterConfig(accelerator="v5p", topology="2x2x2"))
    assert multi["kind"] == "JobSet"
    assert multi["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 2
    with pytest.raises(ValueError, match="use jobset"):
        manifests.job(ClusterConfig(accelerator="v6e", topology="4x4", params={"batch_size": 16}))
    v5e = manifests.jobset(ClusterConfig(accelerator="v5e", topology="4x4",
                                         params={"batch_size": 16}))
    assert not list(jobset_validator().iter_errors(v5e))
    for _, job_spec in child_jobs(v5e):
        _validate(as_job(v5e, job_spec))


def test_a_dpo_run_is_one_parameter_and_a_bad_objective_is_refused(capsys):
    from gemmalab.k8s.cli import main

    assert main(["job", "--name", "dpo-run", "-p", "objective", "dpo", "-p", "dpo_beta",
                 "0.2"]) == 0
    [doc] = yaml.safe_load_all(capsys.readouterr().out)
    args = pod_specs(doc)[0]["containers"][0]["args"]
    assert args[args.index("objective") + 1] == "dpo"
    assert args[args.index("dpo_beta") + 1] == "0.2"
    assert main(["job", "-p", "objective", "ppo"]) == 2
    assert "objective: unknown objective 'ppo'" in capsys.readouterr().err


def test_the_cpu_profile_runs_the_same_objects_on_the_local_node(tmp_path):
    """accelerator="cpu": the image, entrypoint, service account, user, mounts and papermill
    parameters of the GKE runs; the local node's selector and toleration, CPU and memory
    requested without limits, its directories for the buckets, and one JAX process a pod
    coordinated through the JobSet's DNS names."""
    from kubernetes import client as k8s

    data, outputs = tmp_path / "data", tmp_path / "outputs"
    one = ClusterConfig(accelerator="cpu", job_name="cpu-one", params={"recipe": "tiny"},
                        local_data_dir=str(data), local_outputs_dir=str(outputs))
    [job] = manifests.build(one)
    doc = k8s.ApiClient().sanitize_for_serialization(job)
    _validate(doc)
    tpu_doc = k8s.ApiClient().sanitize_for_serialization(
        manifests.build(ClusterConfig(params={"recipe": "tiny"}, job_name="cpu-one"))[0])
    [spec], [tpu_spec] = pod_specs(doc), pod_specs(tpu_doc)
    [train], [tpu_train] = spec["containers"], tpu_spec["containers"]
    for same in ("command", "args", "securityContext", "volumeMounts"):
        assert train[same] == tpu_train[same], same
    assert spec["securityContext"] == tpu_spec["securityContext"]
    assert spec["serviceAccountName"] == tpu_spec["serviceAccountName"]
    assert train["image"].startswith("localhost/gemmalab-cpu:")
    assert spec["nodeSelector"] == {"gemmalab.dev/node": "cpu"}
    assert spec["tolerations"] == [{"key": "gemmalab.dev/node", "operator": "Equal",
                                    "value": "cpu", "effect": "NoSchedule"}]
    assert train["resources"] == {"requests": {"cpu": "500m", "memory": "3Gi"}}
    assert {v["name"]: v.get("hostPath", {}).get("path") for v in spec["volumes"]} == {
        "data": str(data), "outputs": str(outputs), "cache": None}
    assert "annotations" not in pod_metadata(doc)[0]  # no GCS FUSE sidecar
    assert env_of(train)["JAX_PLATFORMS"] == "cpu"

    two = ClusterConfig(accelerator="cpu", num_nodes=2, job_name="cpu-two",
                        params={"recipe": "tiny", "batch_size": 8})
    [jobset] = manifests.build(two)
    assert not list(jobset_validator().iter_errors(jobset))
    assert pods(jobset) == 2 and "annotations" not in jobset["metadata"]  # no node pools
    env = env_of(pod_specs(jobset)[0]["containers"][0])
    assert env["JAX_COORDINATOR_ADDRESS"] == "cpu-two-slice-0-0.cpu-two:1234"
    assert env["JAX_NUM_PROCESSES"] == "2"
    assert two.describe() == "2 x cpu (local node)" and two.total_devices == 2


@pytest.mark.parametrize(("fields", "message"), [
    (dict(topology="2x4"), "topology: is for TPU slices"),
    (dict(num_slices=2), "num_slices: is for TPU slices"),
    (dict(gpus_per_node=4), "gpus_per_node: is for GPUs"),
    (dict(local_outputs_dir="outputs"), "local_outputs_dir: 'outputs' is not an absolute path"),
    (dict(num_nodes=2, params={"batch_size": 3}), "params.batch_size: 3 is not divisible by the 2"),
])
def test_the_cpu_profile_refuses_what_it_cannot_run(fields, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}"):
        ClusterConfig(accelerator="cpu", **fields)
    if "local_outputs_dir" in fields:
        with pytest.raises(ConfigError, match="^local_outputs_dir: is for the local cluster's"):
            ClusterConfig(local_outputs_dir="/x")
