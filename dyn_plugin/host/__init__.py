"""What every host adapter (DeepSpeed, Megatron, PyTorch FSDP) needs, written once.

- ``device``: this rank's local rank and device, the one dtype name <-> ``torch.dtype`` map and the
  precision a DeepSpeed config trains in;
- ``token_mean``: the exact token-mean step over a plan's micro-batches, with what differs between
  hosts (gradient sync, backward, optimizer step) passed in as a few callables;
- ``recompute``: the per-module recompute switch, cached outside the host's objects;
- ``checkpoint``: the loader position saved as JSON beside a host checkpoint.

The modules are imported one by one (``from dyn_plugin.host.device import local_rank``): this
package's ``__init__`` imports nothing, so the dtype map costs no runtime import.
"""
