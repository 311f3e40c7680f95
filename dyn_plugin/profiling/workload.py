"""The micro-batches a profile measures, and one timed step of them.

The profiler (profiler.py) and the shadow ranks that load the host beside it (shadow.py) run
the same workload, so it lives here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..cost.model import LAYOUTS, RECOMPUTES, Layout, round_up
from .device import measures


@dataclass(frozen=True)
class ProfileGrid:
    seq_lens: tuple[int, ...] = (16, 64, 256, 1024)
    micro_batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 1024
    layouts: tuple[str, ...] = LAYOUTS
    recomputes: tuple[str, ...] = RECOMPUTES
    depths: tuple[int, int] = (1, 3)
    warmup: int = 1
    repeats: int = 5
    seed: int = 0

    def points(self) -> list[tuple[int, int]]:
        return [(s, n) for s in self.seq_lens for n in self.micro_batch_sizes if s * n <= self.max_tokens]

    def pair_points(self) -> list[tuple[int, int, int]]:
        """An encoder-decoder's grid: (input length, target length, pairs), both sides over
        ``seq_lens``, no side above ``max_tokens`` (the A100 T5 tables' grid, keyed the same way)."""
        return [
            (se, sd, n)
            for se in self.seq_lens
            for sd in self.seq_lens
            for n in self.micro_batch_sizes
            if n * max(se, sd) <= self.max_tokens
        ]


def micro_batch_lengths(layout: Layout, seq_len: int, n: int, rng: np.random.Generator) -> list[int]:
    """The sequences of one profiled micro-batch of n*seq_len tokens.

    Padded: n rows of seq_len. Packed: one document of seq_len (so the measured range reaches
    it), the other (n-1)*seq_len tokens cut into documents of random lengths up to seq_len, so
    that tokens and attention pairs vary independently and the fit can tell them apart.
    """
    if layout == "padded":
        return [seq_len] * n
    lens, left = [seq_len], (n - 1) * seq_len
    while left > 0:
        lens.append(min(left, int(rng.integers(max(1, seq_len // 8), seq_len + 1))))
        left -= lens[-1]
    return lens


@dataclass(frozen=True)
class Inputs:
    """One micro-batch's model inputs, as the plugin's collator lays them out and the step passes
    them: packed rows carry their documents' boundaries and longest length (a host int), so the
    attention measured is the call training makes, with no read back from the device."""

    ids: Any
    labels: Any
    pos: Any = None
    cu: Any = None  # packed: int32 document boundaries [n + 1]
    longest: int | None = None
    mask: Any = None  # (input, target) pairs: the inputs' attention mask [n, Se]; labels are the targets

    def to(self, device) -> "Inputs":
        moved = {k: getattr(self, k) for k in ("ids", "labels", "pos", "cu", "mask")}
        return replace(self, **{k: None if v is None else v.to(device) for k, v in moved.items()})

    def kwargs(self) -> dict[str, Any]:
        if self.mask is not None:  # an encoder-decoder shifts the labels into its decoder's inputs itself
            return {"input_ids": self.ids, "attention_mask": self.mask, "labels": self.labels}
        out = {"input_ids": self.ids, "position_ids": self.pos, "labels": self.labels}
        if self.cu is not None:
            out.update(
                cu_seq_lens_q=self.cu, cu_seq_lens_k=self.cu, max_length_q=self.longest, max_length_k=self.longest
            )
        return out


def make_inputs(seq_lens: list[int], layout: Layout, vocab: int, pad_multiple: int, rng: np.random.Generator) -> Inputs:
    """One micro-batch of random tokens in ``layout``."""
    import torch

    if layout == "padded":
        width = round_up(max(seq_lens), pad_multiple)
        ids = torch.from_numpy(rng.integers(0, vocab, size=(len(seq_lens), width)))
        labels = ids.clone()
        for i, s in enumerate(seq_lens):
            labels[i, s:] = -100
        return Inputs(ids, labels)
    total = sum(seq_lens)
    ids = torch.from_numpy(rng.integers(0, vocab, size=(1, total)))
    pos = torch.cat([torch.arange(s) for s in seq_lens]).unsqueeze(0)
    labels = ids.clone()
    starts = np.cumsum([0] + seq_lens[:-1])
    labels[0, starts] = -100  # no prediction across a document boundary
    cu = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32)
    return Inputs(ids, labels, pos, cu, max(seq_lens))


def make_pair_inputs(
    inputs: list[int], targets: list[int], vocab: int, pad_multiple: int, rng: np.random.Generator
) -> Inputs:
    """One encoder-decoder micro-batch of random tokens, each side right-padded to its longest
    (rounded up to ``pad_multiple``) as the runtime's ``collate_pairs`` lays pairs out: padded
    inputs masked, padded targets -100."""
    import torch

    n, se, sd = len(inputs), round_up(max(inputs), pad_multiple), round_up(max(targets), pad_multiple)
    ids = torch.from_numpy(rng.integers(2, vocab, size=(n, se)))
    labels = torch.from_numpy(rng.integers(2, vocab, size=(n, sd)))
    mask = torch.zeros((n, se), dtype=torch.long)
    for i, (a, b) in enumerate(zip(inputs, targets)):
        ids[i, a:] = 0
        mask[i, :a] = 1
        labels[i, b:] = -100
    return Inputs(ids, labels, mask=mask)


def loss_closure(model, inputs: Inputs):
    return lambda: model(**inputs.kwargs(), use_cache=False).loss


def backward(loss) -> None:
    loss.backward()


def timed_step(model, inputs: Inputs) -> tuple[float, float]:
    """(forward, backward) ms, timed as the inputs' device needs (device.py)."""
    clock, _ = measures(inputs.ids.device.type)
    return clock(loss_closure(model, inputs), backward)
