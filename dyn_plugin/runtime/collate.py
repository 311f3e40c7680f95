"""Tensors of one micro-batch, in the layout its plan chose.

- padded: ``input_ids`` [n, S] right-padded, ``attention_mask`` [n, S], the rows' boundaries
  (``cu_seq_lens_q/k``: each row one causal document, which right padding does not disturb),
  ``labels`` with -100 on padding and on each row's first token (never scored after HF's shift, so the labels
  that are not -100 are exactly the scored ones). Right padding under a causal mask leaves
  real tokens' outputs untouched. A padded micro-batch of one row and several sequences is a
  fixed-length packed row (the ``packing_full`` baseline, Megatron's packing): the documents
  are concatenated and attend across each other, positions run on; labels are -100 at each
  document's first token, so the same tokens are scored as in every other layout.
- packed: one row ``input_ids`` [1, T], ``position_ids`` restarting at 0 per sequence (HF
  models and the plugin's varlen kernel isolate sequences by these resets), the sequence
  boundaries under the names HF's flash-attention path reads (``cu_seq_lens_q/k``,
  ``max_length_q/k``; other kernels ignore them, so the dict can go to ``model(**batch)``), and
  ``labels`` with -100 at each sequence's first token: HF shifts labels by one, so that position
  would otherwise be predicted from the previous sequence's last token.

With sequence parallelism over ``sp`` ranks the plan's width is a multiple of ``sp``: a packed
row ends in one padding document (``pad_id`` tokens, positions from 0, labels -100) and padded
rows are padded wider. :func:`shard` then gives each rank of the group its contiguous 1/sp of
every row, labels shifted first: the label of a shard's last token is the next shard's first.

``scored_tokens`` counts the labels a model actually scores (length - 1 per sequence for a causal
LM, the target length of each (input, target) pair for an encoder-decoder, whose micro-batches
``collate_pairs.py`` builds), the denominator of an exact token-mean loss.
"""

from __future__ import annotations

import itertools
import numbers
from typing import Any, Callable, Sequence

import torch

# Keys of a micro-batch a causal LM takes: packed rows' document boundaries go too (transformers
# hands cu_seq_lens_* / max_length_* on to the attention kernel), so the kernel reads nothing back
# from the device to find the documents; the ints stay on the host.
MODEL_KEYS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "labels",
    "shift_labels",
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    # a micro-batch of packed (input, target) pairs (collate_pairs.PACKED_PAIR_KEYS, with "labels")
    "packed_input_ids",
    "input_segments",
    "target_segments",
)

IGNORE = -100


def sample_tokens(item: Any) -> torch.Tensor:
    """A dataset item's token ids: a dict with ``input_ids``, or the ids themselves."""
    ids = item["input_ids"] if isinstance(item, dict) else item
    return torch.as_tensor(ids, dtype=torch.long).flatten()


def scored_tokens(seq_lens: Sequence[int] | Sequence[Sequence[int]]) -> int:
    """Tokens a micro-batch's (or a global batch's) loss scores: the exact token-mean's denominator.
    A causal LM scores length - 1 per sequence (its first token has nothing before it); an
    encoder-decoder scores every target token of each (input, target) pair (the decoder's start
    token predicts the first). The plan's lengths say which: ints, or pairs."""
    return sum(_scored(s) for s in seq_lens)


def _scored(length: int | Sequence[int]) -> int:
    if isinstance(length, numbers.Integral):
        return max(int(length) - 1, 0)
    if len(length) != 2:
        raise ValueError(f"a length is a token count or an (input, target) pair of token counts, got {length!r}")
    return int(length[1])


