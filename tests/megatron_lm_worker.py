"""Megatron-LM's ``pretrain_gpt.py``, run unchanged as ``__main__``, observed; or its reference run.

tests/test_megatron_lm.py launches this in place of ``pretrain_gpt.py``, with ``$MEGATRON_LM_SCRIPT``
naming ``pretrain_gpt.py`` and ``$MEGATRON_LM_OUT`` the output folder. Two modes:

- **plugin** (through the plugin's launcher: ``dynplugin megatron --dyn-plugin-config CFG --
  tests/megatron_lm_worker.py ARGS``, the patches applied): ``PackedDotProductAttention`` is the
  core attention; each call's output is summarised and each rank writes ``attention-RANK.json``
  (the calls, how many were packed, how many spanned a sequence-parallel group, how many ran
  again in a backward (recompute), the most documents
  in one packed row, the smallest fraction
  of a call's tokens whose attention output is non-zero: zeros there mean attention silently
  dropped). The first stage's TP rank 0 of every data-parallel column writes the documents each
  iteration trained (``documents-RANK.jsonl``), and every rank its parameters before and after
  training (``params-RANK.pt``: global names, each TP shard with its partition dimension).
- **reference** (``$MEGATRON_LM_REFERENCE`` names a folder of a plugin run; plain torchrun, no
  plugin, only the CPU shims Megatron-LM needs on gloo): Megatron-LM's own loop on one rank trains
  the same documents, each document its own ``[1, --seq-length]`` micro-batch (right-padded, its
  loss mask on its own tokens; all-masked micro-batches fill every iteration to
  ``--global-batch-size``), from the plugin run's initial parameters; it writes ``params-0.pt``.
  Megatron-LM's per-token loss (``--calculate-per-token-loss``) makes an iteration's update the
  token mean of its documents, whatever the micro-batches: the plugin's runs must equal it.

With ``$MEGATRON_LM_GROUPINGS`` (JSON, e.g. ``[[2], [1, 1]]``) global batch s groups the
data-parallel columns into sequence-parallel groups of the sizes ``groupings[s % len]``; with
``$MEGATRON_LM_CHECKPOINTED`` = k every micro-batch recomputes the first k layers of each stage.
With ``$MEGATRON_LM_KILL_AT`` = N, every rank SIGKILLs itself once the checkpoint of iteration N
is saved (a preemption right after a checkpoint: nothing after it is flushed or closed).
"""

import json
import os
import re
import runpy
import sys

import torch

from megatron_patches.runtime import unwrap

out, script, args = os.environ["MEGATRON_LM_OUT"], os.environ["MEGATRON_LM_SCRIPT"], sys.argv[1:]
reference = os.environ.get("MEGATRON_LM_REFERENCE")
rank = int(os.environ.get("RANK", "0"))


def global_parameters(model) -> dict:
    """name -> (tensor, TP partition dim or None), decoder layers named by their global index."""
    chunk = unwrap(model)
    layers = {str(i): str(layer.layer_number - 1) for i, layer in enumerate(chunk.decoder.layers)}
    named = {}
    for name, p in chunk.named_parameters():
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{layers[m.group(1)]}.", name)
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
        named[name] = (p.detach().clone(), dim)
    return named


def observe_training():
    """Around Megatron-LM's ``train``: parameters before and after (and, for the reference, the
    plugin run's initial parameters loaded first)."""
    from megatron.core import parallel_state as ps
    from megatron.training import training

    train = training.train

    def observed(forward_step_func, model, *rest, **kwargs):
        if reference:
            initial = torch.load(os.path.join(reference, "merged-initial.pt"))
            for name, p in unwrap(model).named_parameters():
                p.data.copy_(initial[name])
        before = global_parameters(model)
        result = train(forward_step_func, model, *rest, **kwargs)
        place = {
            "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(),
        }
        torch.save({"place": place, "initial": before, "final": global_parameters(model)}, f"{out}/params-{rank}.pt")
        return result

    training.train = observed


def kill_after_checkpoint(iteration: int) -> None:
    import signal

    from megatron.training import training

    save = training.save_checkpoint

    def saved(at, *args, **kwargs):
        result = save(at, *args, **kwargs)
        if at == iteration:
            torch.distributed.barrier()  # the tracker file names this checkpoint on every rank's view
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    training.save_checkpoint = saved


