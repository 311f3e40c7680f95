"""A planned micro-batch as the batch dict Megatron's forward step reads.

Keys follow megatron-core's ``GPTDataset``: ``tokens``, ``labels`` (the next token), ``loss_mask``
(1 where a label is scored) and ``position_ids``. A key that has no value is absent, never None:
Megatron-LM's ``get_batch_on_this_tp_rank`` moves every present key to the device (``.cuda()``)
and reads an absent one as None, so there is no ``attention_mask`` (causal; right padding leaves
real tokens untouched) and a stage that loads nothing has no ``tokens``, ``labels`` or
``loss_mask``. Packed micro-batches are one THD row with the document boundaries as Megatron-LM's
packed batches carry them: ``cu_seqlens`` int32 shaped ``[1, n + 1]`` (micro-batch size 1) and
``max_seqlen`` a 1-D tensor ``[longest]``; Megatron-LM's ``get_thd_batch_on_this_cp_rank`` builds
the ``PackedSeqParams`` from them, and :func:`packed_seq_params` does the same for a loop of one's own.

The plugin's collated micro-batches hold HF-style labels (unshifted, -100 where not scored, i.e.
at each document's first token and on padding); shifting them left by one gives Megatron's: the
label of position i is the token at i + 1, scored unless that token opens a document or pads. So
the loss mask scores exactly the plan's ``scored_tokens``, the denominator of the exact token mean.

Stages between the first and the last load no tokens, but still need the shapes' metadata: the
position ids and, for packed rows, the boundaries (every stage's attention needs them), rebuilt
from the plan alone.

Every tensor-parallel rank reads its own micro-batches. Megatron-LM's ``get_batch_on_this_tp_rank``
reads data on TP rank 0 only and broadcasts it into buffers the other TP ranks allocate at the
fixed ``[--micro-batch-size, --seq-length]`` (and, for packed rows, never sends them
``max_seqlen``): planned shapes vary per micro-batch, so that broadcast would fail or hang. The TP
ranks of one (stage, data-parallel column) cell share its plan and load the same documents, so
the patched function takes the planned batch from the iterator the planned schedule hands every
rank (:class:`PlannedBatches`) and returns what TP rank 0 would: the same keys, on the device,
without any broadcast. Any other iterator (evaluation, runs without planned documents) goes to
Megatron-LM's own function.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch

from dyn_plugin.plan.steps.instructions import PlannedMicroBatch
from dyn_plugin.runtime.collate import IGNORE, position_ids

from .registry import Patch

# what Megatron-LM's get_batch_on_this_tp_rank returns, in its order (pretrain_gpt's get_batch
# unpacks the values after popping the packed keys)
TP_BATCH_KEYS = (
    "tokens",
    "labels",
    "loss_mask",
    "attention_mask",
    "position_ids",
    "cu_seqlens",
    "max_seqlen",
    "local_cp_size",
)

# Lengths Megatron-LM reads as Python ints (``get_thd_batch_on_this_cp_rank``: ``max_seqlen[0].item()``):
# kept on the host, where that read is free; on the device it would sync every micro-batch.
HOST_KEYS = ("max_seqlen",)


def megatron_batch(desc: PlannedMicroBatch, loaded: dict[str, torch.Tensor] | None, shard: int = 0) -> dict[str, Any]:
    """The batch dict of the micro-batch ``desc`` (a plan's description); ``loaded``: its tensors
    from the plugin's loader, None on a stage that loads nothing; ``shard``: this rank's index in
    the micro-batch's sequence-parallel group (``desc.sp`` > 1), whose part of every row it holds
    (labels shifted before the split; packed rows as plain rows: the group's attention finds the
    documents from the positions, ``megatron_patches.sequence_parallel``)."""
    layout = desc.layout
    batch: dict[str, Any] = {}
    if loaded is not None:
        tokens = loaded["input_ids"]
        if desc.sp > 1:
            labels = loaded["shift_labels"]
        else:
            labels = torch.full_like(loaded["labels"], IGNORE)
            labels[:, :-1] = loaded["labels"][:, 1:]
        mask = labels != IGNORE
        batch.update(tokens=tokens, labels=labels.masked_fill(~mask, 0), loss_mask=mask.float())
        if loaded.get("position_ids") is not None:
            batch["position_ids"] = loaded["position_ids"]
    if "position_ids" not in batch:
        whole = position_ids(desc.seq_lens, layout, desc.shape)
        own = whole.shape[1] // desc.sp
        batch["position_ids"] = whole[:, shard * own : (shard + 1) * own]
    if layout == "packed" and desc.sp == 1:
        lens = list(desc.seq_lens)  # the row is exactly its documents (no padding document: sp is 1)
        bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]
        batch["cu_seqlens"] = torch.tensor([bounds], dtype=torch.int32)  # [1, n + 1]
        batch["max_seqlen"] = torch.tensor([max(lens)], dtype=torch.int32)
    return batch


def packed_seq_params(batch: dict[str, Any]):
    """``PackedSeqParams`` (THD) for a packed batch, None for a padded one."""
    if batch.get("cu_seqlens") is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu, m = batch["cu_seqlens"].reshape(-1), int(batch["max_seqlen"].reshape(-1)[0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)


class PlannedBatches(Iterator[dict]):
    """This rank's planned batch dicts in run order: the data iterator of a planned step (on every
    rank, whatever its TP rank; Megatron-LM gives TP ranks other than 0 none)."""

    def __init__(self, batches: Iterable[dict]) -> None:
        self._batches = iter(batches)

    def __next__(self) -> dict:
        return next(self._batches)


def device() -> torch.device:
    """Where Megatron-LM's ``.cuda()`` puts a batch: the current GPU, else (the CPU shims) the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _on_this_tp_rank(original: Callable) -> Callable:
    @functools.wraps(original)
    def get_batch_on_this_tp_rank(data_iterator, *args, **kwargs):
        if not isinstance(data_iterator, PlannedBatches):
            return original(data_iterator, *args, **kwargs)
        data, where = next(data_iterator), device()
        return {
            k: None if k not in data else data[k] if k in HOST_KEYS else data[k].to(where, non_blocking=True)
            for k in TP_BATCH_KEYS
        }

    return get_batch_on_this_tp_rank


def batch_patches() -> list[Patch]:
    """Megatron-LM's TP data path (optional: ``megatron.training`` ships with Megatron-LM only)."""
    return [
        Patch(
            "batches.tp_rank",
            "megatron.training.utils.get_batch_on_this_tp_rank",
            _on_this_tp_rank,
            optional=True,
        )
    ]
