"""One recompute switch per module, found the same way by every host.

A switch remembers which layers it wrapped, so a host must reuse the one it made for a module
rather than build another per step. They are cached here, keyed weakly by the module, instead of
as attributes stuck onto the host's objects (engines, FSDP modules, Megatron chunks): the cache
goes when the module does.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, TypeVar

from torch import nn

from ..models.recompute import RecomputeSwitch

T = TypeVar("T")

_SWITCHES: "weakref.WeakKeyDictionary[Any, dict[Callable[..., Any], Any]]" = weakref.WeakKeyDictionary()


def cached_switch(owner: Any, make: Callable[..., T], *args: Any) -> T:
    """The switch ``make(*args)`` made for ``owner`` the first time it was asked for. One per
    (owner, maker): Megatron's switch and the plain one never share an entry. The switch must
    not hold ``owner`` itself, or the weak key would never be released."""
    per_owner = _SWITCHES.setdefault(owner, {})
    if make not in per_owner:
        per_owner[make] = make(*args)
    return per_owner[make]


def recompute_switch(module: nn.Module) -> RecomputeSwitch:
    """The switch over ``module``'s decoder layers (DeepSpeed, FSDP and the profiler's model)."""
    return cached_switch(module, RecomputeSwitch, module)
