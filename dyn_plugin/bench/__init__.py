"""Benchmarks behind ``dynplugin bench``, one module per sub-command, each owning its flags and what
it runs (``HELP``, ``add_arguments``, ``run``: the records the command prints, as JSON): cost,
planner (planner_pairs for T5), sp, shard, strategy, loader (and store), families, checkpoint,
start_check; none is a timed test. ``train`` picks the training benchmark run side by side, one
module per host, each run on local ranks by module name (``train_deepspeed``, ``train_megatron``,
``train_megatron_lm``, ``train_pairs``; ``train_fsdp`` for ``shard --train``; the launch:
``launch``; what they share: ``train_common``)."""
