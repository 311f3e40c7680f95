"""One rank of the ``pretrain_gpt.py`` kill test (tests/test_megatron_kills.py): Megatron-LM's
``pretrain_gpt.py`` ($MEGATRON_LM_SCRIPT), unmodified, run as ``__main__`` through the plugin's
launcher, with the kill switch (``kill_harness.KillSwitch``, point in ``$KILL``) armed from outside:

- the model, once ``setup_model_and_optimizer`` has built it (and loaded the checkpoint);
- the saves: each ``dist_checkpointing.save`` (the plugin's patch of it, which writes the marker
  last) is one save. So ``save`` kills inside Megatron's writers, ``commit`` before the marker, and
  ``after-save`` after it but before Megatron-LM's tracker file (``latest_checkpointed_iteration.txt``)
  names the iteration; a kill after the tracker is the next ``pre-forward``;
- ``startup``: the checkpoint loaded, training not begun.

``FAULT`` (``tests/faults.py``: ``what:ERRNO@rank``) fails that I/O on that rank for the whole launch.

Each step is logged as the plugin hands it out, with Megatron-LM's iteration (``megatron_kill_rank``;
the log is trimmed to the restored iteration as ``train`` starts), and ``train``'s end writes the
final parameters. $MEGATRON_LM_OUT: the folder of the log and the final parameters.
"""

import os
import sys

out, script = os.environ["MEGATRON_LM_OUT"], os.environ["MEGATRON_LM_SCRIPT"]
rank = int(os.environ.get("RANK", "0"))
FAULT = None


def arm(switch) -> None:
    from megatron.core import dist_checkpointing
    from megatron.training import get_args, training

    from megatron_kill_rank import log_step, resume_log, write_final
    from megatron_patches import runtime

    setup = training.setup_model_and_optimizer

    def armed_setup(*args, **kwargs):
        model, optimizer, scheduler = setup(*args, **kwargs)
        switch.arm_model(model[0])
        return model, optimizer, scheduler

    train = training.train

    def observed_train(forward_step_func, model, *args, **kwargs):
        resume_log(out, rank, get_args().iteration)
        switch.hit("startup")
        result = train(forward_step_func, model, *args, **kwargs)
        write_final(out, rank, model, runtime.RUN)
        return result

    save = dist_checkpointing.save  # the plugin's patch: checkpointing.py calls it through the package

    def saving(*args, **kwargs):
        with switch.saving():
            return save(*args, **kwargs)

    next_step = runtime.PluginRun.next_step

    def logged(self, model):
        step = next_step(self, model)
        log_step(out, rank, get_args().curr_iteration, self)
        return step

    training.setup_model_and_optimizer, training.train = armed_setup, observed_train
    dist_checkpointing.save, runtime.PluginRun.next_step = saving, logged


def main() -> None:
    import runpy

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from faults import inject
    from kill_harness import KillSwitch

    global FAULT
    FAULT = inject(os.environ.get("FAULT"), rank)  # held: the patch lasts as long as the launch
    FAULT.__enter__()
    switch = KillSwitch(rank)
    switch.arm_saves()
    arm(switch)
    # Megatron's checkpoint writer starts a queue server by multiprocessing's spawn at its first
    # save, and a spawned process first runs the main script: pretrain_gpt.py, whose imports take
    # 10 s of a launch on CPU. Started here, the server runs this file, which does nothing there.
    filesystem_async._get_write_results_queue()
    sys.argv = [script, *sys.argv[1:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":  # not in the processes Megatron spawns (run as __mp_main__)
    main()