def position_ids(seq_lens: Sequence[int], layout: str, shape: Sequence[int]) -> torch.Tensor:
    """A micro-batch's position ids from its plan alone (no token ids): pipeline stages after the
    first rebuild them locally instead of receiving them with the activations."""
    rows, width = int(shape[0]), int(shape[1])
    if layout == "padded":
        return torch.arange(width).expand(rows, width)
    if layout == "packed":  # the padding document (sequence parallelism) restarts at 0 too
        fill = width - sum(seq_lens)
        return torch.cat([torch.arange(s) for s in seq_lens] + ([torch.arange(fill)] if fill else [])).unsqueeze(0)
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def document_offsets(seq_lens: Sequence[int], layout: str, shape: Sequence[int]) -> tuple[torch.Tensor, int]:
    """A micro-batch's document boundaries over its rows flattened (int32 ``[n + 1]``) and its
    longest document, from its plan alone, as :func:`collate` ships them: pipeline stages after the
    first hand them to the attention kernel, which would otherwise find them on the device (a read
    back per forward)."""
    rows, width = int(shape[0]), int(shape[1])
    if layout == "padded":  # each row one causal document
        return torch.arange(0, rows * width + 1, width, dtype=torch.int32), width
    if layout == "packed":
        fill = width - sum(seq_lens)
        lengths = [int(s) for s in seq_lens] + ([fill] if fill else [])
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32), max(lengths)
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def collate(
    sample_ids: Sequence[int],
    seq_lens: Sequence[int],
    layout: str,
    shape: Sequence[int],
    fetch: Callable[[int], Any],
    *,
    pad_id: int = 0,
    sp: int = 1,
) -> dict[str, Any]:
    """Build the micro-batch; ``fetch(i)`` returns dataset item i, checked against its planned length.
    ``sp``: the sequence-parallel size the plan's ``shape`` was rounded for (the whole micro-batch
    is built here; :func:`shard` splits it)."""
    seqs = []
    for i, s in zip(sample_ids, seq_lens):
        ids = sample_tokens(fetch(i))
        if len(ids) < s:
            raise ValueError(
                f"dataset[{i}] has {len(ids)} tokens but its length was given as {s}; "
                "lengths must be the token counts of the dataset's samples"
            )
        seqs.append(ids[:s])  # longer only when the config asked for truncation
    rows, width = int(shape[0]), int(shape[1])
    if layout == "padded" and rows == 1 and len(seqs) > 1:
        starts = torch.cumsum(torch.tensor([0] + [len(ids) for ids in seqs[:-1]]), 0)
        seqs = [torch.cat(seqs)]
    else:
        starts = None
    _check_shape(seqs, layout, (rows, width), sample_ids, sp)
    if layout == "padded":
        input_ids = torch.full((rows, width), pad_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        for r, ids in enumerate(seqs):
            input_ids[r, : len(ids)] = ids
            attention_mask[r, : len(ids)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE)
        labels[:, 0] = IGNORE
        if starts is not None:
            labels[0, starts] = IGNORE
        # each row one causal document to the plugin's kernel, which then finds nothing on the device
        offsets = _offsets(*document_offsets(seq_lens, layout, shape))
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels, **offsets}
    if layout == "packed":
        fill = width - sum(len(ids) for ids in seqs)
        if fill:  # a document of its own: no real token attends to it, no label scores it
            seqs.append(torch.full((fill,), pad_id, dtype=torch.long))
        input_ids = torch.cat(seqs).unsqueeze(0)
        cu, longest = document_offsets(seq_lens, layout, shape)
        labels = input_ids.clone()
        labels[0, cu[:-1].long()] = IGNORE
        if fill:
            labels[0, -fill:] = IGNORE
        return {
            "input_ids": input_ids,
            "position_ids": position_ids(seq_lens, layout, shape),
            "labels": labels,
            **_offsets(cu, longest),
        }
    raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")


def _offsets(cu: torch.Tensor, longest: int) -> dict[str, Any]:
    """The documents' boundaries under the names transformers hands on to the attention kernel;
    the longest stays a host int."""
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _check_shape(
    seqs: list[torch.Tensor], layout: str, shape: tuple[int, int], sample_ids: Sequence[int], sp: int
) -> None:
    """The tensors about to be built must have exactly the plan's ``shape``: the planner priced
    that shape and later pipeline stages size their receive buffers by it, so a mismatch is a
    wrong price at best and a failed or hung send/receive at worst."""
    lens = [len(ids) for ids in seqs]
    if layout == "packed":  # the sequences go into one row, back to back, rounded up to sp
        ok = (1, -(-sum(lens) // sp) * sp) == shape
    else:  # one row each, padded up to the plan's width (a fixed width may exceed the longest)
        ok = len(seqs) == shape[0] and max(lens) <= shape[1]
    if not ok:
        raise ValueError(
            f"micro-batch of samples {list(sample_ids)} ({layout}, sequence lengths {lens}, sp {sp}) does not fit the plan's shape "
            f"{tuple(shape)}; plans must take their shapes from dyn_plugin.cost.model.tensor_shape, as the planner does"
        )


def shard(batch: dict[str, Any], sp: int, index: int) -> dict[str, torch.Tensor]:
    """Rank ``index`` of a sequence-parallel group of ``sp``: its contiguous 1/sp of every row of a
    whole micro-batch from :func:`collate`.

    Labels are shifted before the split (``shift_labels[t]`` = ``labels[t + 1]``, -100 after each
    document's last token and on padding), since a shard's last token is scored against the next
    shard's first. ``position_ids`` are explicit for padded rows too, so each shard's rotary
    embeddings see its true positions; ``sequence_position_ids`` keeps the whole micro-batch's,
    from which the sequence-parallel attention finds every document. No ``attention_mask``: rows
    are causal and right-padded, documents are found from position resets."""
    input_ids, labels = batch["input_ids"], batch["labels"]
    rows, width = input_ids.shape
    if width % sp or not 0 <= index < sp:
        raise ValueError(
            f"cannot give shard {index} of {sp} of a micro-batch {width} tokens wide: plans round the "
            "width up to a multiple of the group size (dyn_plugin.cost.model.tensor_shape)"
        )
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(width).expand(rows, width)
    shifted = torch.cat([labels[:, 1:], labels.new_full((rows, 1), IGNORE)], dim=1)
    cols = slice(index * (width // sp), (index + 1) * (width // sp))
    return {
        "input_ids": input_ids[:, cols].contiguous(),
        "position_ids": positions[:, cols].contiguous(),
        "shift_labels": shifted[:, cols].contiguous(),
        "sequence_position_ids": positions,
    }
