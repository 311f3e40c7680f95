#!/bin/bash
# One device call: predicted against measured peak memory of held-out micro-batches, then the
# caching allocator's margin over what tensors hold, default and with expandable segments
# (check_memory.py). From the package root; OUT is where the results go.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu-memory}
HERE=benchmarks/gpu-memory-2026-11-26
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/log.txt"
python3 $HERE/check_memory.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/log.txt"
