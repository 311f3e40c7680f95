"""Operator splitting (OSDP): a linear layer cut into slices along its output features.

Each slice is its own ``nn.Linear`` holding some rows of the weight (and the matching bias
entries), so a host can shard some slices fully and keep the others gathered
(``Choice("split")`` in plan/sharding/shard_plan.py). Every output feature is still one dot product over
all input features, computed by one slice, so the forward and the weight and bias gradients
are bit-exact to the unsplit layer when the slice boundaries fall on the GEMM's blocks (see
``ALIGN``). The input gradient is the one place the split shows: it is
the sum of the slices' partial products, added slice by slice, so it equals the unsplit
layer's up to float rounding (the order of one sum changes), not bit for bit.

The seed split along input features instead, which changes every output's summation order
and could not carry a bias.
"""

from __future__ import annotations

import torch
from torch import nn

# CPU GEMMs (MKL, oneDNN) block the output features in groups of 64: a slice boundary inside a
# block changes that block's kernel path and with it the rounding of its outputs (measured: a
# boundary at a multiple of 32 already differs in the last bit for some shapes; at 64, none did).
ALIGN = 64


def slice_sizes(features: int, slices: int) -> list[int]:
    """Output features of each slice: equal shares rounded up to a multiple of ``ALIGN`` (the
    last slice takes the rest), or, where the layer is too narrow for that, shares as equal as
    possible (then the forward is exact only up to rounding)."""
    if not 2 <= slices <= features:
        raise ValueError(f"cannot cut {features} output features into {slices} slices: need 2 <= slices <= {features}")
    share = -(-features // slices)
    aligned = -(-share // ALIGN) * ALIGN
    if aligned * (slices - 1) < features:
        return [aligned] * (slices - 1) + [features - aligned * (slices - 1)]
    base, extra = divmod(features, slices)
    return [base + (i < extra) for i in range(slices)]


class SplitLinear(nn.Module):
    """``nn.Linear(in_features, out_features)`` as ``len(slices)`` child linears, outputs concatenated."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        slices: int,
        bias: bool = True,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.slices = nn.ModuleList(
            nn.Linear(in_features, n, bias=bias, device=device, dtype=dtype) for n in slice_sizes(out_features, slices)
        )

    @classmethod
    def from_linear(cls, linear: nn.Linear, slices: int) -> "SplitLinear":
        """The same layer, split: each slice gets a copy of its rows of the weight and bias."""
        w = linear.weight
        split = cls(
            linear.in_features,
            linear.out_features,
            slices,
            bias=linear.bias is not None,
            device=w.device,
            dtype=w.dtype,
        )
        with torch.no_grad():
            start = 0
            for part in split.slices:
                stop = start + part.out_features
                part.weight.copy_(w[start:stop])
                if linear.bias is not None:
                    part.bias.copy_(linear.bias[start:stop])
                start = stop
        return split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.slices], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, slices={len(self.slices)}"


def split_linear(model: nn.Module, name: str, slices: int) -> SplitLinear:
    """Replace the ``nn.Linear`` at qualified ``name`` in ``model`` by its split (weights copied);
    a ``SplitLinear`` already there with ``slices`` slices is kept as it is."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = getattr(parent, attr, None)
    if isinstance(module, SplitLinear) and len(module.slices) == slices:
        return module
    if type(module) is not nn.Linear:
        raise ValueError(
            f"module {name!r} is a {type(module).__name__}, not an nn.Linear: only linear layers can be "
            "split; choose another sharding for it"
        )
    split = SplitLinear.from_linear(module, slices)
    setattr(parent, attr, split)
    return split
