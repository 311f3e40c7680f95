"""A small patch registry: each patch replaces one object named by its dotted path.

A patch is applied at most once (the replacement carries a marker, so applying twice equals
applying once), keeps the original, rebinds every from-import alias of the original found in
``sys.modules`` (``from megatron.core.pipeline_parallel import get_forward_backward_func`` binds
a second name that a patch of the defining module alone would miss), and is reverted exactly:
every name it rebound gets its original object back. Patches declare the megatron-core versions
they were written against; outside that range they are refused with both versions named, since a
patch of an internal signature that silently changed would train wrong rather than fail.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from packaging.specifiers import SpecifierSet
from packaging.version import Version

logger = logging.getLogger(__name__)

MARKER = "__dyn_plugin_patch__"


class UnsupportedVersion(RuntimeError):
    pass


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


@dataclass(frozen=True)
class Patch:
    """``target``: dotted path of a module attribute or a class attribute
    (``megatron.core.pipeline_parallel.schedules.get_forward_backward_func``,
    ``megatron.core.transformer.transformer_config.TransformerConfig.__post_init__``).
    ``make(original)`` returns the replacement. ``versions``: the megatron-core versions (PEP 440
    specifier) it supports. ``when``: applied only where this holds (the CPU shims: no CUDA).
    ``optional``: the target's module may be absent (``megatron.training`` is not in
    megatron-core's wheel): then the patch is skipped. ``aliases``: rebind other names bound to the
    original (off for module objects such as a module's ``torch``)."""

    name: str
    target: str
    make: Callable[[Any], Any]
    versions: str = ">=0.16,<0.17"
    when: Callable[[], bool] = lambda: True
    optional: bool = False
    aliases: bool = True


@dataclass
class _Applied:
    patch: Patch
    original: Any
    replacement: Any
    bindings: list[tuple[Any, str]] = field(default_factory=list)  # (namespace, name) now holding the replacement
    inherited: bool = False  # a class attribute found on a base class: reverting deletes the override


def _resolve(target: str) -> tuple[Any, str]:
    """The object holding the target's last name (a module or a class) and that name."""
    parts = target.split(".")
    missing: ModuleNotFoundError | None = None  # the longest module on the path that is not installed
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        try:
            owner = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and module != e.name and not module.startswith(e.name + "."):
                raise  # the module exists but one of its own imports is missing
            missing = missing or e
            continue
        for name in parts[cut:-1]:
            if missing is not None and hasattr(owner, "__path__") and not hasattr(owner, name):
                # the package ``megatron`` imports but ``megatron.training`` does not: the target's module is absent
                raise ModuleNotFoundError(f"patch target {target}: {missing}", name=missing.name)
            owner = getattr(owner, name)
        if not hasattr(owner, parts[-1]):
            raise AttributeError(f"patch target {target}: {owner!r} has no attribute {parts[-1]!r}")
        return owner, parts[-1]
    raise ModuleNotFoundError(f"patch target {target}: no importable module on its path", name=parts[0])


class Registry:
    def __init__(self) -> None:
        self._patches: dict[str, Patch] = {}
        self._applied: dict[str, _Applied] = {}

    def register(self, patch: Patch) -> Patch:
        if patch.name in self._patches:
            raise ValueError(f"a patch named {patch.name!r} is already registered")
        self._patches[patch.name] = patch
        return patch

    @property
    def applied(self) -> list[str]:
        return list(self._applied)

    def check_version(self, version: str | None = None) -> None:
        """Refuse a megatron-core version outside every registered patch's range."""
        version = version or megatron_core_version()
        for p in self._patches.values():
            if Version(version) not in SpecifierSet(p.versions):
                raise UnsupportedVersion(
                    f"megatron-core {version} is installed but the dyn_plugin patch {p.name!r} ({p.target}) supports "
                    f"megatron-core {p.versions}; install a supported version (pip install 'megatron-core{p.versions}') "
                    "or run without the plugin's Megatron patches"
                )

    def apply(self, version: str | None = None) -> list[str]:
        """Apply every registered patch not applied yet; returns the names applied by this call."""
        self.check_version(version)
        done = []
        for p in self._patches.values():
            if p.name in self._applied or not p.when():
                continue
            try:
                owner, name = _resolve(p.target)
            except ModuleNotFoundError:
                if not p.optional:
                    raise
                logger.debug("patch %s skipped: %s is not installed", p.name, p.target)
                continue
            inherited = isinstance(owner, type) and name not in owner.__dict__
            # a class's own __dict__ entry keeps a staticmethod/classmethod as the descriptor it is
            original = owner.__dict__[name] if isinstance(owner, type) and not inherited else getattr(owner, name)
            if getattr(original, MARKER, None) == p.name:
                continue  # already in place (applied by another registry instance of this process)
            replacement = p.make(original)
            try:
                setattr(replacement, MARKER, p.name)
            except (AttributeError, TypeError):
                pass  # a builtin or slotted object: idempotence then rests on the registry's own record
            record = _Applied(p, original, replacement, inherited=inherited)
            setattr(owner, name, replacement)
            record.bindings.append((owner, name))
            if p.aliases and not isinstance(owner, type):
                record.bindings += _rebind_aliases(original, replacement, skip=owner)
            self._applied[p.name] = record
            done.append(p.name)
        if done:
            logger.info("dyn_plugin Megatron patches applied: %s", ", ".join(done))
        return done

    def revert(self) -> list[str]:
        """Put every original back, in reverse order of application."""
        names = list(self._applied)[::-1]
        for n in names:
            record = self._applied.pop(n)
            for owner, name in record.bindings:
                if record.inherited and (owner, name) == record.bindings[0]:
                    delattr(owner, name)
                else:
                    setattr(owner, name, record.original)
            if record.patch.aliases and not isinstance(record.bindings[0][0], type):
                # modules imported while the patch was on from-imported the replacement (not the module
                # that defines the replacement: its own name for it stays)
                _rebind_aliases(
                    record.replacement,
                    record.original,
                    skip=sys.modules.get(getattr(record.replacement, "__module__", None) or ""),
                )
        return names


def _rebind_aliases(original: Any, replacement: Any, skip: Any | None) -> list[tuple[Any, str]]:
    """Every module-level name bound to ``original`` (from-imports), now bound to ``replacement``."""
    found = []
    for module in list(sys.modules.values()):
        if module is None or module is skip:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            if value is original:
                namespace[name] = replacement
                found.append((module, name))
    return found
