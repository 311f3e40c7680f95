"""One rank of the FSDP exactness tests: two planned steps per case (FSDP1 policy, FSDP2 plan,
hybrid meshes), compared with the single-process token-mean reference, and one case's peak
memory measured against the plan's prediction (run as a script: OUT GROUP)."""

import copy
import json
import sys

import torch
import torch.distributed as dist

from dyn_plugin.cost.model import Precision
from dyn_plugin.fsdp import initialize, shard_plan_of, train_step
from dyn_plugin.fsdp.memory import measure, predicted_peak_bytes
from dyn_plugin.fsdp.targets import wrap_targets
from dyn_plugin.models.hf import build_causal_lm
from dyn_plugin.models.shard_units import shard_units
from dyn_plugin.plan.sharding.shard_plan import Choice, ShardPlan, UnitPlan
from token_mean import LR, MODEL, global_samples, random_dataset, reference

STEPS = 2
# (embed, attn0, mlp0, attn1, mlp1, head, root): every kind at least once per path
CASES = {
    "two": [
        ("fsdp1", 2, "full", "packed", ["replicate", "grad_op", "full", "keep", "full", "split(1/2)", "full"]),
        ("fsdp2", 2, "selective", "packed", ["keep", "replicate", "grad_op", "full", "keep", "split(1/2)", "full"]),
        ("fsdp2", 2, "none", "padded", ["full", "keep", "full", "grad_op", "replicate", "split(1/2)", "keep"]),
    ],
    "four": [
        (
            "fsdp2",
            4,
            "full",
            "packed",
            ["keep", "reshard(2)", "full", "reshard(2)", "grad_op", "split(1/2)", "replicate"],
        ),
        ("fsdp2", 2, "selective", "packed", ["replicate", "keep", "full", "grad_op", "keep", "split(1/2)", "full"]),
        ("fsdp1", 2, "none", "packed", ["replicate", "grad_op", "full", "keep", "full", "split(1/2)", "full"]),
    ],
}


def config(recompute: str, layout: str, plan: ShardPlan | None) -> dict:
    # a small device: beside the plan's model states, so little memory that the planner must cut
    # each global batch into several uneven micro-batches; without a plan, the budget it is searched for
    activations_mb = {"none": 2, "selective": 1.6, "full": 0.6}[recompute]
    memory_mb = activations_mb + plan.state_bytes / 2**20 if plan else SEARCH_BUDGET_MB
    return {
        "dyn_plugin": {
            "microbatching": {"layout": layout, "global_tokens": 1500, "max_seq_len": 256, "recompute": recompute},
            "cluster": {"device": {"memory_mb": memory_mb, "memory_fraction": 1.0}},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
        }
    }


SEARCH_BUDGET_MB = 2.3  # the memory case's plan is searched for this budget per rank


def unit_memory(params: int, choice: Choice, shard: int, prec: Precision, host: str) -> float:
    """The contract's memory per unit and choice (cost/sharding.py prices plans the same way)."""
    states = params * (prec.param + prec.grad + prec.optimizer)
    if choice.kind == "split":
        full = unit_memory(params, Choice("full"), shard, prec, host)
        keep = unit_memory(params, Choice("keep"), shard, prec, host)
        return (choice.sharded * full + (choice.slices - choice.sharded) * keep) / choice.slices
    # FSDP2's replicate (a shard group of one) holds an unsharded copy of its parameters for the step
    replicate = states + (params * prec.param if host == "fsdp2" else 0)
    return {
        "replicate": replicate,
        "keep": states / shard + params * (prec.param + prec.grad),
        "grad_op": states / shard + params * prec.param,
        "full": states / shard,
        "reshard": states / shard + params * prec.param / max(choice.reshard_to, 1),
    }[choice.kind]


def hand_plan(model, world: int, shard: int, labels: list[str], host: str) -> ShardPlan:
    """A plan with the given choices, priced by the contract's memory formulas (no search yet)."""
    prec = Precision.of("fp32")
    units = shard_units(model)
    choices = [Choice.parse(label) for label in labels]
    planned = tuple(
        UnitPlan(u.name, u.params, c, unit_memory(u.params, c, shard, prec, host), 0.0, 0.0)
        for u, c in zip(units, choices)
    )
    gathered = [u.params for u, c in zip(units, choices) if c.kind in ("full", "reshard", "split")]
    reserve = max(gathered, default=0) * (2 * prec.param + prec.grad)
    return ShardPlan("tiny-llama", world, shard, "fp32", host, 0.0, 0, 0.0, reserve, 0.0, planned)


def full_params(model, fsdp: str) -> dict[str, torch.Tensor]:
    """Every parameter whole, under the unwrapped model's names (split slices joined again)."""
    if fsdp == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            named = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    else:
        named = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    joined: dict[str, list] = {}
    for n, p in named.items():
        if ".slices." in n:
            unit, _, rest = n.partition(".slices.")
            joined.setdefault(f"{unit}.{rest.split('.', 1)[1]}", []).append(p)
        else:
            joined[n] = [p]
    return {n: torch.cat(ps) for n, ps in joined.items()}


