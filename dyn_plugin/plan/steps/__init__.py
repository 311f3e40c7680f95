"""The core of every plan: one optimizer step of sequences or (input, target) pairs cut into
micro-batches (DynaPipe's dynamic programming over a cost model, ``microbatch``, ``pair_microbatch``),
priced, placed on replicas (``assign``, ``replicas``), ordered by a pipeline schedule (``schedule``),
simulated (``simulator``, ``trace``), checkpointed as memory needs (``pyramid``) and turned into
per-rank instruction lists (``instructions``). Every other planner builds on these pieces."""
