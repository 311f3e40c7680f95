"""A sharding plan (dyn_plugin/plan/sharding/shard_plan.py) as DeepSpeed ZeRO-3 settings, and what they lose.

ZeRO-3 (0.19) decides per parameter, not per module. ``DeepSpeedZeRoOffload.mark_persistent_parameters``
walks ``named_parameters()`` and keeps a parameter whole on every rank ("persistent") when its size
is at most ``stage3_param_persistence_threshold`` and the running total of persistent elements stays
within ``stage3_model_persistence_threshold``; every other parameter is partitioned over all ranks,
gathered before use and released after it. Gradients and optimizer states are partitioned for every
parameter, persistent or not, and gradients are reduce-scattered every micro-batch. Per plan choice:

- replicate, keep, grad_op -> persistent. grad_op is honoured (same memory, one all-gather per step
  instead of one per micro-batch); keep loses its unsharded gradient accumulation (reduce-scatter per
  micro-batch); replicate loses its unsharded gradients and optimizer states.
- full -> partitioned and released after every use (``stage3_max_reuse_distance`` 0: else ZeRO-3
  keeps gathered whatever is reused within 1e9 elements: on a model below that size, everything).
- reshard(r) -> partitioned, with hpZ (``zero_hpz_partition_size`` r): after forward a copy stays
  partitioned over r ranks and backward gathers from it. hpZ is one setting for every partitioned
  parameter, so it is used only where the plan's reshard units all say the same r, and it then
  also holds full units at 1/r between forward and backward.
- split(s/k) -> ZeRO-3 cannot cut a parameter: the weight is persistent or partitioned whole.
- hybrid sharding (shard_size < world): ZeRO-3 partitions over all ranks (MiCS was removed).

So the thresholds are chosen (over every size and every cut of the persistent prefix) to put each
parameter where its unit wants it, weighted by its elements, within the plan's model-state budget;
the units ZeRO-3 then gets wrong are listed in ``Zero3Mapping.lost``.

No unit is made a ZeRO-3 leaf module (which would gather a unit's parameters in one all-gather on
entry): in 0.19.8 a leaf's post-backward release is attached through a forward pre-hook that sees
positional inputs only, and transformers calls attention blocks with keyword arguments, so with
a leaf attention block backward fails (AccumulateGrad of o_proj.weight meets a size-0 tensor on
the tiny Llama; leaf MLP blocks, called positionally, train). ZeRO-3 gathers per sub-module instead,
prefetching up to one unit's partitioned elements ahead.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from dyn_plugin.cost.model import Precision
from dyn_plugin.models.shard_units import parameter_units, unit_modules
from dyn_plugin.plan.sharding.shard_plan import MB, ShardPlan

__all__ = ["Zero3Mapping", "zero3_settings", "zero3_memory_bytes", "persistent_parameters", "merge_zero_config"]

PERSISTENCE = "stage3_param_persistence_threshold"
MODEL_PERSISTENCE = "stage3_model_persistence_threshold"
HPZ = "zero_hpz_partition_size"
UNLIMITED = sys.maxsize  # DeepSpeed's own default for the model persistence threshold


@dataclass(frozen=True)
class Zero3Mapping:
    """What ``deepspeed_ext.initialize`` applies for a plan under ZeRO-3."""

    config: dict[str, int]  # keys to merge into zero_optimization
    lost: tuple[str, ...]  # what ZeRO-3 cannot express for this plan, and the memory it really uses
    memory_bytes: float  # model states per rank these settings imply (zero3_memory_bytes)
    plan_state_bytes: float  # what the plan priced for them

    @property
    def hpz(self) -> int:
        return self.config[HPZ]


def persistent_parameters(model: torch.nn.Module, config: Mapping[str, int]) -> list[str]:
    """Names of the parameters ZeRO-3 keeps whole under ``config``'s two thresholds: DeepSpeed's
    rule (``mark_persistent_parameters``), in its order."""
    threshold, limit = config[PERSISTENCE], config[MODEL_PERSISTENCE]
    kept, total = [], 0
    for name, p in model.named_parameters():
        if p.numel() <= threshold and total + p.numel() <= limit:
            kept.append(name)
            total += p.numel()
    return kept


def zero3_memory_bytes(model: torch.nn.Module, mapping: Zero3Mapping, world: int, dtype: str) -> float:
    """Model states per rank under the mapping's settings: every parameter's share of the
    partitioned weights, gradients and optimizer states, persistent parameters whole, hpZ's
    secondary copy of the others, and the reserve: the largest unit's partitioned parameters twice
    (``stage3_max_live_parameters``: in use and prefetched) and the gradient bucket being
    reduce-scattered (``reduce_bucket_size``)."""
    b = Precision.of(dtype)
    params = dict(model.named_parameters())
    persistent = set(persistent_parameters(model, mapping.config))
    hpz = mapping.config[HPZ]
    total = sum(p.numel() for p in params.values()) * (b.param + b.grad + b.optimizer) / world
    groups: dict[str, int] = {}
    for name, unit in parameter_units(model).items():
        n = params[name].numel()
        if name in persistent:
            total += n * b.param
        else:
            total += n * b.param / hpz if hpz > 1 else 0
            groups[unit] = groups.get(unit, 0) + n
    return total + 2 * b.param * max(groups.values(), default=0) + b.grad * mapping.config["reduce_bucket_size"]


def zero3_settings(model: torch.nn.Module, plan: ShardPlan) -> Zero3Mapping:
    """The ZeRO-3 settings closest to ``plan`` on ``model`` (see the module docstring)."""
    owner = parameter_units(model)
    plan.check_units([*owner.values(), *unit_modules(model)])
    choices = plan.choices()
    b = Precision.of(plan.dtype)
    params = dict(model.named_parameters())
    names = list(owner)
    n = np.array([params[k].numel() for k in names], dtype=np.float64)
    # per parameter: the share of it that wants to be persistent, and the hpZ size its partitioned part wants
    persist_share = np.array([_persist_share(choices[owner[k]]) for k in names])
    wants_hpz = np.array([choices[owner[k]].reshard_to for k in names])
    group_names = list(dict.fromkeys(owner.values()))
    group = np.array([group_names.index(owner[k]) for k in names])  # each parameter's unit
    unit_sizes: dict[str, float] = {}
    for k, size in zip(names, n):
        unit_sizes[owner[k]] = unit_sizes.get(owner[k], 0) + size
    bucket = int(max(unit_sizes.values()))  # the largest unit's gradients are reduce-scattered together
    budget = plan.memory_budget_bytes - plan.activation_bytes  # what model states may use
    reshards = {c.reshard_to for c in choices.values() if c.kind == "reshard"}
    hpz_options = [1] + [r for r in reshards if len(reshards) == 1 and plan.world % r == 0 and r < plan.world]

    best = None
    for hpz in hpz_options:
        for threshold in [0, *np.unique(n).astype(int)]:
            eligible = np.flatnonzero(n <= threshold)  # in named_parameters order, as DeepSpeed walks them
            # j = 0..len(eligible): the first j eligible parameters persistent (model threshold = their sum)
            persisted = np.concatenate([[0.0], np.cumsum(n[eligible])])
            # mismatch (elements): persistent parameters' unwanted share, partitioned ones' wanted share,
            # and partitioned parts whose wish for hpZ differs from the setting
            hpz_wrong = wants_hpz != (hpz if hpz > 1 else 0)
            as_partitioned = n * (persist_share + (1 - persist_share) * hpz_wrong)
            as_persistent = n * (1 - persist_share)
            mismatch = as_partitioned.sum() + np.concatenate(
                [[0.0], np.cumsum(as_persistent[eligible] - as_partitioned[eligible])]
            )
            memory = n.sum() * (b.param + b.grad + b.optimizer) / plan.world + b.grad * bucket
            memory = memory + persisted * b.param + (n.sum() - persisted) * (b.param / hpz if hpz > 1 else 0)
            # the largest unit's elements still partitioned after each cut: one row per j
            step = np.zeros((len(eligible), len(group_names)))
            step[np.arange(len(eligible)), group[eligible]] = n[eligible]
            left = np.bincount(group, weights=n, minlength=len(group_names)) - np.vstack(
                [np.zeros(len(group_names)), np.cumsum(step, axis=0)]
            )
            largest = left.max(axis=1)
            memory = memory + 2 * b.param * largest
            key = np.stack([np.maximum(memory - budget, 0), mismatch, memory], axis=1)
            j = int(np.lexsort(key.T[::-1])[0])
            candidate = (tuple(key[j]), hpz, int(threshold), j, len(eligible), int(persisted[j]), int(largest[j]))
            if best is None or candidate[0] < best[0]:
                best = candidate
    _, hpz, threshold, j, eligible, persisted, largest = best
    config = {
        PERSISTENCE: threshold,
        MODEL_PERSISTENCE: persisted if j < eligible else UNLIMITED,
        "stage3_max_reuse_distance": 0,  # release partitioned parameters after every use, as "full" does
        "stage3_prefetch_bucket_size": largest,  # up to one unit ahead, as the plan's reserve holds
        "stage3_max_live_parameters": 2 * largest,  # the unit in use and the prefetched one
        "reduce_bucket_size": bucket,
        HPZ: hpz,
    }
    probe = Zero3Mapping(config, (), 0.0, plan.state_bytes)
    memory = zero3_memory_bytes(model, probe, plan.world, plan.dtype)
    return Zero3Mapping(config, _lost(model, plan, config, owner, memory), memory, plan.state_bytes)


def _persist_share(choice) -> float:
    if choice.kind in ("replicate", "keep", "grad_op"):
        return 1.0
    if choice.kind == "split":
        return (choice.slices - choice.sharded) / choice.slices  # the slices that run "keep"
    return 0.0


def _lost(model, plan: ShardPlan, config: dict[str, int], owner: dict[str, str], memory: float) -> tuple[str, ...]:
    """What the settings do not honour, one line per kind of loss (units grouped)."""
    params = dict(model.named_parameters())
    persistent = set(persistent_parameters(model, config))
    hpz = config[HPZ]
    reshards = sorted({u.choice.reshard_to for u in plan.units if u.choice.kind == "reshard"})
    if len(reshards) > 1:
        why_no_hpz = f"the plan's reshard units ask for {reshards}"
    elif reshards and (plan.world % reshards[0] or reshards[0] >= plan.world):
        why_no_hpz = f"{reshards[0]} ranks is not a proper divisor of the world, {plan.world}"
    else:
        why_no_hpz = "it would also hold the plan's full units at 1/r, which outweighs it or exceeds the budget"
    units: dict[str, list[str]] = {}
    for name, unit in owner.items():
        units.setdefault(unit, []).append(name)
    by_message: dict[str, list[str]] = {}
    for u in plan.units:
        if u.name not in units:
            continue
        kept = sum(params[k].numel() for k in units[u.name] if k in persistent)
        total = sum(params[k].numel() for k in units[u.name])
        kind = u.choice.kind
        if kind in ("replicate", "keep", "grad_op") and kept < total:
            msg = (
                f"{kind}: partitioned (gathered per use) where parameters exceed {PERSISTENCE} {config[PERSISTENCE]} "
                f"or come after {MODEL_PERSISTENCE} {config[MODEL_PERSISTENCE]} elements"
            )
        elif kind == "replicate":
            msg = (
                "replicate: ZeRO-3 partitions gradients and optimizer states (reduce-scatter per micro-batch, "
                "not one all-reduce)"
            )
        elif kind == "keep":
            msg = "keep: gradients reduce-scattered every micro-batch, not accumulated unsharded for the step"
        elif kind in ("full", "reshard") and kept:
            msg = f"{kind}: held whole on every rank (parameters at or below {PERSISTENCE} {config[PERSISTENCE]})"
        elif kind == "full" and hpz > 1:
            msg = f"full: held at 1/{hpz} between forward and backward ({HPZ} {hpz}, set for the reshard units)"
        elif kind == "reshard" and hpz != u.choice.reshard_to:
            msg = (
                f"reshard: backward gathers over all {plan.world} ranks ({HPZ} is one size for every parameter: "
                f"{why_no_hpz})"
            )
        elif kind == "split":
            msg = (
                f"split: ZeRO-3 cannot cut a parameter; the whole unit is "
                f"{'persistent' if kept == total else 'partitioned' if not kept else 'part persistent'}"
            )
        else:
            continue
        by_message.setdefault(msg, []).append(u.name or "(root)")
    lost = [f"{len(names)} unit(s) {_names(names)} -- {msg}" for msg, names in by_message.items()]
    if len(persistent) < len(params):
        lost.append(
            "partitioned units are gathered per sub-module with prefetching, not in one all-gather per unit "
            "(ZeRO-3 leaf modules break backward for attention blocks called with keyword arguments)"
        )
    if plan.shard_size < plan.world:
        lost.append(
            f"hybrid sharding over {plan.shard_size} of {plan.world} ranks: ZeRO-3 partitions model states over "
            "all ranks (MiCS was removed from DeepSpeed)"
        )
    if plan.host != "zero3":
        lost.append(
            f"the plan was priced for {plan.host!r}, whose communication differs from ZeRO-3's; search it for "
            "host 'zero3'"
        )
    lost.append(
        f"model states per rank: {memory / MB:.2f} MiB under these settings vs {plan.state_bytes / MB:.2f} MiB "
        "in the plan"
    )
    return tuple(lost)


def _names(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def merge_zero_config(ds_config: Mapping[str, Any], mapping: Zero3Mapping) -> dict[str, Any]:
    """``ds_config`` with the mapping's keys in its ``zero_optimization``. A key the user set to
    another value (under its name or DeepSpeed's alias for it) is an error: silently overriding it
    would ignore the user, and keeping it would break the plan."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = dict(ds_config.get("zero_optimization") or {})
    # DeepSpeed accepts a field by its name or its alias ("param_persistence_threshold" or "stage3_...")
    spellings = {}
    for field, info in DeepSpeedZeroConfig.model_fields.items():
        spellings[field] = spellings[info.alias or field] = {field, info.alias or field}
    for key, value in mapping.config.items():
        for spelled in spellings.get(key, {key}):
            if spelled in zero and zero[spelled] != value:
                raise ValueError(
                    f"zero_optimization.{spelled} = {zero[spelled]!r} conflicts with the sharding plan, "
                    f"which needs {value!r}; remove zero_optimization.{spelled} from the DeepSpeed config, "
                    "or set dyn_plugin.sharding.enabled to false to keep your ZeRO-3 settings"
                )
            zero.pop(spelled, None)
        zero[key] = value
    return {**ds_config, "zero_optimization": zero}
