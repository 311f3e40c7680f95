"""The sharding plan a run trains with: given, configured, or searched once and shared by every rank.

Both hosts (the FSDP entry, ``deepspeed_ext`` under ZeRO-3) call ``shard_plan_for_run``. Rank 0
resolves the plan (the ``plan`` argument, else ``sharding.plan``'s file, else the search on one
global batch of the run's lengths) and broadcasts it as JSON bytes, so ranks cannot disagree on a
plan they each computed, and a search runs once rather than once per rank. Any failure on rank 0
(a budget below the smallest plan, a plan for another model, a corrupt plan file, a bug) is
broadcast too, so every rank raises it instead of waiting for a plan that never comes (under
NCCL, forever).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import numpy as np
import torch

from ..config import DynPluginConfig
from ..cost.encoder_decoder import EncoderDecoderCostModel
from ..cost.table import TableCostModel
from ..lengths.io import cap_lengths
from ..plan.sharding.search import search_sharding
from ..plan.sharding.shard_plan import ShardPlan, ShardUnit
from .sampler import global_batches

logger = logging.getLogger(__name__)


def resolve_shard_plan(
    units: Sequence[ShardUnit],
    plugin: DynPluginConfig,
    cost: TableCostModel | EncoderDecoderCostModel,
    lengths: Sequence[int] | Sequence[Sequence[int]],
    *,
    world: int,
    host: str,
    model: str = "",
    seed: int = 0,
    plan: ShardPlan | str | os.PathLike | None = None,
) -> ShardPlan:
    """The plan on this process: ``plan`` (a ShardPlan or a JSON path), else the file
    ``sharding.plan`` names, else searched for the run's first global batch. Checked against the
    model's units, the world and the cost model's precision. ``lengths``: one per sample, or an
    encoder-decoder's [N, 2] (input, target) pairs."""
    if plan is None and plugin.sharding.plan is not None:
        plan = plugin.sharding.plan
    if isinstance(plan, (str, os.PathLike)):
        path = os.fspath(plan)
        try:
            plan = ShardPlan.load(path)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # what malformed JSON fields raise
            raise ValueError(
                f"sharding plan {path} is unreadable ({type(exc).__name__}: {exc}); write it again with "
                "`dynplugin shard --out`, or unset sharding.plan to search one at start-up"
            ) from exc
    if plan is None:
        plan = search_for_run(units, plugin, cost, lengths, world=world, host=host, model=model, seed=seed)
    plan.check_units(u.name for u in units)
    plan.check_world(world)
    if plan.dtype != cost.dtype:
        raise ValueError(
            f"the sharding plan was searched in {plan.dtype} but the run trains in {cost.dtype}: search it "
            "in the precision the model trains in"
        )
    return plan


def search_for_run(
    units: Sequence[ShardUnit],
    plugin: DynPluginConfig,
    cost: TableCostModel | EncoderDecoderCostModel,
    lengths: Sequence[int] | Sequence[Sequence[int]],
    *,
    world: int,
    host: str,
    model: str = "",
    seed: int = 0,
) -> ShardPlan:
    """The plan searched for the run's first global batch of ``lengths`` (one per sample, or an
    encoder-decoder's [N, 2] pairs), capped as the loader caps them, leaving room for the longest."""
    mb = plugin.microbatching
    lengths = np.asarray(lengths)
    pairs = lengths.ndim == 2  # an encoder-decoder's (input, target) pairs, each side capped
    lengths = (
        np.stack([cap_lengths(lengths[:, side], mb.max_seq_len, mb.truncate) for side in (0, 1)], axis=1)
        if pairs
        else cap_lengths(lengths, mb.max_seq_len, mb.truncate)
    )
    ids = global_batches(lengths, mb.global_tokens, 1, seed)[0]
    return search_sharding(
        units,
        cost,
        plugin,
        world=world,
        lengths=[tuple(int(x) for x in lengths[i]) if pairs else int(lengths[i]) for i in ids],
        host=host,
        model=model,
        longest=tuple(int(x) for x in lengths.max(axis=0)) if pairs else int(lengths.max()),
    )


def shard_plan_for_run(
    units: Sequence[ShardUnit],
    plugin: DynPluginConfig,
    cost: TableCostModel | EncoderDecoderCostModel,
    lengths: Sequence[int] | Sequence[Sequence[int]],
    *,
    host: str,
    device: torch.device,
    model: str = "",
    seed: int = 0,
    plan: ShardPlan | str | os.PathLike | None = None,
) -> ShardPlan:
    """``resolve_shard_plan`` on rank 0, the same plan on every rank (see the module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return resolve_shard_plan(units, plugin, cost, lengths, world=1, host=host, model=model, seed=seed, plan=plan)
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            found = resolve_shard_plan(
                units, plugin, cost, lengths, world=dist.get_world_size(), host=host, model=model, seed=seed, plan=plan
            )
            payload = {"plan": found.to_dict()}
        except Exception as exc:  # every failure: the other ranks are already waiting in the broadcast
            failure = exc
            payload = {"error": f"rank 0 could not resolve the sharding plan: {type(exc).__name__}: {exc}"}
        data = torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)  # on the device: NCCL broadcasts device tensors only
    if dist.get_rank() != 0:
        data = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=0)
    payload = json.loads(bytes(data.cpu().numpy()).decode())
    if "error" in payload:
        raise ValueError(payload["error"]) from failure
    return ShardPlan.from_dict(payload["plan"])
