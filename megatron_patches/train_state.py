"""What a Megatron run saves, made whole for planned steps.

Counters need no patch: one planned step is one iteration of the host's loop, and under Megatron-LM
its token budget is ``--global-batch-size`` samples of ``--seq-length`` tokens (``arguments``), so
Megatron-LM's ``consumed_train_samples`` and learning-rate schedule (warm-up, decay, both in
samples) advance by ``--global-batch-size`` per iteration as they would without the plugin.

Checkpoints follow the plugin's protocol (``dyn_plugin.host.checkpoint``): before
``dist_checkpointing.save`` writes, the iteration's folder is locked and cleared (a re-used folder's
marker first); once every rank's files are written, they are hashed and synced and the marker (the
loader's position, what the plans depend on, every file's size and hash) is written, before
Megatron-LM's tracker file names the iteration (a tracker that names the iteration being saved again
is first moved to the latest other whole one: a failed re-save never leaves it naming a folder that
is not whole); an asynchronous save (``--async-save``) commits from
the save's finalize step, when its files are. A failure on any rank fails the save on every rank. A
kill anywhere leaves the tracker naming the last whole checkpoint. On load the folder is checked on
every rank before anything of it is read (a checkpoint without a marker, or with a file damaged, is
refused on every rank, unless Megatron-LM's ``--finetune`` says the data starts afresh), and the
marker's position is restored (the loader may not exist yet: it is built at the first step, so the
position waits in the run until it does, and a save before then, as Megatron-LM's after a loop with
nothing left to train, commits that position).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

from .registry import Patch

logger = logging.getLogger(__name__)

CHECKPOINTING = "megatron.core.dist_checkpointing.serialization"
TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's: the iteration its load reads


def _finetuning() -> bool:
    """Megatron-LM's ``--finetune``: the weights are loaded, the iteration and the data start afresh."""
    try:
        from megatron.training.global_vars import get_args

        return bool(getattr(get_args(), "finetune", False))
    except (ImportError, AssertionError):  # megatron-core alone, or Megatron-LM's args not parsed
        return False


def _iteration_of(path: str) -> str | None:
    """What Megatron-LM's tracker holds for an iteration folder (its number); None for any other."""
    name = os.path.basename(path)
    return str(int(name[len("iter_") :])) if name.startswith("iter_") and name[len("iter_") :].isdigit() else None


def _save(original: Callable) -> Callable:
    @functools.wraps(original)
    def save(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from dyn_plugin.host import checkpoint

        from . import runtime

        run = runtime.RUN
        if run is None or (run.loader is None and run.resume is None):  # no data trained: nothing to keep
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if checkpoint.open_save(checkpoint_dir) is not None:  # inside a loop's own checkpoint.saving: it publishes
            return original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if run.loader is not None:
            record = checkpoint.Record.of(run.loader)  # now: an asynchronous save commits after more steps
        else:  # resumed, no step yet (Megatron-LM saves again after a loop with nothing left): where it resumed
            resumed = run.resume
            record = checkpoint.Record(resumed.position, resumed.loader, resumed.run, resumed.lineage)
        root, tag = os.path.split(os.path.abspath(os.fspath(checkpoint_dir)))
        # a loop may have written its own files into the folder already (megatron-core's example does):
        # only what the old checkpoint there wrote goes
        save = checkpoint.prepare(
            root,
            tag,
            record,
            keep_recent=True,
            before=lambda: checkpoint.move_pointer_off(
                os.path.join(root, TRACKER), root, os.path.join(root, tag), _iteration_of
            ),
        )
        try:
            request = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        except Exception as exc:
            checkpoint.publish(save, exc)  # raises on every rank
            raise
        if request is None:
            checkpoint.publish(save)
        else:  # --async-save: the files are written when the request finalizes, after its own metadata
            request.finalize_fns.append(lambda: checkpoint.publish(save))
        return request

    return save


def _load(original: Callable) -> Callable:
    @functools.wraps(original)
    def load(sharded_state_dict, checkpoint_dir, *args, **kwargs):
        from dyn_plugin.host import checkpoint

        from . import runtime

        run = runtime.RUN
        found = None
        if run is not None and not _finetuning():  # checked before anything of it is read
            found = checkpoint.read_everywhere(
                str(checkpoint_dir),
                "load a whole checkpoint (the previous iteration's), or pass Megatron-LM's --finetune to "
                "start the data from its beginning on purpose",
                verify_hashes=run.config.plugin.checkpoint.verify == "hashes",
            )
        out = original(sharded_state_dict, checkpoint_dir, *args, **kwargs)
        if found is not None:
            run.restore(found)
        return out

    return load


def train_state_patches() -> list[Patch]:
    return [
        Patch("train_state.save_checkpoint", f"{CHECKPOINTING}.save", _save),
        Patch("train_state.load_checkpoint", f"{CHECKPOINTING}.load", _load),
    ]
