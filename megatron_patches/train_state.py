"""What a Megatron run saves, made whole for planned steps.

Counters need no patch: one planned step is one iteration of the host's loop, and under Megatron-LM
its token budget is ``--global-batch-size`` samples of ``--seq-length`` tokens (``arguments``), so
Megatron-LM's ``consumed_train_samples`` and learning-rate schedule (warm-up, decay, both in
samples) advance by ``--global-batch-size`` per iteration as they would without the plugin.

Checkpoints follow the plugin's protocol (``dyn_plugin.host.checkpoint``): each node's local rank 0
takes a re-used folder's marker away before ``dist_checkpointing.save`` writes, and writes the marker
(the loader's position, what the plans depend on) once every rank's files are written, before
Megatron-LM's tracker file names the iteration; an asynchronous save (``--async-save``) commits from
the save's finalize step, when its files are. A kill anywhere leaves the tracker naming the last
whole checkpoint. On load the marker's position is restored (the loader may not exist yet: it is
built at the first step, so the position waits in the run until it does, and a save before then, as
Megatron-LM's after a loop with nothing left to train, commits that position); a checkpoint without
one is refused on every rank, unless Megatron-LM's ``--finetune`` says the data starts afresh.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

from .registry import Patch

logger = logging.getLogger(__name__)

CHECKPOINTING = "megatron.core.dist_checkpointing.serialization"


def _finetuning() -> bool:
    """Megatron-LM's ``--finetune``: the weights are loaded, the iteration and the data start afresh."""
    try:
        from megatron.training.global_vars import get_args

        return bool(getattr(get_args(), "finetune", False))
    except (ImportError, AssertionError):  # megatron-core alone, or Megatron-LM's args not parsed
        return False


def _save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from dyn_plugin.host import checkpoint

        from . import runtime

        run = runtime.RUN
        if run is None or (run.loader is None and run.resume is None):  # no data trained: nothing to keep
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if run.loader is not None:
            record = checkpoint.Record.of(run.loader)  # now: an asynchronous save commits after more steps
        else:  # resumed, no step yet (Megatron-LM saves again after a loop with nothing left): where it resumed
            record = checkpoint.Record(run.resume.position, run.resume.loader, run.resume.run)
        directory = str(checkpoint_dir)
        checkpoint.prepare(directory)

        def publish() -> None:  # every node's marker is written before Megatron-LM's tracker names the folder
            checkpoint.publish(directory, record)

        request = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if request is None:
            publish()
        else:  # --async-save: the files are written when the request finalizes, after its own metadata
            request.finalize_fns.append(publish)
        return request

    return save


def _load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from dyn_plugin.host import checkpoint

        from . import runtime

        out = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        run = runtime.RUN
        if run is None or _finetuning():
            return out
        run.restore(
            checkpoint.read_everywhere(
                str(checkpoint_dir),
                "load a whole checkpoint (the previous iteration's), or pass Megatron-LM's --finetune to "
                "start the data from its beginning on purpose",
            )
        )
        return out

    return load


def train_state_patches() -> list[Patch]:
    return [
        Patch("train_state.save_checkpoint", f"{CHECKPOINTING}.save", _save),
        Patch("train_state.load_checkpoint", f"{CHECKPOINTING}.load", _load),
    ]
