"""One rank of ``dynplugin bench train --host megatron-lm``: Megatron-LM's ``pretrain_gpt.py``, unchanged, run as
``__main__`` and observed.

bench/train_megatron_lm.py launches this file in place of ``pretrain_gpt.py`` (which
``$BENCH_MEGATRON_LM_SCRIPT`` names), two ways:

- through the plugin's launcher (``dynplugin megatron ... -- megatron_lm_rank.py ARGS``, the patches
  applied): under Megatron-LM the plan is made inside the ranks, so each rank appends one line per
  iteration to ``$BENCH_MEGATRON_LM_OUT/steps-RANK.jsonl``: the plan's predicted step time and the
  document tokens and token slots of the micro-batches this rank trained;
- alone (plain torchrun, ``$BENCH_MEGATRON_LM_ALONE`` = ``local``): Megatron-LM's own run, only with
  what it needs on CPU gloo ranks (the plugin's CPU shims and its build of Megatron's dataset
  helpers), nothing of its plans; nothing is recorded (every sample token is a document token). With
  ``sdpa``, also the plugin's core attention (``attention.packed_thd``: torch's SDPA where it computes
  what Megatron's local attention does), so that Megatron-LM's packing runs the plugin runs' kernel.

Measured step times and losses come from Megatron-LM's own log. This module imports the Megatron
adapter (``megatron_patches``): it runs only as the ranks' script, launched by path in child
processes, never imported (tests/test_layers.py).
"""

import json
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# run by path, this file's folder leads sys.path; its modules (loader, store, ...) must not shadow top-level names
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

out, script = os.environ["BENCH_MEGATRON_LM_OUT"], os.environ["BENCH_MEGATRON_LM_SCRIPT"]
rank = int(os.environ.get("RANK", "0"))


def record_plans() -> None:
    """Each planned step's prediction and this rank's document tokens and token slots, one line per iteration."""
    from megatron_patches.runtime import PluginRun

    next_step = PluginRun.next_step

    def recorded(self, model):
        step = next_step(self, model)
        real = sum(sum(step.plan.micro_batches[m].seq_lens) for m in step.plan.loads)
        slots = sum(int(loaded["input_ids"].numel()) for loaded in step.micro_batches)
        line = {"predicted_ms": step.predicted_ms, "real_tokens": real, "token_slots": slots}
        with open(os.path.join(out, f"steps-{rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")
        return step

    PluginRun.next_step = recorded


if os.environ.get("BENCH_MEGATRON_LM_ALONE"):
    import megatron_patches

    megatron_patches.apply_cpu_shims(sdpa_attention=os.environ["BENCH_MEGATRON_LM_ALONE"] == "sdpa")
else:
    record_plans()
sys.argv = [script, *sys.argv[1:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
