#!/bin/bash
# Issue 26's GPU figures, prepared for one device call; the parts run cheapest first and each writes
# its files as it ends, so a call cut short keeps the parts before:
#   sync      the CUDA tests of tests/test_sync_free.py: a packed training step of a GQA Llama (flash
#             varlen) and of a soft-capped Gemma2 (compiled flex_attention) under
#             torch.cuda.set_sync_debug_mode("error"), gradients against the per-document loop
#   profile   the Llama-3.2-1B shape (llama-3.2-1b.json: 32 query / 8 key-value heads, 1.24B
#             parameters) in bf16 through the kernels training runs, with its held-out error
#   checkpoint  the checkpoint protocol's seal (hash, fsync, rename) and verify at a GPU-sized checkpoint
#             (CKPT_MB, 8 GiB by default, 8 files), warm and with the page cache dropped
#   train     DeepSpeed ZeRO-1 on one GPU, five batchings side by side: tokens/s, MFU, rank 0's peak
#             memory measured vs predicted, prediction error; documents up to 8192 tokens in global
#             batches of 65,536, then up to 32768 in batches of 131,072 (SIZES)
#   trainer   the Hugging Face Trainer under DeepSpeed ZeRO-1 at the first of SIZES: the stock Trainer
#             padded (group_by_length), TRL's SFTTrainer packing=True, the plugin through the Trainer
#             and in its own loop on the same plans (issue 40's figure; Accelerate takes DeepSpeed on a GPU)
#   calibration  the plugin with online calibration (dyn_plugin) and without (dyn_plugin_static),
#             CAL_STEPS steps each at the first of SIZES, beside a second process multiplying bf16
#             matrices on the same GPU (the machine changed under the profile): prediction error
#             per step (target <= 10% within 20 steps), memory factor from the measured peaks
# From the package root, the wheels in .whl/ installed (see README.md). PARTS picks parts (comma
# separated); OUT, MODEL, STEPS, SIZES and the profile's sizes (SEQ_LENS, MBS, MAX_TOKENS) can be
# set; PROFILE names the profile the train part plans from (default: the one the profile part
# writes; a profile of the same card and model may be reused: PARTS=train PROFILE=...). The script
# is tried on CPU first (README.md). BUNDLE, if set, names a .tar.gz rewritten
# after each part with everything in OUT: the device tool brings back at most 8 files, and a call cut
# short still brings back the parts before.
set -o pipefail
export PYTHONUNBUFFERED=1
HERE=benchmarks/gpu-next
OUT=${OUT:-out/gpu-next}
MODEL=${MODEL:-$HERE/llama-3.2-1b.json}
PARTS=${PARTS:-sync,checkpoint,profile,train,trainer,calibration}
SIZES=${SIZES:-8192:65536 32768:131072}  # longest document:tokens per global batch, one run each
STEPS=${STEPS:-4}
PROFILE=${PROFILE:-$OUT/profile.json}
mkdir -p "$OUT"
has() { [[ ",$PARTS," == *",$1,"* ]]; }
bundle() { [[ -z "$BUNDLE" ]] || { tar czf "$BUNDLE.tmp" -C "$OUT" . && mv "$BUNDLE.tmp" "$BUNDLE"; }; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if has sync; then
  python3 -m pytest -q -p no:cacheprovider tests/test_sync_free.py -k cuda -rA 2>&1 | tee "$OUT/sync-log.txt"
  bundle
fi
if has checkpoint; then
  for cold in "" --cold; do
    python3 -m dyn_plugin bench checkpoint --size-mb "${CKPT_MB:-8192}" --files 8 --dir /tmp --json $cold 2>&1 \
      | tee -a "$OUT/checkpoint.jsonl"
  done
  bundle
fi
if has profile; then
  python3 -m dyn_plugin profile --model "$MODEL" --out "$PROFILE" \
    --seq-lens "${SEQ_LENS:-512,2048,8192,32768}" --micro-batch-sizes "${MBS:-1,4,16}" \
    --max-tokens "${MAX_TOKENS:-32768}" --recompute none,selective,full --repeats 3 --validate 16 --no-progress \
    2>&1 | tee "$OUT/profile-log.txt" || { bundle; exit 1; }
  bundle
fi
if has train; then
  for size in $SIZES; do
    len=${size%%:*} name=train-${size%%:*}
    # variable shapes fragment the caching allocator; expandable segments keep the freed memory usable
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --nproc_per_node=1 \
      -m dyn_plugin.bench.train_deepspeed --profile "$PROFILE" --model "$MODEL" --out "/tmp/$name" \
      --max-len "$len" --global-tokens "${size##*:}" --steps "$STEPS" --warmup 1 \
      --modes padded,token_budget,packing,packing_varlen,dyn_plugin 2>&1 | tee "$OUT/$name-log.txt" || { bundle; exit 1; }
    for f in report.md records.jsonl summary.json step-trace.json; do cp "/tmp/$name/$f" "$OUT/$name-$f"; done
    bundle
  done
fi
if has trainer; then
  size=${SIZES%% *} name=trainer
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --nproc_per_node=1 \
    -m dyn_plugin.bench.train_hf --profile "$PROFILE" --model "$MODEL" --out "/tmp/$name" \
    --max-len "${size%%:*}" --global-tokens "${size##*:}" --steps "$STEPS" --warmup 1 2>&1 | tee "$OUT/$name-log.txt"
  for f in report.md records.jsonl summary.json; do cp "/tmp/$name/$f" "$OUT/$name-$f"; done
  bundle
fi
if has calibration; then
  size=${SIZES%% *} name=calibration
  python3 -c "
import torch
cuda = torch.cuda.is_available()  # on CPU (the script's try) a smaller load on the cores
a = torch.randn(8192 if cuda else 512, 8192 if cuda else 512, device='cuda' if cuda else 'cpu', dtype=torch.bfloat16)
while True:
    a = (a @ a).clamp_(-1, 1)
" &
  LOAD=$!
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m torch.distributed.run --nproc_per_node=1 \
    -m dyn_plugin.bench.train_deepspeed --profile "$PROFILE" --model "$MODEL" --out "/tmp/$name" \
    --max-len "${size%%:*}" --global-tokens "${size##*:}" --steps "${CAL_STEPS:-24}" --warmup 1 \
    --modes dyn_plugin,dyn_plugin_static 2>&1 | tee "$OUT/$name-log.txt"
  kill $LOAD
  for f in report.md records.jsonl summary.json prediction.png; do cp "/tmp/$name/$f" "$OUT/$name-$f"; done
  bundle
fi
