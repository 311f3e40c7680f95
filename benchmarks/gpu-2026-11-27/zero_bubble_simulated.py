import json, numpy as np
from dataclasses import replace
from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.profile import cost_model_from_profile, load_profile
from dyn_plugin.lengths.io import load_lengths
from dyn_plugin.plan.methods.planner import plan_step
from dyn_plugin.plan.steps.bounds import ideal_ms, critical_path_ms
from dyn_plugin.plan.steps.spec import planner_spec
from dyn_plugin.plan.steps.token_slices import sliced_step_ms
from dyn_plugin.runtime.sampler import global_batches
import collections
cost = cost_model_from_profile(load_profile("benchmarks/gpu-2026-11-27/profile-h200-bf16-32k.json"))
print("layers", cost.num_layers, "dtype", cost.dtype, "has weight_ms", "weight_ms" in cost.table("packed","none",1).fits["layer"])
out = []
for maxlen, tokens in ((8192, 65536), (32768, 262144)):
    lengths = np.minimum(load_lengths("code"), maxlen)
    batches = [[int(lengths[i]) for i in b] for b in global_batches(lengths, tokens, 20, 0)]
    for pp, dp in ((4, 2), (2, 4)):
        cfg = DynPluginConfig.model_validate({"pipeline": {"stages": pp}, "microbatching": {"max_seq_len": maxlen}, "cluster": {"devices_per_node": 8, "device": {"memory_mb": 139000, "memory_fraction": 0.9}}, "sequence_parallel": {"pyramid": True}})
        spec = planner_spec(cost, cfg, dp=dp, zero_stage=1, seed=0)
        split = replace(spec, schedule="zero_bubble")
        rows = {}
        for name, sp in (("auto", spec), ("zero_bubble", split)):
            plans = [plan_step(b, sp, native=True) for b in batches]
            it = [p.iteration_ms for p in plans]
            ideal = [ideal_ms(b, sp) for b in batches]
            rows[name] = dict(ms=float(np.mean(it)), vs_ideal=float(np.mean([i/d for i, d in zip(it, ideal)])), bubble=float(np.mean([p.bubble_fraction for p in plans])), schedules=dict(collections.Counter(r.schedule.name for p in plans for r in p.replicas)))
            if name == "zero_bubble":
                sl = [sliced_step_ms(p, sp)[0] for p in plans]
                rows["token_slices_what_if"] = dict(ms=float(np.mean(sl)), vs_ideal=float(np.mean([s/d for s, d in zip(sl, ideal)])))
        rec = dict(max_len=maxlen, global_tokens=tokens, pp=pp, dp=dp, **rows, speedup=rows["auto"]["ms"]/rows["zero_bubble"]["ms"])
        print(json.dumps(rec)); out.append(rec)
open("benchmarks/gpu-2026-11-27/zero-bubble-h200-simulated.jsonl","w").write("".join(json.dumps(r)+"\n" for r in out))
