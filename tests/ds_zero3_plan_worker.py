"""One rank of the ZeRO-3 sharding-plan test: a hand-made plan mixing kept and fully sharded units,
applied by deepspeed_ext.initialize, trains one planned step of uneven micro-batches; compared with
the single-process token-mean reference, with each parameter's ZeRO-3 state recorded (run as a script)."""

import copy
import sys

import torch
import torch.distributed as dist

import deepspeed_ext
from ds_exact_worker import LR, MODEL, random_dataset, reference

deepspeed_ext.skip_cpu_shm_build()

import deepspeed  # noqa: E402
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # noqa: E402

from deepspeed_ext.zero3 import zero3_memory_bytes, zero3_settings  # noqa: E402
from dyn_plugin.host.recompute import recompute_switch  # noqa: E402
from dyn_plugin.models.hf import build_causal_lm  # noqa: E402
from dyn_plugin.models.shard_units import parameter_units, shard_units  # noqa: E402
from dyn_plugin.plan.sharding.shard_plan import Choice, ShardPlan, UnitPlan  # noqa: E402
from ranks import finish  # noqa: E402

# unit -> choice; every other unit "full". Case "attention": the threshold alone separates them (attention
# weights <= 1024 elements, MLP and embeddings above). Case "layer0": the MLP weights of both layers are the
# same size, so only the model threshold (a cap on the persistent prefix) keeps layer 0 and not layer 1.
CASES = {
    "attention": {"model.layers.0.self_attn": "keep", "model.layers.1.self_attn": "grad_op", "": "replicate"},
    "layer0": {"model.layers.0.self_attn": "keep", "model.layers.0.mlp": "grad_op"},
}
KEPT = ("replicate", "keep", "grad_op")


def hand_plan(model, choices: dict[str, str], world: int, **fields) -> ShardPlan:
    """A plan with the given choices ("full" elsewhere); costs are not priced (the search does that),
    the budget is ample unless ``fields`` say otherwise."""
    units = tuple(
        UnitPlan(u.name, u.params, Choice.parse(choices.get(u.name, "full")), 0.0, 0.0, 0.0) for u in shard_units(model)
    )
    plan = dict(
        model="tiny-llama",
        world=world,
        shard_size=world,
        dtype="fp32",
        host="zero3",
        memory_budget_bytes=1 << 30,
        micro_batches=3,
        activation_bytes=0.0,
        gather_reserve_bytes=0.0,
        compute_ms=1.0,
        units=units,
    )
    return ShardPlan(**{**plan, **fields})


def param_states(model) -> dict[str, list]:
    """name -> [persistent, gathered, elements held whole] as ZeRO-3 left them."""
    return {
        n: [bool(p.ds_persist), p.ds_status == ZeroParamStatus.AVAILABLE, p.data.numel()]
        for n, p in model.named_parameters()
    }


def run_case(name: str, data, lengths, world: int, plan_dir: str, recompute: str) -> dict:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    ref = copy.deepcopy(model)
    plan = hand_plan(model, CASES[name], world) if name in CASES else None
    sharding = {"enabled": True}
    kwargs = {"shard_plan": plan}
    if name == "searched":  # no plan: initialize searches one with ZeRO-3's semantics
        kwargs = {}
    if name == "layer0":  # the plan from its JSON file, as `dynplugin shard` writes it
        path = f"{plan_dir}/plan-{name}.json"
        if dist.get_rank() == 0:
            plan.save(path)
        dist.barrier()
        sharding, kwargs = {"enabled": True, "plan": path}, {}
    config = {
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"layout": "packed", "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
            "cluster": {"device": {"memory_mb": 2, "memory_fraction": 1.0}},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
            "sharding": sharding,
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=model,
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        seed=3,
        **kwargs,
    )
    plan = deepspeed_ext.shard_plan_of(engine)
    owner = parameter_units(model)
    wanted = sorted(n for n, u in owner.items() if plan.choices()[u].kind in KEPT)
    before = param_states(engine.module)
    step = next(iter(loader))
    deepspeed_ext.train_step(engine, step)
    after = param_states(engine.module)
    mine = torch.tensor([i for mb in step.sample_ids for i in mb] + [-1] * (64 - sum(map(len, step.sample_ids))))
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    ids = sorted(int(i) for g in gathered for i in g if i >= 0)
    reference(ref, [data[i]["input_ids"] for i in ids], LR)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(params, ref.parameters()))
    zero = engine._config.zero_config
    result = {
        "case": name,
        "max_abs_diff": diff,
        "micro_batch_sizes": [len(s) for s in step.sample_ids],
        "wanted_persistent": wanted,
        "before": before,
        "after": after,
        "numel": {n: p.ds_numel for n, p in engine.module.named_parameters()},
        "thresholds": [zero.param_persistence_threshold, zero.model_persistence_threshold],
        "reuse_distance": zero.max_reuse_distance,
        "recompute": recompute,
        "recompute_ran": recompute_switch(engine.module).mode,
        "host": plan.host,
        "planned_state_bytes": loader.context.state_bytes,
        # ref: whole weights; the mapping's states plus the room the plan keeps clear beside its own
        "mapped_state_bytes": zero3_memory_bytes(ref, zero3_settings(ref, plan), world, "fp32")
        + plan.planning_state_bytes
        - plan.state_bytes,
    }
    engine.destroy()
    return result


def main():
    out, plan_dir = sys.argv[1], sys.argv[2]
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(0)
    results = [
        run_case("attention", data, lengths, world, plan_dir, "selective"),
        run_case("layer0", data, lengths, world, plan_dir, "none"),
        run_case("searched", data, lengths, world, plan_dir, "none"),
    ]
    finish(results, out)


if __name__ == "__main__":
    main()
