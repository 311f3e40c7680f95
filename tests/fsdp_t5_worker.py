"""One rank of the FSDP encoder-decoder exactness test: a tiny random T5 trained on (input, target)
pairs through ``dyn_plugin.fsdp.initialize`` (the loader planning each global batch with the pair
planner under the sharding plan's model states) and ``train_step``, every step's parameters
compared with the unmodified model trained in one process on the whole global batch with the
token-mean loss (run as a script: OUT CHECKPOINT_DIR).

Cases: FSDP2 and FSDP1 with hand-made plans giving T5's sublayer units every kind the host runs
(the root, which owns the embedding tied to the head, among them), T5 v1.1's feed-forward, and a
plan searched by ``initialize`` over T5's units; the first case saves a checkpoint after its first
step, from which a fresh model (other initial weights) and loader finish the epoch. The A100 T5 11B tables price the plans (their
precision set to the run's): prices do not change the gradients."""

import copy
import dataclasses
import sys

import numpy as np
import torch
import torch.distributed as dist

from dyn_plugin.cost.bundled import DIR
from dyn_plugin.cost.encoder_decoder import import_t5_tables
from dyn_plugin.fsdp import initialize, load_checkpoint, save_checkpoint, shard_plan_of, train_step
from dyn_plugin.models.hf import PRESETS, build_seq2seq_lm
from dyn_plugin.models.shard_units import shard_units
from fsdp_worker import CollectiveCounts, full_params, hand_plan
from ranks import finish
from token_mean import LR, global_samples, reference

T5 = dict(PRESETS["tiny-t5"], d_model=32, d_kv=8, d_ff=64, vocab_size=97)
# T5 v1.1: gated-GELU, logits not rescaled (transformers 5 ties T5's head to its embedding always);
# it starts at a loss of ~19, so it steps at a tenth of the rate (as tests/ds_t5_worker.py)
VARIANTS = {"t5": (T5, LR), "t5-v1.1": (dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False), LR / 10)}
# per unit in shard_units order: encoder blocks' (self-attention, feed-forward), decoder blocks'
# (self-attention, cross-attention, feed-forward), then the root
MIXED = {
    "fsdp2": ["full", "keep", "grad_op", "replicate", "keep", "full", "grad_op", "replicate", "full", "keep", "full"],
    "fsdp1": ["replicate", "full", "grad_op", "keep", "full", "grad_op", "replicate", "full", "keep", "full", "keep"],
}
CASES = [("fsdp2", "t5", "mixed"), ("fsdp2", "t5-v1.1", "mixed"), ("fsdp1", "t5", "mixed"), ("fsdp2", "t5", "search")]


def pairs_and_data(seed: int, count: int) -> tuple[np.ndarray, list[dict]]:
    """Pairs long and varied enough for the planner to cut each rank's share into several micro-batches."""
    rng = np.random.default_rng(seed)
    pairs = np.stack([rng.integers(8, 400, count), rng.integers(4, 200, count)], axis=1)
    return pairs, [{"input_ids": rng.integers(2, 97, size=a), "labels": rng.integers(2, 97, size=b)} for a, b in pairs]


def config(pairs: np.ndarray) -> dict:
    # 12 GB per rank for activations as the T5 11B tables price them: several micro-batches a step
    return {
        "dyn_plugin": {
            "microbatching": {"global_tokens": int(pairs.sum()) // 2 + 50, "max_seq_len": 512},
            "cluster": {"device": {"memory_mb": 12000, "memory_fraction": 1.0}},
        }
    }


def sharded(fsdp: str, variant: str, how: str, pairs, data, cost, world: int, init_seed: int = 0, plan=None):
    """(model as built, then sharded; optimizer; loader; plan) of one case."""
    torch.manual_seed(init_seed)
    model_config, lr = VARIANTS[variant]
    model = build_seq2seq_lm(model_config)
    ref = copy.deepcopy(model)
    if plan is None and how == "mixed":
        plan = hand_plan(model, world, world, MIXED[fsdp], fsdp)
    return (
        ref,
        *initialize(
            model,
            config(pairs),
            data,
            pairs,
            shard_plan=plan,  # None: searched
            fsdp=fsdp,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=lr),
            cost_model=cost,
            seed=3,
        ),
    )


def run_case(fsdp: str, variant: str, how: str, pairs, data, cost, world: int, resume_dir: str | None = None) -> dict:
    lr = VARIANTS[variant][1]
    ref, model, optimizer, loader, _ = sharded(fsdp, variant, how, pairs, data, cost, world)
    plan = shard_plan_of(model)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    counter = CollectiveCounts(model, plan, world) if fsdp == "fsdp2" else None
    diffs, losses, sizes, recompute, trained, collectives = [], [], [], [], [], []
    for step in loader:
        loss = train_step(model, optimizer, step)
        ids = global_samples(step, world)
        trained.append(ids)
        samples = [(data[i]["input_ids"], data[i]["labels"]) for i in ids]
        reference(ref, samples, lr)
        mine = full_params(model, fsdp)
        theirs = dict(ref.named_parameters())
        assert sorted(mine) == sorted(theirs), (sorted(mine), sorted(theirs))
        diffs.append(max(float((p - theirs[n].detach()).abs().max()) for n, p in mine.items()))
        losses.append(loss)
        sizes.append([len(s) for s in step.sample_ids])
        recompute.append([d.recompute for d in step.loaded])
        if counter:
            collectives.append(counter.take())
        if resume_dir is not None and step.index == 0:
            save_checkpoint(model, optimizer, loader, resume_dir)
    if counter:
        counter.close()
    resumed = None
    if resume_dir is not None:
        _, fresh, fresh_opt, again, _ = sharded(fsdp, variant, how, pairs, data, cost, world, init_seed=1, plan=plan)
        load_checkpoint(fresh, fresh_opt, again, resume_dir)
        rest = []
        for step in again:
            train_step(fresh, fresh_opt, step)
            rest.append(global_samples(step, world))
        ended, theirs = full_params(fresh, fsdp), full_params(model, fsdp)
        resumed = {"diff": max(float((p - theirs[n]).abs().max()) for n, p in ended.items()), "trained": rest}
    tied = model.module if fsdp == "fsdp1" else model
    return {
        "fsdp": fsdp,
        "variant": variant,
        "how": how,
        "choices": [u.choice.label for u in plan.units],
        "units": [u.name for u in plan.units],
        "max_abs_diff": diffs,
        "moved": max(float((p.detach() - start[n]).abs().max()) for n, p in ref.named_parameters()),
        "losses": losses,
        "micro_batch_sizes": sizes,
        "recompute": recompute,
        "trained": trained,
        "collectives": collectives,
        "tied": tied.lm_head.weight is tied.shared.weight,
        "planning_state_bytes": plan.planning_state_bytes,
        "planned_states": loader.context.spec.memory[0].states,  # what the pair planner was told
        "resumed": resumed,
    }


def main():
    out = sys.argv[1]
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cost = dataclasses.replace(import_t5_tables(DIR / "measured" / "a100-t5-11b.json"), dtype="fp32")
    pairs, data = pairs_and_data(0, 24)
    units = [u.name for u in shard_units(build_seq2seq_lm(T5))]
    results = [
        run_case(*case, pairs, data, cost, world, sys.argv[2] if k == 0 else None) for k, case in enumerate(CASES)
    ]
    finish({"cases": results, "samples": len(pairs), "units": units}, out)


if __name__ == "__main__":
    main()
