"""Cloud Storage FUSE CSI volumes: data read-only at /data, outputs read-write at /outputs.

The CSI driver injects a ``gke-gcsfuse-sidecar`` container into every pod annotated
``gke-gcsfuse/volumes: "true"``; its resources come from the ``gke-gcsfuse/*`` annotations. The
sidecar authenticates as the pod's Kubernetes service account through Workload Identity, so the
bucket roles are granted to the Google service account that KSA is bound to (setup-storage.sh).
"""

from __future__ import annotations

from kubernetes import client

from gemmalab.k8s.config import (
    CACHE_MOUNT,
    DATA_MOUNT,
    OUTPUTS_MOUNT,
    RUN_AS_USER,
    ClusterConfig,
)

DRIVER = "gcsfuse.csi.storage.gke.io"
VOLUMES_ANNOTATION = "gke-gcsfuse/volumes"

# Sidecar requests = limits (Autopilot requires equal values). Writes of checkpoints are staged
# on the sidecar's ephemeral storage before upload (gcsfuse 3 streams new files instead).
SIDECAR_RESOURCES = {"cpu": "2", "memory": "4Gi", "ephemeral-storage": "10Gi"}

DATA_VOLUME = "data"
OUTPUTS_VOLUME = "outputs"
CACHE_VOLUME = "cache"

# Files appear owned by the image's non-root user. implicit-dirs: see "directories" that exist
# only as object prefixes (e.g. uploaded with `gcloud storage cp -r`).
_OWNER = f"uid={RUN_AS_USER},gid={RUN_AS_USER}"
DATA_MOUNT_OPTIONS = f"implicit-dirs,{_OWNER}"
# rename-dir-limit: Orbax commits a checkpoint by renaming its temporary directory; on a bucket
# without hierarchical namespace gcsfuse refuses directory renames unless this is set.
OUTPUTS_MOUNT_OPTIONS = f"implicit-dirs,{_OWNER},file-mode=664,dir-mode=775,rename-dir-limit=10000"


def pod_annotations() -> dict[str, str]:
    annotations = {VOLUMES_ANNOTATION: "true"}
    for resource, quantity in SIDECAR_RESOURCES.items():
        annotations[f"gke-gcsfuse/{resource}-limit"] = quantity
        annotations[f"gke-gcsfuse/{resource}-request"] = quantity
    return annotations


def _bucket(name: str, bucket: str, options: str, read_only: bool) -> client.V1Volume:
    return client.V1Volume(
        name=name,
        csi=client.V1CSIVolumeSource(
            driver=DRIVER,
            read_only=read_only,
            volume_attributes={"bucketName": bucket, "mountOptions": options},
        ),
    )


def volumes(config: ClusterConfig) -> list[client.V1Volume]:
    return [
        _bucket(DATA_VOLUME, config.resolved_data_bucket, DATA_MOUNT_OPTIONS, read_only=True),
        _bucket(OUTPUTS_VOLUME, config.resolved_outputs_bucket, OUTPUTS_MOUNT_OPTIONS,
                read_only=False),
        client.V1Volume(name=CACHE_VOLUME, empty_dir=client.V1EmptyDirVolumeSource(
            size_limit=f"{config.cache_size_gi}Gi")),
    ]


def volume_mounts() -> list[client.V1VolumeMount]:
    return [
        client.V1VolumeMount(name=DATA_VOLUME, mount_path=DATA_MOUNT, read_only=True),
        client.V1VolumeMount(name=OUTPUTS_VOLUME, mount_path=OUTPUTS_MOUNT, read_only=False),
        client.V1VolumeMount(name=CACHE_VOLUME, mount_path=CACHE_MOUNT),
    ]
