"""A sharding choice per module under a memory budget (OSDP): the search (``search``, its knapsack
``knapsack``), its units for an encoder-decoder (``pair_sharding``) and the versioned plan it
produces (``shard_plan``)."""
