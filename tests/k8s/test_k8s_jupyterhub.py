"""k8s/jupyterhub-values.yaml: valid for the zero-to-jupyterhub chart, closed hub, TPU profiles."""

from __future__ import annotations

import dataclasses

from gemmalab.k8s.config import DATA_MOUNT, OUTPUTS_MOUNT, RUN_AS_USER, ClusterConfig
from gemmalab.k8s.jupyterhub import CHART_VERSION, HubAuth, hub_values
from tests.helpers.k8s import (
    HUB_FILE,
    K8S,
    chart_defaults,
    helm_merge,
    hub_validator,
    load_docs,
)

[VALUES] = load_docs(K8S / HUB_FILE)


def _errors(values: dict) -> list[str]:
    merged = helm_merge(chart_defaults(), values)
    return [f"{list(e.path)}: {e.message}" for e in hub_validator().iter_errors(merged)]


def test_values_validate_against_the_chart_schema():
    assert CHART_VERSION == "4.4.0"  # the vendored schema's version
    assert _errors(VALUES) == []
    assert _errors({"singleuser": {"storage": {"extraVolumeMount": []}}})  # typo caught


def test_the_hub_is_never_open():
    config = VALUES["hub"]["config"]
    assert config["JupyterHub"]["authenticator_class"] == "google"
    assert "allow_all" not in str(VALUES) and "dummy" not in str(VALUES).lower()
    assert config["Authenticator"]["allowed_users"] and config["Authenticator"]["admin_users"]
    assert config["GoogleOAuthenticator"]["hosted_domain"]
    env = VALUES["hub"]["extraEnv"]
    assert "secretKeyRef" in env["OAUTH_CLIENT_SECRET"]["valueFrom"]  # no secret in the file
    assert VALUES["proxy"]["https"]["enabled"] is True


def test_user_servers_use_the_image_user_and_the_training_service_account():
    singleuser = VALUES["singleuser"]
    config = ClusterConfig()
    assert singleuser["serviceAccountName"] == config.service_account
    assert f"{singleuser['image']['name']}:{singleuser['image']['tag']}" == config.resolved_image
    assert singleuser["uid"] == singleuser["fsGid"] == RUN_AS_USER
    # Workload Identity needs the metadata server; blocking it would add a privileged init pod.
    assert singleuser["cloudMetadata"]["blockWithIptables"] is False
    assert singleuser["networkPolicy"]["egressAllowRules"]["cloudMetadataServer"] is True


def test_buckets_are_mounted_read_only_and_read_write():
    storage = VALUES["singleuser"]["storage"]
    volumes = {v["name"]: v["csi"] for v in storage["extraVolumes"]}
    mounts = {m["mountPath"]: m for m in storage["extraVolumeMounts"]}
    assert mounts[DATA_MOUNT]["readOnly"] and volumes[mounts[DATA_MOUNT]["name"]]["readOnly"]
    assert not mounts[OUTPUTS_MOUNT]["readOnly"]
    assert not volumes[mounts[OUTPUTS_MOUNT]["name"]]["readOnly"]
    assert VALUES["singleuser"]["extraAnnotations"]["gke-gcsfuse/volumes"] == "true"


def test_profiles_cpu_and_single_host_tpus():
    profiles = {p["slug"]: p["kubespawner_override"] for p in VALUES["singleuser"]["profileList"]}
    assert set(profiles) == {"cpu", "tpu-v6e-1x1", "tpu-v6e-2x2"}
    for slug, chips in (("tpu-v6e-1x1", "1"), ("tpu-v6e-2x2", "4")):
        override = profiles[slug]
        assert override["node_selector"] == {
            "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
            "cloud.google.com/gke-tpu-topology": slug.rsplit("-", 1)[1]}
        assert override["extra_resource_limits"] == {"google.com/tpu": chips}
        assert override["extra_resource_guarantees"] == {"google.com/tpu": chips}
        assert override["mem_limit"] == override["mem_guarantee"]
    assert "google.com/tpu" not in str(profiles["cpu"])
    assert VALUES["cull"]["enabled"] is True


def test_auth_settings_are_yours_to_choose():
    auth = HubAuth(hub_host="hub.acme.org", hosted_domain="acme.org",
                   admin_users=("ada@acme.org",), allowed_users=("bob@acme.org",))
    values = hub_values(dataclasses.replace(ClusterConfig(), project="acme-research"), auth)
    assert values["hub"]["config"]["GoogleOAuthenticator"]["oauth_callback_url"] == (
        "https://hub.acme.org/hub/oauth_callback")
    assert values["proxy"]["https"]["hosts"] == ["hub.acme.org"]
    assert "acme-research" in values["singleuser"]["image"]["name"]
    assert _errors(values) == []
