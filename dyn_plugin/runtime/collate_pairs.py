"""Tensors of one encoder-decoder micro-batch: (input, target) pairs, each side padded on its own.

- ``input_ids`` [n, Se] and ``attention_mask`` [n, Se]: each input right-padded to the plan's
  input width. The mask keeps padding out of the encoder's self-attention and of the decoder's
  cross-attention (transformers' T5 passes it to both), so a real token's output is the one it
  would have alone.
- ``labels`` [n, Sd]: each target right-padded with -100. T5-style models build
  ``decoder_input_ids`` by shifting the labels right themselves (the decoder start token first,
  -100 read as the pad id): the decoder is causal and its padding lies after every real token, so
  no real target token attends to padding, and the loss skips it. Every target token is scored.

A plan's shape is (rows, input width, target width), from
``dyn_plugin.cost.encoder_decoder.pair_shape``, the one definition the cost model prices; the collate
checks the plan against it as ``collate.collate`` does with ``dyn_plugin.cost.model.tensor_shape``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..cost.encoder_decoder import pair_shape
from .collate import IGNORE, sample_tokens


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
    shape: Sequence[int],
    fetch: Callable[[int], Any],
    *,
    pad_id: int = 0,
) -> dict[str, torch.Tensor]:
    """Build the micro-batch; ``fetch(i)`` returns dataset item i, its two sides checked against
    the planned (input, target) lengths (longer sides are cut to them, as truncation plans)."""
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
    longest = pair_shape(*zip(*pair_lens), pad_multiple=1)
    if len(shape) != 3 or shape[0] != longest[0] or shape[1] < longest[1] or shape[2] < longest[2]:
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
