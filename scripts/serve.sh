#!/usr/bin/env bash
# Set up, then run the Ray Serve app locally on the default model (http://localhost:8000). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Ray starts actors at nice 15; the engine replicas are the work, so they run at nice 0 (README: Performance)
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
exec serve run serve_app/config.yaml "$@"
