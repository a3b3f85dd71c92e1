"""scripts/gke/*.sh: strict bash, non-interactive, and --dry-run prints every command, filled in,
without running any (gcloud, kubectl and curl are replaced by stubs that record a call)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from gemmalab.k8s import config
from tests.helpers.k8s import ROOT

GKE = ROOT / "scripts" / "gke"
SCRIPTS = ("setup-cluster.sh", "install-jobset.sh", "install-kueue.sh", "setup-storage.sh",
           "upload-data.sh", "teardown.sh")
ALL = (*SCRIPTS, "common.sh")
STUBBED = ("gcloud", "kubectl", "curl", "gsutil", "helm", "docker")
FAKE_ENV = {"PROJECT_ID": "acme-research", "REGION": "europe-west4", "ZONE": "europe-west4-a",
            "CLUSTER": "lab", "NAMESPACE": "team-a", "SERVICE_ACCOUNT": "trainer-sa",
            "PROJECT_NUMBER": "123456789"}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """A bin/ of gcloud/kubectl/curl/... that log their call and fail."""
    root = tmp_path_factory.mktemp("stubs")
    (root / "bin").mkdir()
    for name in STUBBED:
        stub = root / "bin" / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{root}/calls.log"\nexit 97\n')
        stub.chmod(0o755)
    return root


def dry_run(script: str, stubs: Path, *args: str, **env: str) -> str:
    full_env = {"PATH": f"{stubs / 'bin'}:/usr/bin:/bin", "HOME": str(stubs),
                **FAKE_ENV, **env}
    result = subprocess.run(["bash", str(GKE / script), "--dry-run", *args], env=full_env,
                            cwd=stubs, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert not (stubs / "calls.log").exists(), (stubs / "calls.log").read_text()
    return result.stdout


def commands(output: str) -> list[str]:
    return [line[2:] for line in output.splitlines() if line.startswith("+ ")]


@pytest.mark.parametrize("script", ALL)
def test_scripts_are_strict_and_non_interactive(script):
    path = GKE / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in text
    assert not re.search(r"(^|[;&|(]\s*)read\b", text, re.MULTILINE), "interactive read"
    if script != "common.sh":
        assert os.access(path, os.X_OK)
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in text


def test_gcloud_never_prompts(stubs):
    assert "export CLOUDSDK_CORE_DISABLE_PROMPTS=1" in (GKE / "common.sh").read_text()
    out = commands(dry_run("teardown.sh", stubs, "--delete-storage"))
    deletes = [c for c in out if c.startswith("gcloud ") and " delete " in c]
    assert deletes and all(c.endswith(" --quiet") for c in deletes)


def test_defaults_match_the_rendered_manifests():
    text = (GKE / "common.sh").read_text()

    def default(name: str) -> str:
        return re.search(rf'^{name}="\$\{{{name}:-(.*)\}}"', text, re.MULTILINE)[1]

    cluster = config.ClusterConfig()
    assert default("PROJECT_ID") == cluster.project
    assert default("REGION") == cluster.region and default("ZONE") == cluster.zone
    assert default("NAMESPACE") == cluster.namespace
    assert default("SERVICE_ACCOUNT") == cluster.service_account
    assert default("AR_REPOSITORY") == config.ARTIFACT_REPOSITORY
    assert default("DATA_BUCKET") == "${PROJECT_ID}-gemmalab-data"
    assert default("OUTPUTS_BUCKET") == "${PROJECT_ID}-gemmalab-outputs"


def test_setup_cluster_autopilot(stubs):
    out = commands(dry_run("setup-cluster.sh", stubs))
    assert ("gcloud container clusters create-auto lab --location=europe-west4 "
            "--project=acme-research --release-channel=regular") in out
    assert any(c.startswith("gcloud artifacts repositories create gemmalab ") for c in out)
    assert ("gcloud container clusters get-credentials lab --location=europe-west4 "
            "--project=acme-research") in out
    assert not any("node-pools create" in c for c in out)


def test_setup_cluster_standard_multislice_pools(stubs):
    out = commands(dry_run("setup-cluster.sh", stubs, "--standard",
                           TPU_MACHINE_TYPE="ct6e-standard-4t", TPU_TOPOLOGY="2x4",
                           TPU_SLICES="2"))
    create = next(c for c in out if c.startswith("gcloud container clusters create lab "))
    assert "--workload-pool=acme-research.svc.id.goog" in create
    assert "--addons=GcsFuseCsiDriver" in create
    pools = [c for c in out if "node-pools create" in c]
    assert [p.split()[4] for p in pools] == ["tpu-v6e-0", "tpu-v6e-1"]
    for pool in pools:
        assert "--machine-type=ct6e-standard-4t" in pool and "--num-nodes=2" in pool
        assert "--tpu-topology=2x4" in pool and "--node-locations=europe-west4-a" in pool
        assert "--workload-metadata=GKE_METADATA" in pool


def test_setup_cluster_single_host_pool_has_no_topology(stubs):
    out = commands(dry_run("setup-cluster.sh", stubs, "--standard"))
    [pool] = [c for c in out if "node-pools create" in c]
    assert "--machine-type=ct6e-standard-1t" in pool and "--num-nodes=1" in pool
    assert "--tpu-topology" not in pool


def test_install_jobset_pins_one_version(stubs):
    text = (GKE / "install-jobset.sh").read_text()
    [version] = re.findall(r'^JOBSET_VERSION="(v\d+\.\d+\.\d+)"$', text, re.MULTILINE)
    out = commands(dry_run("install-jobset.sh", stubs))
    assert ("kubectl apply --server-side --force-conflicts -f https://github.com/kubernetes-sigs/"
            f"jobset/releases/download/{version}/manifests.yaml") in out
    assert any(c.startswith("kubectl rollout status deployment/jobset-controller-manager")
               for c in out)
    # The vendored JobSet schema the manifests are validated against is that release's.
    assert (ROOT / f"tests/k8s/fixtures/jobset-{version}-v1alpha2.schema.json").is_file()


def test_install_kueue_pins_the_release_the_manifests_are_validated_against(stubs):
    from gemmalab.k8s import kueue

    text = (GKE / "install-kueue.sh").read_text()
    [version] = re.findall(r'^KUEUE_VERSION="(v\d+\.\d+\.\d+)"$', text, re.MULTILINE)
    assert version == kueue.KUEUE_VERSION
    for kind in ("resourceflavor", "clusterqueue", "localqueue", "admissioncheck",
                 "provisioningrequestconfig"):
        assert (ROOT / f"tests/k8s/fixtures/kueue-{version}-v1beta2-{kind}.schema.json").is_file()
    out = commands(dry_run("install-kueue.sh", stubs, NAMESPACE="default"))
    assert out[1:] == [
        "kubectl apply --server-side --force-conflicts -f https://github.com/kubernetes-sigs/"
        f"kueue/releases/download/{version}/manifests.yaml",
        "kubectl wait deployment/kueue-controller-manager -n kueue-system "
        "--for=condition=available --timeout=300s",
        f"kubectl apply -f {ROOT}/k8s/kueue-v6e.yaml"]
    flex = commands(dry_run("install-kueue.sh", stubs, "--flex-start", NAMESPACE="default"))
    assert flex[-1] == f"kubectl apply -f {ROOT}/k8s/kueue-v6e-flex-start.yaml"
    mine = stubs / "team-a-queue.yaml"
    mine.write_text("---\n")
    out = commands(dry_run("install-kueue.sh", stubs, QUEUE_MANIFEST=str(mine)))  # team-a
    assert out[-1] == f"kubectl apply -f {mine}"


def test_install_kueue_refuses_the_default_namespaces_queue_for_another(stubs):
    env = {"PATH": f"{stubs / 'bin'}:/usr/bin:/bin", "HOME": str(stubs), **FAKE_ENV}
    refused = subprocess.run(["bash", str(GKE / "install-kueue.sh"), "--dry-run"], env=env,
                             capture_output=True, text=True)
    assert refused.returncode != 0
    assert "in namespace default, not team-a" in refused.stderr
    assert "--namespace team-a" in refused.stderr
    assert not (stubs / "calls.log").exists()


def test_setup_storage_binds_one_service_account_with_least_privilege(stubs):
    out = commands(dry_run("setup-storage.sh", stubs))
    gsa = "trainer-sa@acme-research.iam.gserviceaccount.com"
    assert ("gcloud storage buckets add-iam-policy-binding gs://acme-research-gemmalab-data "
            f"--member=serviceAccount:{gsa} --role=roles/storage.objectViewer") in out
    assert ("gcloud storage buckets add-iam-policy-binding gs://acme-research-gemmalab-outputs "
            f"--member=serviceAccount:{gsa} --role=roles/storage.objectUser") in out
    assert (f"gcloud iam service-accounts add-iam-policy-binding {gsa} --project=acme-research "
            "--role=roles/iam.workloadIdentityUser "
            "'--member=serviceAccount:acme-research.svc.id.goog[team-a/trainer-sa]'") in out
    assert "kubectl create serviceaccount trainer-sa --namespace=team-a" in out
    assert ("kubectl annotate serviceaccount trainer-sa --namespace=team-a --overwrite "
            f"iam.gke.io/gcp-service-account={gsa}") in out
    outputs = next(c for c in out if c.startswith(
        "gcloud storage buckets create gs://acme-research-gemmalab-outputs"))
    assert "--enable-hierarchical-namespace" in outputs
    # Every create is preceded by its existence check (idempotent).
    for i, command in enumerate(out):
        if " create " in f" {command} " and "add-iam" not in command:
            assert "describe" in out[i - 1] or " get " in out[i - 1], command


def test_upload_data_checks_then_downloads_then_copies(stubs):
    out = commands(dry_run("upload-data.sh", stubs, DATA_FILE="stories.txt"))
    assert out[0].startswith("gcloud storage objects describe "
                             "gs://acme-research-gemmalab-data/stories.txt")
    assert out[1].startswith("curl --fail --location")
    assert out[2] == "gcloud storage cp stories.txt gs://acme-research-gemmalab-data/stories.txt"


def test_teardown_deletes_runs_and_cluster_and_storage_only_on_request(stubs):
    out = commands(dry_run("teardown.sh", stubs))
    assert ("gcloud container clusters delete lab --location=europe-west4 "
            "--project=acme-research --quiet") in out
    assert any(c.startswith("kubectl delete jobs --namespace=team-a") for c in out)
    assert not any("storage rm" in c for c in out)
    out = commands(dry_run("teardown.sh", stubs, "--keep-cluster", "--delete-storage"))
    assert not any("clusters delete" in c for c in out)
    assert "gcloud storage rm --recursive gs://acme-research-gemmalab-outputs" in out


def test_bad_arguments_and_placeholder_project_are_refused(stubs):
    env = {"PATH": f"{stubs / 'bin'}:/usr/bin:/bin", "HOME": str(stubs)}
    bad = subprocess.run(["bash", str(GKE / "setup-cluster.sh"), "--bogus"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown argument: --bogus" in bad.stderr
    placeholder = subprocess.run(["bash", str(GKE / "setup-storage.sh")], env=env,
                                 capture_output=True, text=True)
    assert placeholder.returncode != 0 and "placeholder" in placeholder.stderr
    assert not (stubs / "calls.log").exists()
    helped = subprocess.run(["bash", str(GKE / "teardown.sh"), "--help"], env=env,
                            capture_output=True, text=True, check=True)
    assert "--delete-storage" in helped.stdout
