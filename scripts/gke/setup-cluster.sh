#!/usr/bin/env bash
# Create the GKE cluster (Autopilot, or Standard with TPU node pools) and the image repository.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

MODE="${CLUSTER_MODE:-autopilot}"                     # autopilot | standard
TPU_MACHINE_TYPE="${TPU_MACHINE_TYPE:-ct6e-standard-1t}"  # Standard: 1t (1x1), 4t (2x2, 2x4, ...)
TPU_TOPOLOGY="${TPU_TOPOLOGY:-1x1}"
TPU_SLICES="${TPU_SLICES:-1}"                         # node pools of that shape (multislice: 2)
TPU_POOL="${TPU_POOL:-tpu-v6e}"
TPU_DISK_GB="${TPU_DISK_GB:-200}"                     # image + cache emptyDir + GCS FUSE staging
SPOT="${SPOT:-0}"                                     # 1: Spot TPU VMs (cheaper, preemptible)

usage() {
  cat <<USAGE
Usage: $0 [--autopilot | --standard] [--dry-run]

Creates (if missing) the cluster \$CLUSTER in \$REGION of \$PROJECT_ID with Workload Identity and
the Cloud Storage FUSE CSI driver, and the Artifact Registry repository \$AR_REPOSITORY.
  --autopilot  (default) GKE provisions TPU nodes from the pods' node selectors.
  --standard   a small CPU pool plus \$TPU_SLICES TPU node pool(s) of \$TPU_MACHINE_TYPE in
               \$TPU_TOPOLOGY in \$ZONE. For k8s/multislice-2x-v6e-2x4.yaml:
               TPU_MACHINE_TYPE=ct6e-standard-4t TPU_TOPOLOGY=2x4 TPU_SLICES=2 $0 --standard
Settings: PROJECT_ID REGION ZONE CLUSTER AR_REPOSITORY CLUSTER_MODE TPU_MACHINE_TYPE
TPU_TOPOLOGY TPU_SLICES TPU_POOL TPU_DISK_GB SPOT (see scripts/gke/common.sh for defaults).
USAGE
}

script_option() {
  case "$1" in
    --autopilot) MODE=autopilot ;;
    --standard) MODE=standard ;;
    *) return 1 ;;
  esac
}

parse_common_args "$@"
[[ "$MODE" == autopilot || "$MODE" == standard ]] || die "CLUSTER_MODE must be autopilot or standard"
require_real_project

# Hosts per slice = chips in the topology / chips of the machine type (ct6e-standard-4t: 4).
tpu_nodes() {
  local chips=1 dim per_host="${TPU_MACHINE_TYPE##*-}"
  per_host="${per_host%t}"
  [[ "$per_host" =~ ^[0-9]+$ ]] || die "cannot read the chips of TPU_MACHINE_TYPE=$TPU_MACHINE_TYPE"
  for dim in ${TPU_TOPOLOGY//x/ }; do chips=$((chips * dim)); done
  ((chips % per_host == 0)) || die "$TPU_TOPOLOGY does not split into $per_host-chip hosts"
  echo $((chips / per_host))
}

log "APIs"
run gcloud services enable container.googleapis.com artifactregistry.googleapis.com \
  storage.googleapis.com iamcredentials.googleapis.com --project="$PROJECT_ID"

log "Artifact Registry repository $AR_REPOSITORY"
exists gcloud artifacts repositories describe "$AR_REPOSITORY" --location="$REGION" \
  --project="$PROJECT_ID" ||
  run gcloud artifacts repositories create "$AR_REPOSITORY" --repository-format=docker \
    --location="$REGION" --project="$PROJECT_ID" --description="gemmalab images"
# The nodes pull images as the default compute service account.
run gcloud artifacts repositories add-iam-policy-binding "$AR_REPOSITORY" \
  --location="$REGION" --project="$PROJECT_ID" --role=roles/artifactregistry.reader \
  --member="serviceAccount:$(project_number)-compute@developer.gserviceaccount.com"

log "$MODE cluster $CLUSTER"
if [[ "$MODE" == autopilot ]]; then
  # Autopilot clusters have Workload Identity and the GCS FUSE CSI driver built in.
  exists gcloud container clusters describe "$CLUSTER" --location="$REGION" \
    --project="$PROJECT_ID" ||
    run gcloud container clusters create-auto "$CLUSTER" --location="$REGION" \
      --project="$PROJECT_ID" --release-channel=regular
else
  exists gcloud container clusters describe "$CLUSTER" --location="$REGION" \
    --project="$PROJECT_ID" ||
    run gcloud container clusters create "$CLUSTER" --location="$REGION" \
      --project="$PROJECT_ID" --release-channel=regular --enable-ip-alias \
      --workload-pool="$PROJECT_ID.svc.id.goog" --addons=GcsFuseCsiDriver \
      --machine-type=e2-standard-4 --num-nodes=1

  nodes="$(tpu_nodes)"
  for ((i = 0; i < TPU_SLICES; i++)); do
    pool="$TPU_POOL"
    ((TPU_SLICES == 1)) || pool="$TPU_POOL-$i"
    args=(--cluster="$CLUSTER" --location="$REGION" --project="$PROJECT_ID"
      --node-locations="$ZONE" --machine-type="$TPU_MACHINE_TYPE" --num-nodes="$nodes"
      --disk-size="$TPU_DISK_GB" --workload-metadata=GKE_METADATA)
    # Multi-host slices need their topology (and get a compact placement policy from it).
    ((nodes == 1)) || args+=(--tpu-topology="$TPU_TOPOLOGY")
    [[ "$SPOT" != 1 ]] || args+=(--spot)
    exists gcloud container node-pools describe "$pool" --cluster="$CLUSTER" \
      --location="$REGION" --project="$PROJECT_ID" ||
      run gcloud container node-pools create "$pool" "${args[@]}"
  done
fi

use_cluster
log "done: next scripts/gke/install-jobset.sh and scripts/gke/setup-storage.sh"