class CollectiveCounts:
    """FSDP2's all-gathers and gradient reductions per unit, counted where its parameter groups call them."""

    def __init__(self, model, plan, world):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

        self.owner = {}
        for t in wrap_targets(model, plan, world):  # bottom-up: the root gets only what no unit owns
            for m in t.module.modules():
                self.owner.setdefault(id(m), t.name)
        self.kind = {t.name: t.choice.kind for t in wrap_targets(model, plan, world)}
        self.counts: dict[str, list[int]] = {}
        self._group = group
        self._saved = group.foreach_all_gather, group.foreach_reduce
        group.foreach_all_gather = self._counted(group.foreach_all_gather, 0)
        group.foreach_reduce = self._counted(group.foreach_reduce, 1)

    def _counted(self, fn, which):
        def counted(fsdp_params, *args, **kwargs):
            name = self.owner[id(fsdp_params[0]._module_info.module)]
            self.counts.setdefault(name, [0, 0])[which] += 1
            return fn(fsdp_params, *args, **kwargs)

        return counted

    def take(self) -> dict[str, list]:
        """(kind, all-gathers, reductions) per unit since the last take."""
        taken = {n: [self.kind[n], *c] for n, c in self.counts.items() if n}
        self.counts = {}
        return taken

    def close(self):
        self._group.foreach_all_gather, self._group.foreach_reduce = self._saved


def run_case(fsdp, shard, recompute, layout, labels, data, lengths, world, measure_memory=False) -> dict:
    torch.manual_seed(0)
    model = build_causal_lm(MODEL)
    ref = copy.deepcopy(model)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    plan = hand_plan(model, world, shard, labels, fsdp) if labels else None  # None: initialize searches one
    with measure() as mem:
        model, optimizer, loader, _ = initialize(
            model,
            config(recompute, layout, plan),
            data,
            lengths,
            shard_plan=plan,
            fsdp=fsdp,
            # AdamW where memory is measured: its two states per parameter are what the plan prices
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR) if not measure_memory else torch.optim.AdamW(ps, lr=1e-3),
            seed=3,
        )
        plan = shard_plan_of(model)  # searched where none was given
        counter = CollectiveCounts(model, plan, world) if fsdp == "fsdp2" else None
        steps, losses, sizes, collectives = [], [], [], []
        for step in loader:
            losses.append(train_step(model, optimizer, step))
            step.micro_batches.clear()  # spent: what stays alive after the step is the model's states
            steps.append(step)
            sizes.append([len(s) for s in step.sample_ids])
            if counter:
                collectives.append(counter.take())
            if len(steps) == STEPS:
                break
        at_rest = mem.live()  # after the optimizer step: sharded parameters and optimizer states
        if counter:
            counter.close()
    result = {
        "fsdp": fsdp,
        "shard": shard,
        "recompute": recompute,
        "layout": layout,
        "choices": labels,
        "micro_batch_sizes": sizes,
        "losses": losses,
        "collectives": collectives,
    }
    if measure_memory:
        predicted = predicted_peak_bytes(plan, loader.context.cost, steps)
        prec = Precision.of(plan.dtype)
        rest = sum(
            u.params * (prec.param + prec.optimizer) / (1 if u.choice.kind == "replicate" else shard)
            for u in plan.units
        )
        mine = torch.tensor([mem.peak, predicted, at_rest, rest], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        peaks = [g.tolist() for g in gathered]
        return {
            **result,
            "measured_peak": [p[0] for p in peaks],
            "predicted_peak": [p[1] for p in peaks],
            "measured_at_rest": [p[2] for p in peaks],
            "predicted_at_rest": [p[3] for p in peaks],
            "state_bytes": plan.state_bytes,
            "budget": plan.memory_budget_bytes,
            "choices": [u.choice.label for u in plan.units],
        }
    for step in steps:
        reference(ref, [data[i]["input_ids"] for i in global_samples(step, world)], LR)
    mine = full_params(model, fsdp)
    theirs = dict(ref.named_parameters())
    result["max_abs_diff"] = max(float((p - theirs[n].detach()).abs().max()) for n, p in mine.items())
    result["compared"] = sorted(mine) == sorted(theirs)
    result["moved"] = max(float((p.detach() - start[n]).abs().max()) for n, p in theirs.items())
    return result


def main():
    out, group = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    lengths, data = random_dataset(0)
    results = [run_case(*case, data, lengths, world) for case in CASES[group]]
    memory = (
        run_case("fsdp2", 2, "selective", "packed", None, data, lengths, world, measure_memory=True)
        if group == "two"
        else None
    )
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"cases": results, "memory": memory}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
