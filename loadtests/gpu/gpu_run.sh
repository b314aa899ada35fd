#!/usr/bin/env bash
# The one device run: `bash loadtests/gpu/gpu_run.sh OUT_DIR [GPU_CHECK_FLAGS...]` on a CUDA
# machine, from the repository root (e.g. `--workloads fixed` for a shorter check). tests/gpu first, then the one-shot check (python -m loadtests.gpu_check),
# each under a hard timeout so that a hang still leaves its log in OUT_DIR.
# GPU_TESTS_TIMEOUT_S, GPU_CHECK_BUDGET_S and GPU_CHECK_TIMEOUT_S size them (at most
# 2 + 6 + 1 minutes by default); PYTHON names the interpreter (python3).
set -u
py=${PYTHON:-python3}
out=${1:-results}
shift || true
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv \
  > "$out/nvidia_smi.csv" 2>&1
"$py" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
timeout -k 10 "${GPU_TESTS_TIMEOUT_S:-120}" "$py" -m pytest tests/gpu -q -p no:cacheprovider \
  2>&1 | tee "$out/gpu_tests.log"
echo "tests/gpu exit: ${PIPESTATUS[0]}"
budget=${GPU_CHECK_BUDGET_S:-360}
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-$((budget + 60))}" "$py" -m loadtests.gpu_check --out "$out" \
  --total-budget-s "$budget" "$@" 2>&1 | tee "$out/gpu_check.log"
echo "gpu_check exit: ${PIPESTATUS[0]}"