def observe_plugin_run():
    """The attention's outputs and the documents each iteration trained."""
    from megatron.core import parallel_state as ps

    from dyn_plugin.models.sequence_parallel import current
    from megatron_patches.attention import PackedDotProductAttention, _bounds
    from megatron_patches.runtime import PluginRun

    stats = {"calls": 0, "packed": 0, "grouped": 0, "recomputed": 0, "most_documents": 0, "min_nonzero_fraction": 1.0}
    forward = PackedDotProductAttention.forward

    def attention(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        context = forward(self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        stats["calls"] += 1
        stats["recomputed"] += torch._C._current_graph_task_id() != -1  # run again inside a backward
        shard = current()
        if shard is not None:  # the documents of the whole rows (a trailing padding document included)
            stats["grouped"] += 1
            stats["most_documents"] = max(stats["most_documents"], int(shard.documents.max()))
        if packed_seq_params is not None:
            stats["packed"] += 1
            documents = len(_bounds(packed_seq_params.cu_seqlens_q, "cu_seqlens_q")) - 1
            stats["most_documents"] = max(stats["most_documents"], documents)
        rows = context.detach().reshape(-1, context.size(-1))
        stats["min_nonzero_fraction"] = min(
            stats["min_nonzero_fraction"], float((rows.abs().sum(-1) > 0).float().mean())
        )
        return context

    next_step = PluginRun.next_step

    def recorded(self, model):
        step = next_step(self, model)
        if ps.get_pipeline_model_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0:
            documents = []
            for m, loaded in zip(step.plan.loads, step.micro_batches):
                desc, tokens = step.plan.micro_batches[m], loaded["input_ids"]
                if desc.sp > 1:  # each column of the group holds a shard: the first records the documents
                    if desc.group == step.plan.column:
                        documents += [self.documents[i][:n].tolist() for i, n in zip(desc.sample_ids, desc.seq_lens)]
                elif desc.layout == "packed":
                    starts = [0, *torch.tensor(desc.seq_lens).cumsum(0).tolist()]
                    documents += [tokens[0, a:b].tolist() for a, b in zip(starts, starts[1:])]
                else:
                    documents += [tokens[i, :n].tolist() for i, n in enumerate(desc.seq_lens)]
            with open(f"{out}/documents-{rank}.jsonl", "a") as f:
                f.write(json.dumps({"epoch": step.epoch, "step": step.index, "documents": documents}) + "\n")
        return step

    PackedDotProductAttention.forward = attention
    PluginRun.next_step = recorded
    return stats


def force_groupings(groupings: list[list[int]]) -> None:
    """Plan global batch s with the data-parallel columns grouped as ``groupings[s % len]`` (sizes
    of sequence-parallel groups), where the planner would pick its own; every plan is still
    checked (check_plans(rendezvous=True))."""
    import functools

    from dyn_plugin.plan.methods import registry as methods
    from dyn_plugin.runtime.planning import PlanningContext

    plan, plan_step = PlanningContext.plan, methods.plan_step

    def forced(self, epoch: int, step: int):
        methods.plan_step = functools.partial(plan_step, grouping=tuple(groupings[step % len(groupings)]))
        try:
            return plan(self, epoch, step)
        finally:
            methods.plan_step = plan_step

    PlanningContext.plan = forced


def force_checkpointed(layers: int) -> None:
    """Every micro-batch recomputes the first ``layers`` layers of each stage (pyramid
    checkpointing's per-stage counts, as ``checkpointed`` in the plan), where the planner would
    choose its own."""
    from dataclasses import replace

    from dyn_plugin.plan.steps import replicas

    def forced(mbs, schedule, sim, spec):
        return tuple(replace(m, recompute="full", checkpointed=(layers,) * spec.pp) for m in mbs), sim

    replicas.fewest_checkpointed = forced


def feed_reference_documents():
    """Megatron-LM's train iterator replaced by the plugin run's documents, one per micro-batch."""
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.training import get_args, training

    build = training.build_train_valid_test_data_iterators

    def batches():
        a = get_args()
        seq, per_iteration = a.seq_length, a.global_batch_size
        with open(os.path.join(reference, "iterations.json")) as f:
            iterations = json.load(f)
        for documents in iterations:
            assert len(documents) <= per_iteration, (len(documents), per_iteration)
            for doc in documents + [[]] * (per_iteration - len(documents)):
                tokens = torch.zeros(1, seq, dtype=torch.int64)
                labels = torch.zeros(1, seq, dtype=torch.int64)
                mask = torch.zeros(1, seq)
                n = len(doc)
                tokens[0, :n] = torch.tensor(doc, dtype=torch.int64)
                labels[0, : max(n - 1, 0)] = tokens[0, 1:n]
                mask[0, : max(n - 1, 0)] = 1.0
                yield {"tokens": tokens, "labels": labels, "loss_mask": mask, "position_ids": torch.arange(seq)[None]}

    def built(provider):
        iterators = build(provider)
        return (RerunDataIterator(batches()), *iterators[1:])

    training.build_train_valid_test_data_iterators = built


if reference:
    # only what Megatron-LM needs to run on CPU ranks: the plugin's CPU shims, nothing of its plans
    import megatron_patches

    megatron_patches.apply_cpu_shims()
    feed_reference_documents()
    stats = None
else:
    stats = observe_plugin_run()
    if os.environ.get("MEGATRON_LM_GROUPINGS"):
        force_groupings(json.loads(os.environ["MEGATRON_LM_GROUPINGS"]))
    if os.environ.get("MEGATRON_LM_CHECKPOINTED"):
        force_checkpointed(int(os.environ["MEGATRON_LM_CHECKPOINTED"]))
observe_training()
if os.environ.get("MEGATRON_LM_KILL_AT"):
    kill_after_checkpoint(int(os.environ["MEGATRON_LM_KILL_AT"]))
sys.argv = [script, *args]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
finally:
    if stats is not None:
        with open(os.path.join(out, f"attention-{rank}.json"), "w") as f:
            json.dump(stats, f)
