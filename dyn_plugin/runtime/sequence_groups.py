"""What the ranks of a sequence-parallel group share: a process group and a random stream.

Groups: a plan groups the data-parallel columns of the pp x dp grid into aligned power-of-two
blocks (columns first .. first+k-1, first % k == 0), at every pipeline stage (global rank =
stage * columns + column, DeepSpeed's stage-major layout). Process groups are built once at
start-up for every block a plan may use: ``new_group`` is collective over the whole world, so every
rank must create every group, in the same order, even those it is not a member of; switching a
micro-batch's sequence-parallel size is then a look-up. Column counts that are not a power of two
simply lack the blocks that do not fit (3 columns: only the pair {0, 1}).

Random state: every rank of a group must draw the same dropout masks for a micro-batch, and a
resumed run the same ones again, so the micro-batch runs under a generator seeded from its place
in training (``group_seed``), not from each rank's running stream.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from ..layout import RankLayout


class SequenceGroups:
    """One process group per (stage, aligned block of ``size`` columns) for each size in ``sizes``.

    Sizes below 2 need no group and sizes above ``columns`` cannot occur; both are skipped.
    ``backend`` goes to ``dist.new_group`` (None: the default group's, e.g. NCCL for device tensors).
    """

    def __init__(self, columns: int, stages: int, sizes: Iterable[int], backend: str | None = None) -> None:
        if columns < 1 or stages < 1:
            raise ValueError(
                f"SequenceGroups needs columns >= 1 and stages >= 1, got columns={columns}, stages={stages}"
            )
        world = dist.get_world_size()
        if columns * stages != world:
            raise ValueError(
                f"SequenceGroups: columns x stages = {columns} x {stages} = {columns * stages} but the "
                f"world has {world} ranks"
            )
        layout = RankLayout.of(columns, stages)
        sizes = sorted(set(sizes))
        bad = [k for k in sizes if k < 1 or k & (k - 1)]
        if bad:
            raise ValueError(f"sequence_parallel.sizes must be powers of two, got {bad}")
        self.columns, self.stages = columns, stages
        self.sizes = tuple(k for k in sizes if 2 <= k <= columns)
        # the same order on every rank: sizes ascending, then stages, then blocks
        self._groups: dict[tuple[int, int, int], dist.ProcessGroup] = {}
        for k in self.sizes:
            for stage in range(stages):
                for first in range(0, columns - k + 1, k):
                    self._groups[(stage, first, k)] = dist.new_group(
                        layout.stage_ranks(stage, first, k), backend=backend
                    )

    def blocks(self) -> list[tuple[int, int, int]]:
        """Every (stage, first column, size) that has a group."""
        return list(self._groups)

    def group(self, stage: int, first: int, size: int) -> dist.ProcessGroup:
        """The group of columns first .. first+size-1 at ``stage``."""
        try:
            return self._groups[(stage, first, size)]
        except KeyError:
            raise ValueError(
                f"no sequence-parallel group of size {size} at column {first}, stage {stage}: groups are aligned "
                f"power-of-two blocks of {self.columns} columns (first % size == 0, first + size <= columns) on "
                f"{self.stages} stages, for sizes {list(self.sizes)} (sequence_parallel.sizes)"
            ) from None


def group_seed(seed: int, epoch: int, step: int, micro_batch: int, group_first: int, stage: int = 0) -> int:
    """A seed for one micro-batch of one group at one pipeline stage, the same on each of its ranks
    and in a resumed run. Hashed, so neighbouring micro-batches get unrelated streams; the stage is
    part of it, so the layers of different stages do not draw the same dropout masks."""
    key = (seed, epoch, step, micro_batch, group_first, stage)
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2**64; keep it positive in int64 too


@contextlib.contextmanager
def group_rng(seed: int, device: torch.device | str | None = None) -> Iterator[None]:
    """Run the block on a CPU generator (and ``device``'s, for an accelerator) seeded with
    ``seed``; the previous random state comes back afterwards, so the rest of training draws as
    if the block had not run."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    accel = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accel else [], device_type=device.type if accel else "cuda"):
        torch.default_generator.manual_seed(seed)
        if accel:
            module = torch.get_device_module(device.type)
            with module.device(device):
                module.manual_seed(seed)  # the current device's generator only
        yield
