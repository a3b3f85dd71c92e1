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

install_controller JobSet jobset-system jobset-controller-manager "$JOBSET_VERSION" "$JOBSET_MANIFEST"
run kubectl rollout status deployment/jobset-controller-manager -n jobset-system --timeout=300s
