"""Megatron-LM's command line, taught the plugin's flag and the two settings its plans need.

``megatron.training`` ships with Megatron-LM, not in megatron-core's wheel, so these patches are
optional: skipped where it is absent. With them, a Megatron-LM script accepts
``--dyn-plugin-config FILE`` (group "dyn-plugin") besides whatever its own
``extra_args_provider`` adds, and the run configures the plugin from that file. Two settings are
forced on, because the plugin's plans would otherwise train wrong or not at all:

* ``variable_seq_lengths``: the plans give each micro-batch its own length, so the pipeline must
  exchange shapes; Megatron-LM's ``validate_args`` turns it off unconditionally, hence it is set
  again after ``validate_args`` (``initialize_megatron`` calls ``parse_args`` and ``validate_args``
  one after the other).
* ``calculate_per_token_loss``: micro-batches of different token counts must be weighed by their
  tokens for the step's loss to be the exact per-token mean.
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any, Callable

from dyn_plugin.config import ConfigError

from .registry import Patch

logger = logging.getLogger(__name__)

FLAG = "--dyn-plugin-config"
# argument -> the value the plugin needs
FORCED = {"variable_seq_lengths": True, "calculate_per_token_loss": True}

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def _add_plugin_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    if FLAG not in parser._option_string_actions:  # a script may have added it itself
        group = parser.add_argument_group(title="dyn-plugin")
        group.add_argument(
            FLAG,
            metavar="FILE",
            default=None,
            help="the dyn_plugin JSON config (a DeepSpeed-style JSON with a dyn_plugin section)",
        )
    return parser


def chain_provider(provider: ArgsProvider | None) -> ArgsProvider:
    """An ``extra_args_provider`` adding the plugin's flag, then the script's own arguments."""

    def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = _add_plugin_arguments(parser)
        return provider(parser) if provider is not None else parser

    return extra_args_provider


def force_settings(args: Any) -> list[str]:
    """Set the arguments the plugin needs; returns (and logs) the ones that changed."""
    changed = []
    for name, value in FORCED.items():
        before = getattr(args, name, None)
        if before != value:
            setattr(args, name, value)
            changed.append(name)
            logger.info(
                "dyn_plugin: Megatron argument %s set to %s (was %s): the plugin's plans need it", name, value, before
            )
    return changed


def _configure(args: Any) -> None:
    path = getattr(args, "dyn_plugin_config", None)
    if path:
        from megatron_patches import runtime  # lazily: the runtime imports the planner

        runtime.configure(path)


def _wrap_parse_args(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def parse_args(extra_args_provider: ArgsProvider | None = None, ignore_unknown_args: bool = False):
        args = original(chain_provider(extra_args_provider), ignore_unknown_args)
        force_settings(args)
        _configure(args)
        return args

    return parse_args


def check_seq_length(args: Any) -> None:
    """Refuse, at start, a plan whose rows may be longer than Megatron-LM's ``--seq-length``: the
    model is built for that many positions (``--max-position-embeddings`` >= ``--seq-length``, which
    Megatron-LM checks), and a longer row fails deep in the model instead (an IndexError)."""
    from megatron_patches import runtime

    run, seq = getattr(runtime, "RUN", None), getattr(args, "seq_length", None)
    if run is None or seq is None:
        return
    longest = run.config.plugin.microbatching.max_seq_len
    if longest > seq:
        raise ConfigError(
            f"dyn_plugin.microbatching.max_seq_len = {longest} exceeds Megatron's --seq-length {seq}: the plugin's "
            f"micro-batches hold rows of up to {longest} tokens (a document, or a packed row of documents) and the "
            f"model is built for {seq} positions; raise --seq-length (and --max-position-embeddings) to at least "
            f"{longest}, or lower max_seq_len to {seq} (with microbatching.truncate = true to cut longer documents)"
        )


def _wrap_validate_args(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(args: Any, *rest: Any, **kwargs: Any):
        result = original(args, *rest, **kwargs)
        force_settings(args if result is None else result)
        check_seq_length(args if result is None else result)
        return result

    return validate_args


def arguments_patches() -> list[Patch]:
    """Patches of Megatron-LM's ``parse_args`` and ``validate_args`` (optional: Megatron-LM only)."""
    module = "megatron.training.arguments"
    return [
        Patch("arguments.parse_args", f"{module}.parse_args", _wrap_parse_args, optional=True),
        Patch("arguments.validate_args", f"{module}.validate_args", _wrap_validate_args, optional=True),
    ]
