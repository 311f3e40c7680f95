"""One gloo rank asking for the run's sharding plan from a file (tests/test_sharding_search.py)."""

import os
import sys

import torch
import torch.distributed as dist

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.from_config import build_cost_model
from dyn_plugin.plan.sharding.shard_plan import ShardUnit
from dyn_plugin.runtime.sharding import shard_plan_for_run

dist.init_process_group("gloo")
plugin = DynPluginConfig.model_validate(
    {
        "cost_model": {
            "kind": "analytic",
            "dtype": "fp32",
            "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 100},
        },
        "microbatching": {"global_tokens": 512, "max_seq_len": 256},
    }
)
units = [ShardUnit(name="layers.0", params=1000, component="layer", layer=0)]
try:
    shard_plan_for_run(
        units,
        plugin,
        build_cost_model(plugin.cost_model, plugin.cluster),
        [100] * 8,
        host="fsdp2",
        device=torch.device("cpu"),
        plan=sys.argv[1],
    )
except ValueError as exc:
    print(f"rank {dist.get_rank()} raised: {exc}", flush=True)
    # gloo can abort in interpreter teardown with its group still up: tear it down, then leave at once
    dist.destroy_process_group()
    os._exit(3)
