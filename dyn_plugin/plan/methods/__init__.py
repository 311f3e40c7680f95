"""The planning methods a run or a benchmark picks by name: the plugin's planner (``planner``: the
step plan and its execution plans), the baselines priced and simulated the same way (``baselines``,
``pair_baselines`` for encoder-decoder pairs) and the registry naming them (``registry``)."""
