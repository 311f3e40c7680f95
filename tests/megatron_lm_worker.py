"""Megatron-LM's ``pretrain_gpt.py``, run unchanged as ``__main__``, with the core attention observed.

tests/test_megatron_lm.py launches this through the plugin's launcher in place of ``pretrain_gpt.py``
(``dynplugin megatron --dyn-plugin-config CFG -- tests/megatron_lm_worker.py ARGS``, with
``$MEGATRON_LM_SCRIPT`` naming ``pretrain_gpt.py`` and ``$MEGATRON_LM_OUT`` the output folder; the
arguments all go to the script, the launcher's ``--dyn-plugin-config`` among them):
the launcher has applied the patches, so ``PackedDotProductAttention`` is the core attention; each
call's output is summarised, and each rank writes ``OUT/attention-RANK.json`` when training ends:
the calls, how many were packed, the most documents in one packed row, and the smallest fraction
of a call's tokens whose attention output is non-zero (zeros there: attention silently dropped).
"""

import json
import os
import runpy
import sys

from megatron_patches.attention import PackedDotProductAttention, _bounds

out, script, args = os.environ["MEGATRON_LM_OUT"], os.environ["MEGATRON_LM_SCRIPT"], sys.argv[1:]
stats = {"calls": 0, "packed": 0, "most_documents": 0, "min_nonzero_fraction": 1.0}
forward = PackedDotProductAttention.forward


def observed(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
    context = forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
    stats["calls"] += 1
    if packed_seq_params is not None:
        stats["packed"] += 1
        docs = len(_bounds(packed_seq_params.cu_seqlens_q, "cu_seqlens_q")) - 1
        stats["most_documents"] = max(stats["most_documents"], docs)
    rows = context.detach().reshape(-1, context.size(-1))
    nonzero = float((rows.abs().sum(-1) > 0).float().mean())
    stats["min_nonzero_fraction"] = min(stats["min_nonzero_fraction"], nonzero)
    return context


PackedDotProductAttention.forward = observed
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    with open(os.path.join(out, f"attention-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump(stats, f)
