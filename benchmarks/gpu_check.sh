#!/usr/bin/env bash
# One command for a machine with GPUs: blockshard's engine on NCCL against FSDP2 and one process.
#   bash benchmarks/gpu_check.sh [OUT_DIR]
# With 2+ GPUs: torchrun over min(4, #GPUs) GPUs, NCCL, then the gloo engine tests that run fast.
# With 1 GPU: one NCCL rank on it (the CUDA streams and events), then the CPU dry check.
# Without: the same script on 2 CPU ranks over gloo (a dry check that it runs and is bitwise).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
OUT="${1:-${OUT:-/tmp/blockshard-gpu-check}}"
mkdir -p "$OUT"
NGPU="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [ "$NGPU" -ge 2 ]; then
  N=$(( NGPU < 4 ? NGPU : 4 ))
  echo "gpu_check: $NGPU GPUs, NCCL on $N"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$N" benchmarks/gpu_check.py \
    --device cuda --json --out "$OUT/gpu_check.json"
  "$PY" -m pytest -q -x tests/runtime/test_fast_engine.py tests/runtime/test_fast_controls.py
elif [ "$NGPU" -eq 1 ]; then
  # NCCL cannot put two ranks on one GPU: one rank checks the CUDA path (streams, events, peak memory)
  echo "gpu_check: 1 GPU, NCCL on 1 rank (the CUDA path; sharding itself needs 2+ GPUs)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/gpu_check.py \
    --device cuda --json --out "$OUT/gpu_check.json"
  echo "gpu_check: and the dry check on 2 CPU ranks (gloo)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_check.py \
    --device cpu --json --out "$OUT/gpu_check_cpu.json"
else
  echo "gpu_check: no 2 GPUs here; dry check on 2 CPU ranks (gloo)"
  "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/gpu_check.py \
    --device cpu --json --out "$OUT/gpu_check.json"
fi
