#!/usr/bin/env bash
# Install Kueue and the queue gemmalab's runs join (`--queue gemmalab`): flavors for the TPU v6e
# slices, a ClusterQueue with their google.com/tpu quota, a LocalQueue in $NAMESPACE.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Pinned: k8s/kueue-*.yaml use kueue.x-k8s.io/v1beta2 as served by this release, and the tests
# validate them against its CRD schemas (tests/k8s/fixtures/kueue-<version>-*).
KUEUE_VERSION="v0.19.2"
KUEUE_MANIFEST="https://github.com/kubernetes-sigs/kueue/releases/download/${KUEUE_VERSION}/manifests.yaml"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
QUEUE_MANIFEST="${QUEUE_MANIFEST:-}"  # default: k8s/kueue-v6e.yaml (--flex-start: ...-flex-start)
FLEX_START=0

usage() {
  cat <<USAGE
Usage: $0 [--flex-start] [--dry-run]

Installs Kueue $KUEUE_VERSION into the cluster \$CLUSTER (namespace kueue-system) unless that
version is already running, waits for its controller, then applies the queue:
  k8s/kueue-v6e.yaml               flavors for v6e 1x1 and 2x4 slices, ClusterQueue and
                                   LocalQueue 'gemmalab' (namespace default)
  --flex-start                     k8s/kueue-v6e-flex-start.yaml instead: admission waits for
                                   GKE's flex-start (Dynamic Workload Scheduler) to provision
                                   a run's nodes; needs node pools created with --flex-start
                                   --enable-queued-provisioning (k8s/README.md)
QUEUE_MANIFEST=FILE applies another rendered queue (e.g. for another namespace:
python -m gemmalab.k8s render kueue-v6e.yaml --namespace team-a --out-dir my-k8s).
Multi-host runs are JobSets: install JobSet too (scripts/gke/install-jobset.sh).
USAGE
}

script_option() {
  case "$1" in
    --flex-start) FLEX_START=1 ;;
    *) return 1 ;;
  esac
}

parse_common_args "$@"
require_real_project
if [[ -z "$QUEUE_MANIFEST" ]]; then
  if [[ "$FLEX_START" == 1 ]]; then
    QUEUE_MANIFEST="$REPO_ROOT/k8s/kueue-v6e-flex-start.yaml"
  else
    QUEUE_MANIFEST="$REPO_ROOT/k8s/kueue-v6e.yaml"
  fi
  # The committed files put the LocalQueue in the placeholder namespace.
  [[ "$NAMESPACE" == default ]] || die "k8s/$(basename "$QUEUE_MANIFEST") puts the LocalQueue \
in namespace default, not $NAMESPACE: render yours (python -m gemmalab.k8s render \
$(basename "$QUEUE_MANIFEST") --namespace $NAMESPACE --out-dir my-k8s) and pass QUEUE_MANIFEST"
fi
[[ -f "$QUEUE_MANIFEST" ]] || die "no queue manifest at $QUEUE_MANIFEST"
use_cluster

install_controller Kueue kueue-system kueue-controller-manager "$KUEUE_VERSION" "$KUEUE_MANIFEST"
run kubectl wait deployment/kueue-controller-manager -n kueue-system --for=condition=available \
  --timeout=300s

log "queue from $QUEUE_MANIFEST"
# Applying again is harmless: the objects are declarative (a changed quota is updated in place).
run kubectl apply -f "$QUEUE_MANIFEST"
