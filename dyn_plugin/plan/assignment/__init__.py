"""Sequences to groups of ranks, in two stages (Hydraulis): a fast dispatch by dynamic programming
(``dispatch``) and, where asked, an integer program over the micro-batches (``two_stage``,
``microbatch_ilp``). Sequence parallelism's groups and the strategies assign through it."""
