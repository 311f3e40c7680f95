"""A CPU stand-in for GPU memory and for torch's flash varlen kernel and compiled flex_attention,
so that tests can check on CPU that the CUDA attention path reads nothing back from the device
(issue 26).

A host read of a device tensor (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``) waits for every
kernel queued before it. A :class:`DeviceOnly` tensor, and every tensor computed from it, fails the
test on such a read, with the read's name; :func:`stand_in_flash` routes the plugin's attention to
the flash path with :func:`reference_varlen`, which alone may look at the boundaries (the real
kernel reads them on the device).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from dyn_plugin.models import document_flex
from dyn_plugin.models import varlen_attention as va

# what reading a tensor's values on the host goes through (methods and conversions)
READS = {"tolist", "item", "__int__", "__index__", "__bool__", "__float__", "numpy", "__array__"}


class DeviceOnly(torch.Tensor):
    """A tensor standing for one in GPU memory: its values, and those of every tensor computed from
    it, cannot be read on the host."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            raise AssertionError(f"host read of a device tensor: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def plain(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor)


CALLS: list[tuple] = []


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, 0), enable_gqa=False):
    """torch's flash varlen kernel, [tokens, heads, d] -> [tokens, heads, d]: causal attention within
    each document, ``window_size[0]`` keys back at most (-1: all)."""
    CALLS.append((type(q), window_size))
    assert isinstance(max_q, int) and max_q == max_k, "the longest document must come as a host int"
    assert cu_q is cu_k
    bounds = plain(cu_q).tolist()  # the kernel's own read, on the device
    assert max_q == max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    q, k, v = (plain(t) for t in (q, k, v))
    assert enable_gqa == (k.shape[1] != q.shape[1])
    out = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        i = torch.arange(b - a)
        seen = i[None, :] <= i[:, None]
        if window_size[0] >= 0:
            seen &= i[:, None] - i[None, :] <= window_size[0]
        qd, kd, vd = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=seen, scale=scale, enable_gqa=enable_gqa)
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def stand_in_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flash path taken on CPU, with the reference standing in for the CUDA kernel (torch 2.13's
    arguments: a window, grouped-query heads when asked)."""
    monkeypatch.setattr(va, "flash_device", lambda query: True)
    monkeypatch.setattr(va, "varlen_attn", reference_varlen)
    monkeypatch.setattr(va, "_WINDOWS", True)
    monkeypatch.setattr(va, "_CAUSAL", {"window_size": (-1, 0)})
    monkeypatch.setattr(va, "_GQA", {"enable_gqa": True})
    CALLS.clear()


def reference_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa):
    """Compiled flex_attention's stand-in: torch's eager flex (forward only on CPU), which may read
    the block mask (the compiled kernel reads it on the device)."""
    CALLS.append((type(q), "flex"))
    with torch._C.DisableTorchFunctionSubclass():
        out = flex_attention(
            plain(q), plain(k), plain(v), score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
        )
    return out.as_subclass(type(q))


def stand_in_flex(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-call path taken on CPU for soft-capped attention, eager flex standing in for the compiled."""
    monkeypatch.setattr(va, "flash_device", lambda query: True)
    monkeypatch.setattr(document_flex, "kernel", lambda: reference_flex)
    CALLS.clear()
