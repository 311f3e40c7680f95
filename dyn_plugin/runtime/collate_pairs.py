"""Tensors of one encoder-decoder micro-batch: (input, target) pairs, each side padded on its own.

- ``input_ids`` [n, Se] and ``attention_mask`` [n, Se]: each input right-padded to the plan's
  input width. The mask keeps padding out of the encoder's self-attention and of the decoder's
  cross-attention (transformers' T5 passes it to both), so a real token's output is the one it
  would have alone.
- ``labels`` [n, Sd]: each target right-padded with -100. T5-style models build
  ``decoder_input_ids`` by shifting the labels right themselves (the decoder start token first,
  -100 read as the pad id): the decoder is causal and its padding lies after every real token, so
  no real target token attends to padding, and the loss skips it. Every target token is scored.

Packed (layout "packed"; T5 packing per side): each row holds whole pairs,
their inputs back to back in one encoder row and their targets in one decoder row, with each token's
pair named in ``input_segments`` / ``target_segments``; ``models.seq2seq.packed_pair_forward`` runs it
exactly (per-pair masks, each target shifted right on its own).

A plan's shape is (rows, input width, target width), from
``dyn_plugin.cost.encoder_decoder.pair_shape`` (padded) or ``packed_pair_shape`` (packed: which pairs
share a row follows from the plan's order and widths), the one definition the cost model prices; the
collate checks the plan against it as ``collate.collate`` does with ``dyn_plugin.cost.model.tensor_shape``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..cost.encoder_decoder import packed_pair_rows, pair_shape
from .collate import IGNORE, sample_tokens

# A packed micro-batch (layout "packed"): the parameters of ``models.seq2seq.packed_pair_forward``.
# Its input ids are not under transformers' name (``input_ids``), so a host that hands it to the model
# itself fails instead of training each row as one pair.
PACKED_PAIR_KEYS = ("packed_input_ids", "input_segments", "labels", "target_segments")

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # each sample's (input, target) ids


def pair_tokens(item: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset item's (input ids, target ids): a dict with ``input_ids`` and ``labels`` (the
    names of transformers' tokenized seq2seq datasets), or an (input, target) pair."""
    if isinstance(item, dict):
        if "input_ids" not in item or "labels" not in item:
            raise ValueError(
                f"a seq2seq dataset item needs 'input_ids' (the input) and 'labels' (the target); got keys {sorted(item)}"
            )
        source, target = item["input_ids"], item["labels"]
    else:
        source, target = item
    return sample_tokens(source), sample_tokens(target)


