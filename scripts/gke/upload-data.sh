#!/usr/bin/env bash
# Put the training data (TinyStories by default) into the data bucket: /data/<file> in the pods.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DATA_FILE="${DATA_FILE:-TinyStories-train.txt}"
DATA_URL="${DATA_URL:-https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStories-train.txt}"

usage() {
  cat <<USAGE
Usage: $0 [--dry-run]

Downloads \$DATA_FILE from \$DATA_URL if it is not here, then copies it to gs://\$DATA_BUCKET
unless an object of that name is already there. The notebook reads it as
-p data_path /data/\$(basename \$DATA_FILE).
USAGE
}

parse_common_args "$@"
require_real_project

object="gs://$DATA_BUCKET/$(basename "$DATA_FILE")"
if exists gcloud storage objects describe "$object"; then
  log "$object is already there"
  exit 0
fi
if [[ ! -f "$DATA_FILE" ]]; then
  log "downloading $DATA_URL"
  run curl --fail --location --retry 3 --output "$DATA_FILE" "$DATA_URL"
fi
run gcloud storage cp "$DATA_FILE" "$object"
