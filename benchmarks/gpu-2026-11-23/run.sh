#!/bin/bash
# One device call: check the flash varlen attention, profile llama-350m in bf16 on the GPU, then
# train it five ways on that profile. Run from the package root with PYTHONPATH set; OUT is where
# the results go (8 files). PROFILE=FILE reuses a profile measured before (the training alone).
set -o pipefail
OUT=${OUT:-out/gpu}
PROFILE=${PROFILE:-$OUT/profile.json}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
python3 benchmarks/gpu-2026-11-23/check_varlen.py 2>&1 | tee -a "$OUT/gpu.txt" || exit 1
if [ ! -f "$PROFILE" ]; then
  python3 -m dyn_plugin profile --model llama-350m --out "$PROFILE" \
    --seq-lens 512,2048,8192 --micro-batch-sizes 1,4,16 --max-tokens 32768 \
    --recompute none,selective,full --repeats 3 --validate 16 --no-progress 2>&1 | tee "$OUT/profile-log.txt" || exit 1
fi
# variable shapes fragment the caching allocator; expandable segments keep the freed memory usable
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --nproc_per_node=1 \
  -m dyn_plugin.bench.train_deepspeed --profile "$PROFILE" --model llama-350m --out /tmp/train --max-len 8192 \
  --global-tokens 65536 --steps 5 --warmup 1 2>&1 | tee "$OUT/train-log.txt" || exit 1
cp /tmp/train/report.md /tmp/train/records.jsonl /tmp/train/summary.json /tmp/train/step-trace.json "$OUT/"
