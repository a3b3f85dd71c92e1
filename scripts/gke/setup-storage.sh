#!/usr/bin/env bash
# Buckets, the service accounts and Workload Identity: the pods' access to Cloud Storage.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
  cat <<USAGE
Usage: $0 [--dry-run]

Creates (if missing):
  gs://\$DATA_BUCKET     data, mounted read-only at /data      (roles/storage.objectViewer)
  gs://\$OUTPUTS_BUCKET  outputs, checkpoints, XProf traces,   (roles/storage.objectUser)
                        mounted read-write at /outputs; hierarchical namespace, so that
                        checkpoint directories are renamed atomically
  the Google service account \$SERVICE_ACCOUNT@\$PROJECT_ID.iam.gserviceaccount.com, holding
  those roles, and the Kubernetes service account \$SERVICE_ACCOUNT in \$NAMESPACE, bound to it
  through Workload Identity (the one name used by every manifest in k8s/).
USAGE
}

parse_common_args "$@"
require_real_project

log "buckets"
exists gcloud storage buckets describe "gs://$DATA_BUCKET" --project="$PROJECT_ID" ||
  run gcloud storage buckets create "gs://$DATA_BUCKET" --project="$PROJECT_ID" \
    --location="$REGION" --uniform-bucket-level-access
exists gcloud storage buckets describe "gs://$OUTPUTS_BUCKET" --project="$PROJECT_ID" ||
  run gcloud storage buckets create "gs://$OUTPUTS_BUCKET" --project="$PROJECT_ID" \
    --location="$REGION" --uniform-bucket-level-access --enable-hierarchical-namespace

log "Google service account $GSA_EMAIL"
exists gcloud iam service-accounts describe "$GSA_EMAIL" --project="$PROJECT_ID" ||
  run gcloud iam service-accounts create "$SERVICE_ACCOUNT" --project="$PROJECT_ID" \
    --display-name="gemmalab training jobs and notebook servers"

# Bindings are idempotent: adding an existing one changes nothing.
run gcloud storage buckets add-iam-policy-binding "gs://$DATA_BUCKET" \
  --member="serviceAccount:$GSA_EMAIL" --role=roles/storage.objectViewer
run gcloud storage buckets add-iam-policy-binding "gs://$OUTPUTS_BUCKET" \
  --member="serviceAccount:$GSA_EMAIL" --role=roles/storage.objectUser
run gcloud iam service-accounts add-iam-policy-binding "$GSA_EMAIL" --project="$PROJECT_ID" \
  --role=roles/iam.workloadIdentityUser \
  --member="serviceAccount:$PROJECT_ID.svc.id.goog[$NAMESPACE/$SERVICE_ACCOUNT]"

log "Kubernetes service account $NAMESPACE/$SERVICE_ACCOUNT"
use_cluster
exists kubectl get namespace "$NAMESPACE" || run kubectl create namespace "$NAMESPACE"
exists kubectl get serviceaccount "$SERVICE_ACCOUNT" --namespace="$NAMESPACE" ||
  run kubectl create serviceaccount "$SERVICE_ACCOUNT" --namespace="$NAMESPACE"
run kubectl annotate serviceaccount "$SERVICE_ACCOUNT" --namespace="$NAMESPACE" --overwrite \
  "iam.gke.io/gcp-service-account=$GSA_EMAIL"
