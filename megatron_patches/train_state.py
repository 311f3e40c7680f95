"""What a Megatron run counts and saves, made true of planned steps.

- Learning rate: Megatron-LM advances its schedule by ``num_microbatches * micro_batch_size *
  data_parallel_size`` samples per step, a constant; a planned global batch holds as many
  documents as fit its token budget. ``OptimizerParamScheduler.step`` counts the documents the
  planned steps since its last call actually trained instead.
- Checkpoints: the loader's position (epoch, step and what identifies the plan) is saved as JSON
  beside Megatron's distributed checkpoint, by each node's local rank 0 (no shared filesystem
  assumed), and restored when that checkpoint is loaded: the run continues with exactly the
  samples the interrupted epoch had left. The loader may not exist yet at load time (it is built
  at the first step), so the position waits in the run until it does.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

from .registry import Patch

logger = logging.getLogger(__name__)

CHECKPOINTING = "megatron.core.dist_checkpointing.serialization"


def _lr_step(original: Callable) -> Callable:
    @functools.wraps(original)
    def step(self, increment: int) -> None:
        from . import runtime

        run = runtime.RUN
        if run is not None and run.samples:
            increment, run.samples = run.samples, 0
        return original(self, increment)

    return step


def save_loader_state(checkpoint_dir: str) -> None:
    from dyn_plugin.device import local_rank
    from dyn_plugin.host.checkpoint import write_loader_state

    from . import runtime

    run = runtime.RUN
    if run is None or run.loader is None or local_rank() != 0:
        return
    write_loader_state(checkpoint_dir, run.loader.state_dict())


def load_loader_state(checkpoint_dir: str) -> None:
    from dyn_plugin.host.checkpoint import LOADER_STATE, loader_state_path, read_loader_state

    from . import runtime

    run = runtime.RUN
    if run is None:
        return
    if not os.path.exists(loader_state_path(checkpoint_dir)):
        logger.warning("%s has no %s: the loader starts from the beginning of the data", checkpoint_dir, LOADER_STATE)
        return
    run.restore(read_loader_state(checkpoint_dir))


def _then(hook: Callable[[str], None]) -> Callable[[Callable], Callable]:
    """A patch maker: ``dist_checkpointing.save``/``load``, then ``hook`` on the checkpoint folder."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def run(sharded_state_dict, checkpoint_dir, *args, **kwargs):
            out = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
            hook(str(checkpoint_dir))
            return out

        return run

    return make


def train_state_patches() -> list[Patch]:
    return [
        Patch(
            "train_state.lr_increment", "megatron.core.optimizer_param_scheduler.OptimizerParamScheduler.step", _lr_step
        ),
        Patch("train_state.save_checkpoint", f"{CHECKPOINTING}.save", _then(save_loader_state)),
        Patch("train_state.load_checkpoint", f"{CHECKPOINTING}.load", _then(load_loader_state)),
    ]
