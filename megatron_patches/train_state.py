"""What a Megatron run saves, made whole for planned steps.

Counters need no patch: one planned step is one iteration of the host's loop, and under Megatron-LM
its token budget is ``--global-batch-size`` samples of ``--seq-length`` tokens (``arguments``), so
Megatron-LM's ``consumed_train_samples`` and learning-rate schedule (warm-up, decay, both in
samples) advance by ``--global-batch-size`` per iteration as they would without the plugin.

Checkpoints: the loader's position (epoch, step and what identifies the plan) is saved as JSON
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
        Patch("train_state.save_checkpoint", f"{CHECKPOINTING}.save", _then(save_loader_state)),
        Patch("train_state.load_checkpoint", f"{CHECKPOINTING}.load", _then(load_loader_state)),
    ]
