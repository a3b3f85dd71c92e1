#!/usr/bin/env bash
# Shared by scripts/gke/*.sh: settings (environment variables with defaults), --dry-run, run().
#
# Every script is non-interactive and idempotent: it checks before it creates, so a second run
# only does what the first one did not finish. With --dry-run (or DRY_RUN=1) it prints every
# gcloud/kubectl command with its values filled in and runs none of them, not even the checks.
set -euo pipefail

# ---- settings (the defaults are the placeholders of k8s/README.md) ------------------------------
PROJECT_ID="${PROJECT_ID:-my-project}"
REGION="${REGION:-us-east5}"
ZONE="${ZONE:-us-east5-b}"
CLUSTER="${CLUSTER:-gemmalab}"
NAMESPACE="${NAMESPACE:-default}"
SERVICE_ACCOUNT="${SERVICE_ACCOUNT:-gemmalab-runner}"  # Kubernetes SA = Google SA account id
DATA_BUCKET="${DATA_BUCKET:-${PROJECT_ID}-gemmalab-data}"
OUTPUTS_BUCKET="${OUTPUTS_BUCKET:-${PROJECT_ID}-gemmalab-outputs}"
AR_REPOSITORY="${AR_REPOSITORY:-gemmalab}"
GSA_EMAIL="${SERVICE_ACCOUNT}@${PROJECT_ID}.iam.gserviceaccount.com"
DRY_RUN="${DRY_RUN:-0}"

# gcloud never prompts (deletions included): these scripts run unattended.
export CLOUDSDK_CORE_DISABLE_PROMPTS=1

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Print a command the way a shell would read it back (quote only what needs it).
show() {
  local out="+" arg quoted
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./:=@,+%-]+$ ]]; then
      out+=" $arg"
    else
      quoted=${arg//\'/\'\\\'\'}
      out+=" '$quoted'"
    fi
  done
  printf '%s\n' "$out"
}

# Run a command, or only print it under --dry-run.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    show "$@"
  else
    show "$@" >&2
    "$@"
  fi
}

# Succeed if a resource exists (the command's output is discarded). Under --dry-run the check is
# printed, not run, and the resource counts as missing, so the create command is printed too.
exists() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s  # check (assumed missing under --dry-run)\n' "$(show "$@")"
    return 1
  fi
  "$@" >/dev/null 2>&1
}

# The reverse, for teardown: succeed if a resource is already gone. Under --dry-run the check is
# printed and the resource counts as present, so the delete command is printed too.
gone() {
  if [[ "$DRY_RUN" == 1 ]]; then
    printf '%s  # check (assumed present under --dry-run)\n' "$(show "$@")"
    return 1
  fi
  ! "$@" >/dev/null 2>&1
}

# Parse the options every script shares; the script's usage() is printed for --help, and a
# script with options of its own defines script_option(), which returns 0 if it took the option.
parse_common_args() {
  local arg
  for arg in "$@"; do
    case "$arg" in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) usage; exit 0 ;;
      *)
        if ! declare -F script_option >/dev/null || ! script_option "$arg"; then
          die "unknown argument: $arg (see --help)"
        fi
        ;;
    esac
  done
}

# Refuse to touch a real project with the placeholder settings.
require_real_project() {
  if [[ "$DRY_RUN" != 1 && "$PROJECT_ID" == "my-project" ]]; then
    die "PROJECT_ID is the placeholder 'my-project': export PROJECT_ID=<your project id>"
  fi
}

# Point kubectl at the cluster (writes ~/.kube/config; harmless to repeat).
use_cluster() {
  run gcloud container clusters get-credentials "$CLUSTER" --location="$REGION" \
    --project="$PROJECT_ID"
}

# The project number, for the default compute service account of the nodes.
project_number() {
  if [[ -n "${PROJECT_NUMBER:-}" ]]; then
    printf '%s\n' "$PROJECT_NUMBER"
  elif [[ "$DRY_RUN" == 1 ]]; then
    printf 'PROJECT_NUMBER\n'
  else
    gcloud projects describe "$PROJECT_ID" --format='value(projectNumber)'
  fi
}

# Install a controller release (NAME, its namespace and deployment, VERSION, MANIFEST URL) unless
# that version already runs: server-side apply, as its CRDs are too large for the client-side
# last-applied annotation. A dry run prints the apply.
install_controller() {
  local name="$1" namespace="$2" deployment="$3" version="$4" manifest="$5"
  if [[ "$DRY_RUN" != 1 ]] && kubectl get deployment "$deployment" -n "$namespace" \
      -o jsonpath='{.spec.template.spec.containers[0].image}' 2>/dev/null |
      grep -q ":${version}\$"; then
    log "$name $version is already installed"
  else
    log "$name $version"
    run kubectl apply --server-side --force-conflicts -f "$manifest"
  fi
}
