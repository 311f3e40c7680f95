"""How the ranks of a run are laid out: pipeline stages x data-parallel columns, named once.

Plans, their point-to-point peers, the sequence-parallel groups and the loader all number ranks
stage-major, as DeepSpeed's ``PipeDataParallelTopology`` does: global rank = stage * columns +
column. A column is one data-parallel slice of the pipeline (every stage of it); a sequence-
parallel group is a block of neighbouring columns at one stage. Pure Python: the planners use it
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankLayout:
    """``world`` ranks as ``stages`` pipeline stages of ``columns`` data-parallel columns each."""

    world: int
    stages: int = 1

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"a rank layout needs at least one rank, got world = {self.world}")
        if self.stages < 1 or self.world % self.stages:
            raise ValueError(
                f"dyn_plugin.pipeline.stages = {self.stages} does not divide the {self.world} ranks; "
                f"launch a multiple of {self.stages} ranks or change pipeline.stages"
            )

    @classmethod
    def of(cls, columns: int, stages: int = 1) -> RankLayout:
        """The layout of ``columns`` data-parallel columns on ``stages`` stages."""
        if columns < 1:
            raise ValueError(f"a rank layout needs at least one data-parallel column, got {columns}")
        return cls(world=columns * stages, stages=stages)

    @property
    def columns(self) -> int:
        """Data-parallel columns: ranks per stage."""
        return self.world // self.stages

    def rank_of(self, stage: int, column: int) -> int:
        """The global rank at (``stage``, ``column``)."""
        self._check(stage, column)
        return stage * self.columns + column

    def coords(self, rank: int) -> tuple[int, int]:
        """(stage, column) of global ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside the {self.world} ranks")
        return divmod(rank, self.columns)

    def stage_ranks(self, stage: int, first: int = 0, size: int | None = None) -> list[int]:
        """The ranks of columns ``first`` .. ``first + size - 1`` (default: all) at ``stage``: a
        sequence-parallel group, or the stage's data-parallel ranks."""
        size = self.columns - first if size is None else size
        return [self.rank_of(stage, c) for c in range(first, first + size)]

    def column_ranks(self, column: int) -> list[int]:
        """The ranks of ``column``'s stages, first stage first: one pipeline."""
        return [self.rank_of(s, column) for s in range(self.stages)]

    def _check(self, stage: int, column: int) -> None:
        if not (0 <= stage < self.stages and 0 <= column < self.columns):
            raise ValueError(
                f"(stage {stage}, column {column}) is outside the layout of {self.stages} stages x "
                f"{self.columns} columns"
            )