def collate_pairs(
    sample_ids: Sequence[int],
    pair_lens: Sequence[Sequence[int]],
    layout: str,
    shape: Sequence[int],
    fetch: Callable[[int], Any],
    *,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Build the micro-batch in the plan's layout, as ``collate.collate`` builds one of sequences;
    ``fetch(i)`` returns dataset item i, its two sides checked against the planned (input, target)
    lengths (longer sides are cut to them, as truncation plans)."""
    pairs = _fetched(sample_ids, pair_lens, fetch)
    if len(shape) != 3:
        raise ValueError(
            f"micro-batch of samples {list(sample_ids)}: a micro-batch of pairs has the shape (rows, input width, "
            f"target width), got {tuple(shape)}; plans of pairs must take their shapes from "
            "dyn_plugin.cost.encoder_decoder.pair_shape or packed_pair_shape"
        )
    if layout == "padded":
        return _padded(pairs, sample_ids, pair_lens, shape, pad_id)
    if layout == "packed":
        return _packed(pairs, sample_ids, pair_lens, shape, pad_id)
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def _padded(
    pairs: Pairs, sample_ids: Sequence[int], pair_lens: Sequence[Sequence[int]], shape: Sequence[int], pad_id: int
) -> dict[str, torch.Tensor]:
    """A row per pair, each side right-padded to the plan's width."""
    longest = pair_shape(*zip(*pair_lens), pad_multiple=1)
    if shape[0] != longest[0] or shape[1] < longest[1] or shape[2] < longest[2]:
        raise ValueError(
            f"micro-batch of samples {list(sample_ids)} (pair lengths {[tuple(p) for p in pair_lens]}) does not fit "
            f"the plan's shape {tuple(shape)}; plans of pairs must take their shapes from "
            "dyn_plugin.cost.encoder_decoder.pair_shape"
        )
    rows, in_width, out_width = (int(x) for x in shape)
    input_ids = torch.full((rows, in_width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, in_width), dtype=torch.long)
    labels = torch.full((rows, out_width), IGNORE, dtype=torch.long)
    for r, (source, target) in enumerate(pairs):
        input_ids[r, : len(source)] = source
        attention_mask[r, : len(source)] = 1
        labels[r, : len(target)] = target
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _packed(
    pairs: Pairs, sample_ids: Sequence[int], pair_lens: Sequence[Sequence[int]], shape: Sequence[int], pad_id: int
) -> dict[str, torch.Tensor]:
    """T5 packing per side: the plan's pairs row by row as ``packed_pair_rows`` reads them from its
    order and widths, each row's inputs back to back in ``packed_input_ids`` [rows, Se] and its
    targets in ``labels`` [rows, Sd] (-100 on padding), with each token's pair (its place in the
    row; -1 on padding) in ``input_segments`` and ``target_segments``.
    ``models.seq2seq.packed_pair_forward`` turns the segments into per-pair masks and shifts each
    target right on its own."""
    rows, in_width, out_width = (int(x) for x in shape)
    placed = packed_pair_rows(*zip(*pair_lens), (in_width, out_width))
    if len(placed) != rows:
        raise ValueError(
            f"micro-batch of samples {list(sample_ids)} (pair lengths {[tuple(p) for p in pair_lens]}) fills "
            f"{len(placed)} rows of ({in_width}, {out_width}) but the plan's shape {tuple(shape)} has {rows}; plans of "
            "packed pairs must take their shapes from dyn_plugin.cost.encoder_decoder.packed_pair_shape"
        )
    input_ids = torch.full((rows, in_width), pad_id, dtype=torch.long)
    input_segments = torch.full((rows, in_width), -1, dtype=torch.long)
    labels = torch.full((rows, out_width), IGNORE, dtype=torch.long)
    target_segments = torch.full((rows, out_width), -1, dtype=torch.long)
    for r, row in enumerate(placed):
        at_in = at_out = 0
        for segment, k in enumerate(row):
            source, target = pairs[k]
            input_ids[r, at_in : at_in + len(source)] = source
            input_segments[r, at_in : at_in + len(source)] = segment
            labels[r, at_out : at_out + len(target)] = target
            target_segments[r, at_out : at_out + len(target)] = segment
            at_in, at_out = at_in + len(source), at_out + len(target)
    return dict(zip(PACKED_PAIR_KEYS, (input_ids, input_segments, labels, target_segments)))


def _fetched(sample_ids: Sequence[int], pair_lens: Sequence[Sequence[int]], fetch: Callable[[int], Any]) -> Pairs:
    """Each sample's (input, target) ids cut to its planned lengths, checked against them."""
    if not pair_lens or any(len(p) != 2 for p in pair_lens):
        raise ValueError(f"pair lengths must be (input, target) pairs, got {list(pair_lens)}")
    pairs = []
    for i, (n_in, n_out) in zip(sample_ids, pair_lens):
        source, target = pair_tokens(fetch(i))
        if len(source) < n_in or len(target) < n_out:
            raise ValueError(
                f"dataset[{i}] has {len(source)} input and {len(target)} target tokens but its lengths were given "
                f"as ({n_in}, {n_out}); pair lengths must be the token counts of the dataset's inputs and targets"
            )
        pairs.append((source[:n_in], target[:n_out]))
    return pairs
