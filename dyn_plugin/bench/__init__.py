"""Benchmarks behind ``dynplugin bench``: planner, loader, store, sp, shard and strategy (each
returns records that the command prints as a table or as JSON; none is a timed test), and the
training benchmarks side by side, one module per host, each run on local ranks by module name
(``train_deepspeed``, ``train_megatron``, ``train_fsdp``; what they share: ``train_common``)."""
