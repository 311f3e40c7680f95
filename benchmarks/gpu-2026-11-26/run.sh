#!/bin/bash
# One device call, cheapest and most important first: check dyn_varlen's flash path for grouped-query
# attention and windows against the per-document loop, time one GQA layer both ways, count the
# synchronizing calls of one training step (check_gqa.py); then profile a GQA llama-350m
# (llama-350m-gqa.json: 16 query / 4 key-value heads) in bf16 and train it four ways on that profile.
# Run from the package root with PYTHONPATH set; OUT is where the results go (8 files, each written
# as its part ends, so a run cut short keeps the parts before). TRAIN=0 stops after the checks.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu-gqa}
HERE=benchmarks/gpu-2026-11-26
MODEL=$HERE/llama-350m-gqa.json
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/check-log.txt"
python3 $HERE/check_gqa.py --out "$OUT/check.json" 2>&1 | tee -a "$OUT/check-log.txt"
echo "check_gqa.py exit status $?" | tee -a "$OUT/check-log.txt"
[ "${TRAIN:-1}" = 1 ] || exit 0
python3 -m dyn_plugin profile --model $MODEL --out "$OUT/profile.json" \
  --seq-lens 512,2048,8192 --micro-batch-sizes 1,4,16 --max-tokens 32768 \
  --recompute none,selective,full --repeats 3 --validate 16 --no-progress 2>&1 | tee "$OUT/profile-log.txt" || exit 1
# variable shapes fragment the caching allocator; expandable segments keep the freed memory usable
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --nproc_per_node=1 \
  -m dyn_plugin.bench.train_deepspeed --profile "$OUT/profile.json" --model $MODEL --out /tmp/train --max-len 8192 \
  --global-tokens 65536 --steps 5 --warmup 1 --modes padded,packing,packing_varlen,dyn_plugin 2>&1 \
  | tee "$OUT/train-log.txt" || exit 1
cp /tmp/train/report.md /tmp/train/records.jsonl /tmp/train/summary.json "$OUT/"
