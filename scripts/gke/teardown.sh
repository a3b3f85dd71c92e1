#!/usr/bin/env bash
# Stop paying: delete the training runs and the cluster; buckets and accounts only on request.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

KEEP_CLUSTER=0
DELETE_STORAGE=0

usage() {
  cat <<USAGE
Usage: $0 [--keep-cluster] [--delete-storage] [--dry-run]

Deletes every gemmalab Job/JobSet in \$NAMESPACE and the cluster \$CLUSTER.
  --keep-cluster    only delete the runs (the TPU nodes of Autopilot go with them)
  --delete-storage  also delete gs://\$DATA_BUCKET, gs://\$OUTPUTS_BUCKET (all outputs and
                    checkpoints!), the Google service account and the image repository
USAGE
}

script_option() {
  case "$1" in
    --keep-cluster) KEEP_CLUSTER=1 ;;
    --delete-storage) DELETE_STORAGE=1 ;;
    *) return 1 ;;
  esac
}

parse_common_args "$@"
require_real_project

if ! gone gcloud container clusters describe "$CLUSTER" --location="$REGION" \
  --project="$PROJECT_ID"; then
  use_cluster
  log "training runs in $NAMESPACE"
  gone kubectl get crd jobsets.jobset.x-k8s.io ||
    run kubectl delete jobsets.jobset.x-k8s.io --namespace="$NAMESPACE" \
      --selector=app.kubernetes.io/name=gemmalab --ignore-not-found
  run kubectl delete jobs --namespace="$NAMESPACE" --selector=app.kubernetes.io/name=gemmalab \
    --ignore-not-found --cascade=background
  if [[ "$KEEP_CLUSTER" != 1 ]]; then
    log "cluster $CLUSTER"
    run gcloud container clusters delete "$CLUSTER" --location="$REGION" \
      --project="$PROJECT_ID" --quiet
  fi
fi

if [[ "$DELETE_STORAGE" == 1 ]]; then
  log "buckets, service account, image repository"
  for bucket in "$DATA_BUCKET" "$OUTPUTS_BUCKET"; do
    gone gcloud storage buckets describe "gs://$bucket" --project="$PROJECT_ID" ||
      run gcloud storage rm --recursive "gs://$bucket"
  done
  gone gcloud iam service-accounts describe "$GSA_EMAIL" --project="$PROJECT_ID" ||
    run gcloud iam service-accounts delete "$GSA_EMAIL" --project="$PROJECT_ID" --quiet
  gone gcloud artifacts repositories describe "$AR_REPOSITORY" --location="$REGION" \
    --project="$PROJECT_ID" ||
    run gcloud artifacts repositories delete "$AR_REPOSITORY" --location="$REGION" \
      --project="$PROJECT_ID" --quiet
fi
