#!/usr/bin/env bash
# Install the JobSet controller (multi-host and multislice runs are JobSets).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Pinned: the manifests in k8s/ use jobset.x-k8s.io/v1alpha2 as served by this release.
JOBSET_VERSION="v0.11.1"
JOBSET_MANIFEST="https://github.com/kubernetes-sigs/jobset/releases/download/${JOBSET_VERSION}/manifests.yaml"

usage() {
  cat <<USAGE
Usage: $0 [--dry-run]

Installs JobSet $JOBSET_VERSION into the cluster \$CLUSTER (namespace jobset-system) unless that
version is already running, then waits for its controller.
USAGE
}

parse_common_args "$@"
require_real_project
use_cluster

installed() {
  [[ "$DRY_RUN" != 1 ]] || return 1
  kubectl get deployment jobset-controller-manager -n jobset-system \
    -o jsonpath='{.spec.template.spec.containers[0].image}' 2>/dev/null |
    grep -q ":${JOBSET_VERSION}\$"
}

if installed; then
  log "JobSet $JOBSET_VERSION is already installed"
else
  log "JobSet $JOBSET_VERSION"
  # Server-side apply: the CRD is too large for the client-side last-applied annotation.
  run kubectl apply --server-side --force-conflicts -f "$JOBSET_MANIFEST"
fi
run kubectl rollout status deployment/jobset-controller-manager -n jobset-system --timeout=300s
