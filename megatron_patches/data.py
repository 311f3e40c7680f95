"""The training documents, taken where Megatron builds its datasets.

Megatron-LM's ``pretrain_gpt.py`` and megatron-core loops alike build their splits with
``BlendedMegatronDatasetBuilder(...).build()``. Its training ``GPTDataset`` cuts the documents of
an indexed dataset into fixed-length samples (Megatron's packing); the plugin plans the documents
themselves, so the patch hands the split's documents (the low-level dataset's documents the split
owns, with their token counts from the index) to the run, on every rank: each plans the step
and each tensor-parallel rank reads its own micro-batches (``batches``), so the datasets are
built on every rank (Megatron-LM builds them where it reads data, TP rank 0 of the first and last
stages). The datasets returned are Megatron's own, unchanged: evaluation still reads the
validation split as Megatron does.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import numpy as np

from .registry import Patch
from .runtime import Documents

logger = logging.getLogger(__name__)


class _Split:
    """Documents ``ids`` of a low-level (indexed) dataset."""

    def __init__(self, low: Any, ids: np.ndarray) -> None:
        self.low, self.ids = low, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.low[int(self.ids[i])], dtype=np.int64)


def documents_of(dataset: Any) -> Documents:
    """The documents a Megatron training split draws its samples from."""
    low, ids = getattr(dataset, "dataset", None), getattr(dataset, "indices", None)
    if low is None or ids is None or not hasattr(low, "sequence_lengths"):
        raise TypeError(
            f"the training split is a {type(dataset).__name__}; the plugin reads the documents of a "
            "single GPTDataset (a blend of several datasets is not planned): pass one data prefix, or set "
            "the documents yourself with megatron_patches.runtime.RUN.set_documents"
        )
    ids = np.unique(np.asarray(ids))  # each document once (an index may repeat documents over epochs)
    return Documents(_Split(low, ids), np.asarray(low.sequence_lengths, dtype=np.int64)[ids])


def _build(original: Callable) -> Callable:
    @functools.wraps(original)
    def build(self) -> list:
        from . import runtime

        if runtime.RUN is not None:
            # Megatron-LM builds the data on TP rank 0 of the first and last stages only
            # (pretrain_gpt's is_dataset_built_on_rank) and broadcasts it to the other TP ranks;
            # every rank plans the documents and every TP rank reads its own planned batch
            self.is_built_on_rank = lambda: True
        datasets = original(self)
        if runtime.RUN is not None and datasets and datasets[0] is not None:
            runtime.RUN.set_documents(documents_of(datasets[0]))
        return datasets

    return build


def _helpers_built() -> bool:
    """Whether megatron-core's dataset helpers come compiled (the wheel ships ``helpers_cpp``)."""
    import importlib.util

    return importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None


def _compile_helpers(original: Callable) -> Callable:
    """Megatron-LM's ``initialize`` compiles the helpers with ``make`` in megatron-core's datasets
    folder; the wheel ships them built and no Makefile, so ``make`` fails and Megatron exits."""

    @functools.wraps(original)
    def compile_helpers() -> None:
        logger.debug("megatron-core's dataset helpers are built (helpers_cpp): not compiling them")

    return compile_helpers


def data_patches() -> list[Patch]:
    return [
        Patch(
            "data.compile_helpers",
            "megatron.core.datasets.utils.compile_helpers",
            _compile_helpers,
            when=_helpers_built,
        ),
        Patch(
            "data.dataset_builder",
            "megatron.core.datasets.blended_megatron_dataset_builder.BlendedMegatronDatasetBuilder.build",
            _build,
        ),
    ]
