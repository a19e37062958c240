#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the `device` tool, when a session is lent one):
#   1. tests/test_kernels.py with the Triton kernels compiled for the GPU (not the interpreter);
#   2. the engine through the kernels: eager vs CUDA-graph decode, and fp32 against HF (scripts/gpu_check.py);
#   3. bench/kernels.py: each kernel's bandwidth against the device's copy bandwidth, and decode tok/s
#      eager vs graphs.
# Figures go to $OUT (or ./gpu_check_out). Expects the CUDA torch and the rest of requirements.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
rc=0
KVSCALE_KERNEL_DEVICE=cuda python -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$out/test_kernels.txt" | tail -5 || rc=1
python scripts/gpu_check.py 2>&1 | tee "$out/gpu_check.txt" | tail -25 || rc=1
python bench/kernels.py --decode-graphs --json "$out/kernels.json" 2>&1 | tee "$out/kernels.txt" || rc=1
grep -q "GPU CHECK PASSED" "$out/gpu_check.txt" || rc=1
grep -qE "[0-9]+ passed" "$out/test_kernels.txt" && ! grep -qE "[0-9]+ failed" "$out/test_kernels.txt" || rc=1
echo "gpu_check rc=$rc"
exit $rc
