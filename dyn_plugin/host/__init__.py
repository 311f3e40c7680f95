"""What every host adapter (DeepSpeed, Megatron, PyTorch FSDP) needs, written once.

- ``token_mean``: the exact token-mean step over a plan's micro-batches, with what differs between
  hosts (gradient sync, backward, optimizer step) passed in as a few callables;
- ``recompute``: the per-module recompute switch, cached outside the host's objects;
- ``checkpoint``: the loader position saved as JSON beside a host checkpoint;
- ``encoder_decoder``: what a host checks before it trains an encoder-decoder (pairs, their cost model).

Where this rank trains and in which precision (``dyn_plugin.device``) sits below it, beside
``layout``: the loader needs it too, and the host core builds on the loader.

The modules are imported one by one (``from dyn_plugin.host.token_mean import token_mean_step``).
"""
