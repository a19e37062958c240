#!/usr/bin/env bash
# Set up, then run the offline engine on the default model (SmolLM2-135M-Instruct) with a few prompts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python -m engine.demo "$@"
