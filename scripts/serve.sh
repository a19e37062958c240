#!/usr/bin/env bash
# Set up, then run the Ray Serve app locally on the default model (http://localhost:8000). Ctrl-C stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# `serve run` on the config, with Ray's actors at nice 0 rather than 15 (README: Performance)
exec kvscale serve serve_app/config.yaml "$@"
