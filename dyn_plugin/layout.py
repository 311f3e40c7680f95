"""How the ranks of a run are laid out: pipeline stages x data-parallel columns x tensor-parallel
replicas, every degree named once.

Plans, their point-to-point peers, the sequence-parallel groups and the loader all number ranks
stage-major, tensor-parallel ranks innermost, as DeepSpeed's ``PipeDataParallelTopology`` and
Megatron's default order (tp, then dp, then pp) do: global rank = (stage * columns + column) * tp +
replica. A column is one data-parallel slice of the pipeline (every stage of it); a
sequence-parallel group is a block of neighbouring columns at one stage; the ``tp`` replicas of a
(stage, column) cell are its tensor-parallel ranks, which share the cell's plan. Pure Python: the
planners use it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import DynPluginConfig


@dataclass(frozen=True)
class RankLayout:
    """``world`` ranks as ``stages`` pipeline stages of ``columns`` data-parallel columns, each
    (stage, column) cell ``tp`` tensor-parallel ranks."""

    world: int
    stages: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"a rank layout needs at least one rank, got world = {self.world}")
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(
                f"a tensor-parallel size of {self.tp} does not divide the {self.world} ranks; "
                f"launch a multiple of {self.tp} ranks or change the tensor-parallel size"
            )
        if self.stages < 1 or (self.world // self.tp) % self.stages:
            ranks = (
                f"{self.world} ranks"
                if self.tp == 1
                else f"{self.world // self.tp} cells ({self.world} ranks, tp {self.tp})"
            )
            raise ValueError(
                f"dyn_plugin.pipeline.stages = {self.stages} does not divide the {ranks}; launch a multiple of "
                f"{self.stages * self.tp} ranks or change pipeline.stages"
            )

    @classmethod
    def of(cls, columns: int, stages: int = 1, tp: int = 1) -> RankLayout:
        """The layout of ``columns`` data-parallel columns on ``stages`` stages, ``tp`` ranks a cell."""
        if columns < 1:
            raise ValueError(f"a rank layout needs at least one data-parallel column, got {columns}")
        return cls(world=columns * stages * tp, stages=stages, tp=tp)

    @classmethod
    def from_config(cls, world: int, config: DynPluginConfig, tp: int = 1) -> RankLayout:
        """``world`` ranks laid out as the plugin's config says (``pipeline.stages``), with the
        host's tensor-parallel size ``tp`` (the config has none: the host's model fixes it)."""
        return cls(world=world, stages=config.pipeline.stages, tp=tp)

    @property
    def columns(self) -> int:
        """Data-parallel columns: cells per stage."""
        return self.world // (self.stages * self.tp)

    def rank_of(self, stage: int, column: int, replica: int = 0) -> int:
        """The global rank at (``stage``, ``column``), tensor-parallel rank ``replica``."""
        self._check(stage, column, replica)
        return (stage * self.columns + column) * self.tp + replica

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, column, replica) of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the {self.world} ranks")
        cell, replica = divmod(rank, self.tp)
        return (*divmod(cell, self.columns), replica)

    def stage_ranks(self, stage: int, first: int = 0, size: int | None = None, replica: int = 0) -> list[int]:
        """The ranks of columns ``first`` .. ``first + size - 1`` (default: all) at ``stage``, each
        column's tensor-parallel rank ``replica``: a sequence-parallel group, or the stage's
        data-parallel ranks."""
        size = self.columns - first if size is None else size
        return [self.rank_of(stage, c, replica) for c in range(first, first + size)]

    def column_ranks(self, column: int, replica: int = 0) -> list[int]:
        """The ranks of ``column``'s stages, first stage first, tensor-parallel rank ``replica``: one pipeline."""
        return [self.rank_of(s, column, replica) for s in range(self.stages)]

    def _check(self, stage: int, column: int, replica: int) -> None:
        if not (0 <= stage < self.stages and 0 <= column < self.columns):
            raise ValueError(
                f"(stage {stage}, column {column}) is outside the layout of {self.stages} stages x "
                f"{self.columns} columns"
            )
        if not 0 <= replica < self.tp:
            raise ValueError(f"replica {replica} is not in [0, tp={self.tp}): give this rank's tensor-parallel rank")
