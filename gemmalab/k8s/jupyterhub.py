"""Helm values for the zero-to-jupyterhub chart: notebook servers on CPU or TPU v6e nodes.

Users log in with Google (no open hub); their servers run the gemmalab image as its non-root
user under the same Workload-Identity service account as the training jobs, with the data
bucket mounted read-only at /data and the outputs bucket read-write at /outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from gemmalab.k8s import gcsfuse
from gemmalab.k8s.accelerators import TPU_RESOURCE, HostResources, tpu_slice
from gemmalab.k8s.config import DATA_MOUNT, OUTPUTS_MOUNT, RUN_AS_USER, ClusterConfig
from gemmalab.k8s.render import to_dict

CHART = "jupyterhub/jupyterhub"
CHART_VERSION = "4.4.0"  # zero-to-jupyterhub; the image must carry the same jupyterhub (5.5.0)
HUB_TPU_TOPOLOGIES = ("1x1", "2x2")  # single-host v6e: one notebook server owns the host
HOME = "/home/gemmalab"  # the image user's home (Dockerfile)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HubAuth:
    """Google login. The OAuth client id/secret/callback live in a Kubernetes Secret."""

    hub_host: str = "hub.example.com"
    contact_email: str = "admin@example.com"  # Let's Encrypt account
    hosted_domain: str = "example.com"  # only Google accounts of this domain can log in
    admin_users: Sequence[str] = ("admin@example.com",)
    allowed_users: Sequence[str] = ("researcher@example.com",)
    oauth_secret: str = "gemmalab-hub-oauth"  # keys: client-id, client-secret


def _gigabytes(memory: str) -> str:
    """KubeSpawner's byte strings: "320Gi" -> "320G" (rounding down, never past the request)."""
    return memory.removesuffix("Gi") + "G"


def _resources(host: HostResources) -> dict[str, Any]:
    return {"cpu_limit": float(host.cpu), "cpu_guarantee": float(host.cpu),
            "mem_limit": _gigabytes(host.memory), "mem_guarantee": _gigabytes(host.memory)}


def _tpu_profile(topology: str) -> dict[str, Any]:
    tpu = tpu_slice("v6e", topology)
    chips = str(tpu.chips)
    return {
        "display_name": f"TPU v6e {topology} ({tpu.chips} chip{'s' * (tpu.chips > 1)})",
        "slug": f"tpu-v6e-{topology}",
        "description": f"One {tpu.machine_type} host; idle servers are stopped after an hour.",
        "kubespawner_override": {
            "node_selector": tpu.node_selector,
            "extra_resource_limits": {TPU_RESOURCE: chips},
            "extra_resource_guarantees": {TPU_RESOURCE: chips},
            "tolerations": [{"key": TPU_RESOURCE, "operator": "Exists",
                             "effect": "NoSchedule"}],
            **_resources(tpu.host_resources),
        },
    }


def hub_values(config: ClusterConfig, auth: HubAuth | None = None) -> dict[str, Any]:
    auth = auth or HubAuth()
    name, tag = config.resolved_image.rsplit(":", 1)
    secret = auth.oauth_secret
    return {
        "hub": {
            "config": {
                "JupyterHub": {"authenticator_class": "google"},
                "Authenticator": {"admin_users": list(auth.admin_users),
                                  "allowed_users": list(auth.allowed_users)},
                "GoogleOAuthenticator": {
                    "hosted_domain": [auth.hosted_domain],
                    "login_service": "Google",
                    "oauth_callback_url": f"https://{auth.hub_host}/hub/oauth_callback",
                },
            },
            # OAuthenticator reads the client id and secret from these variables.
            "extraEnv": {
                "OAUTH_CLIENT_ID": {"valueFrom": {"secretKeyRef": {"name": secret,
                                                                   "key": "client-id"}}},
                "OAUTH_CLIENT_SECRET": {"valueFrom": {"secretKeyRef": {"name": secret,
                                                                       "key": "client-secret"}}},
            },
        },
        "proxy": {"https": {"enabled": True, "type": "letsencrypt", "hosts": [auth.hub_host],
                            "letsencrypt": {"contactEmail": auth.contact_email}}},
        "singleuser": {
            "image": {"name": name, "tag": tag, "pullPolicy": "IfNotPresent"},
            "serviceAccountName": config.service_account,
            "uid": RUN_AS_USER,
            "fsGid": RUN_AS_USER,
            "defaultUrl": "/lab",
            # Workload Identity tokens come from the GKE metadata server: let pods reach it.
            # (Blocking it would also add a privileged NET_ADMIN init container.)
            "cloudMetadata": {"blockWithIptables": False},
            "networkPolicy": {"egressAllowRules": {"cloudMetadataServer": True}},
            "extraAnnotations": gcsfuse.pod_annotations(),
            "storage": {
                "homeMountPath": HOME,
                "capacity": "20Gi",
                "extraVolumes": [to_dict(v) for v in gcsfuse.volumes(config)
                                 if v.name != gcsfuse.CACHE_VOLUME],
                "extraVolumeMounts": [
                    {"name": gcsfuse.DATA_VOLUME, "mountPath": DATA_MOUNT, "readOnly": True},
                    {"name": gcsfuse.OUTPUTS_VOLUME, "mountPath": OUTPUTS_MOUNT,
                     "readOnly": False},
                ],
            },
            "profileList": [
                {"display_name": "CPU (4 cores)", "slug": "cpu", "default": True,
                 "description": "Exploration and the embedded corpus; no accelerator.",
                 "kubespawner_override": {"cpu_limit": 4.0, "cpu_guarantee": 2.0,
                                          "mem_limit": "16G", "mem_guarantee": "8G"}},
                *[_tpu_profile(t) for t in HUB_TPU_TOPOLOGIES],
            ],
        },
        # Idle TPU servers cost money: stop them after an hour without activity.
        "cull": {"enabled": True, "timeout": 3600, "every": 300},
    }
