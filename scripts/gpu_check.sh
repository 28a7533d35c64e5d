#!/bin/bash
# GPU checks for a freshly lent GPU or node, printed as one table (see scripts/gpu_check.py for the steps).
#
#   scripts/gpu_check.sh --dry-run            # the commands, nothing runs (works without a GPU)
#   scripts/gpu_check.sh                      # one GPU: about 5 minutes, at most --budget 480 s
#   scripts/gpu_check.sh --gpus 4 --json out.json
#
# PYTHON picks the interpreter (default: python3 on PATH); every step runs with a timeout and gets a row.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON=${PYTHON:-python3}
exec "$PYTHON" "$HERE/gpu_check.py" --python "$PYTHON" "$@"
