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

After ``validate_args`` the arguments are checked against the plan (``check_arguments``: rows no
longer than ``--seq-length``, ``--micro-batch-size 1`` for packed rows, no context parallelism,
``--sequence-parallel`` only where rows divide, packed rows on at most two pipeline stages,
checkpoints in the distributed format, where the data position is saved) and the
plan's global batch becomes Megatron-LM's (``global_batch``).
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any, Callable

from dyn_plugin.config import ConfigError
from dyn_plugin.host import support

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


def check_arguments(args: Any) -> None:
    """Refuse, at start, Megatron-LM arguments the plan cannot run under, naming the flag and the
    fix; and make the plan's global batch Megatron-LM's (see ``global_batch``)."""
    from megatron_patches import runtime

    run = getattr(runtime, "RUN", None)
    if run is None:
        return
    plugin = run.config.plugin
    support.check("Megatron-LM", support.Run(plugin))  # the plugin's features this host runs, all at once
    seq = getattr(args, "seq_length", None)
    longest = plugin.microbatching.max_seq_len
    if seq is not None and longest > seq:
        # the model is built for --seq-length positions (--max-position-embeddings >= it, which
        # Megatron-LM checks); a longer row fails deep in the model instead (an IndexError)
        raise ConfigError(
            f"dyn_plugin.microbatching.max_seq_len = {longest} exceeds Megatron's --seq-length {seq}: the plugin's "
            f"micro-batches hold rows of up to {longest} tokens (a document, or a packed row of documents) and the "
            f"model is built for {seq} positions; raise --seq-length (and --max-position-embeddings) to at least "
            f"{longest}, or lower max_seq_len to {seq} (with microbatching.truncate = true to cut longer documents)"
        )
    if getattr(args, "decoder_seq_length", None) is not None:  # pretrain_t5.py's flag
        raise support.refusal(
            "encoder-decoder (input, target) pairs",
            "Megatron-LM",
            asked_by=f"--decoder-seq-length {args.decoder_seq_length}",
        )
    if (getattr(args, "context_parallel_size", 1) or 1) > 1:
        raise ConfigError(
            f"--context-parallel-size {args.context_parallel_size}: the plugin plans data-parallel and pipeline "
            "ranks, and megatron-core 0.16's context parallelism fixes one group size for the run; leave "
            "--context-parallel-size out (1)"
        )
    packs = plugin.microbatching.may_pack
    if packs and getattr(args, "micro_batch_size", 1) != 1:
        raise ConfigError(
            f"--micro-batch-size {args.micro_batch_size} with packed micro-batches (microbatching.method "
            f"{plugin.microbatching.method!r}, layout {plugin.microbatching.layout!r}): a packed micro-batch is one "
            "THD row, Megatron-LM's packed format needs --micro-batch-size 1 (the plugin sizes micro-batches "
            "itself); pass --micro-batch-size 1, or set microbatching.layout to 'padded'"
        )
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if getattr(args, "sequence_parallel", False) and tp > 1:
        multiple = plugin.microbatching.pad_multiple
        if packs:
            raise ConfigError(
                "--sequence-parallel with packed micro-batches: Megatron splits every row's tokens over the "
                f"{tp} tensor-parallel ranks, and a packed row holds exactly its documents' tokens (any count); "
                "leave --sequence-parallel out, or set microbatching.layout to 'padded'"
            )
        if multiple % tp:
            raise ConfigError(
                f"--sequence-parallel splits every row over the {tp} tensor-parallel ranks, but padded rows are "
                f"rounded to microbatching.pad_multiple = {multiple} tokens; set pad_multiple to a multiple of {tp}"
            )
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if packs and pp > 2:
        # pretrain_gpt's get_batch returns nothing on stages between the first and the last, so
        # their attention and rotary embeddings would see one sequence instead of the documents
        raise ConfigError(
            f"--pipeline-model-parallel-size {pp} with packed micro-batches: Megatron-LM's get_batch gives the "
            "stages between the first and the last no document boundaries (cu_seqlens), so they would attend "
            "across documents; use at most 2 pipeline stages with packing, or set microbatching.layout to 'padded'"
        )
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt != "torch_dist" and (getattr(args, "save", None) or getattr(args, "load", None)):
        # the loader's position is written beside megatron-core's distributed checkpoint
        # (train_state): another format would resume Megatron at its iteration and the data at the start
        raise ConfigError(
            f"--ckpt-format {fmt} with --save/--load: the plugin saves and restores its data position beside "
            "Megatron's distributed checkpoints only; use --ckpt-format torch_dist (Megatron-LM's default)"
        )
    global_batch(run, args)


def global_batch(run: Any, args: Any) -> None:
    """One planned step is one Megatron-LM iteration of ``--global-batch-size`` samples of
    ``--seq-length`` tokens: the plan's token budget per step (``microbatching.global_tokens``) is
    their product, so Megatron-LM's counters (``consumed_train_samples``, the learning-rate schedule's
    warm-up and decay, the iteration logs and resume) keep their meaning in its own units. Left
    unset in the config, the budget is derived; set to another value, it is refused."""
    gbs, seq = getattr(args, "global_batch_size", None), getattr(args, "seq_length", None)
    if gbs is None or seq is None:
        return
    from dyn_plugin.config import LoadedConfig

    plugin = run.config.plugin
    mb, tokens = plugin.microbatching, gbs * seq
    if "global_tokens" not in mb.model_fields_set:
        update = {"microbatching": mb.model_copy(update={"global_tokens": tokens})}
        run.config = LoadedConfig(plugin.model_copy(update=update), run.config.deepspeed)
        logger.info(
            "dyn_plugin.microbatching.global_tokens = %d (--global-batch-size %d x --seq-length %d)", tokens, gbs, seq
        )
    elif mb.global_tokens != tokens:
        raise ConfigError(
            f"dyn_plugin.microbatching.global_tokens = {mb.global_tokens} but Megatron-LM's global batch is "
            f"--global-batch-size {gbs} x --seq-length {seq} = {tokens} tokens: one planned step is one iteration, "
            "and Megatron-LM counts consumed samples, warm-up and decay in those samples; set global_tokens to "
            f"{tokens}, or leave it out (it follows the flags)"
        )


def _wrap_validate_args(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(args: Any, *rest: Any, **kwargs: Any):
        result = original(args, *rest, **kwargs)
        force_settings(args if result is None else result)
        check_arguments(args if result is None else result)
        return result

    return validate_args


def arguments_patches() -> list[Patch]:
    """Patches of Megatron-LM's ``parse_args`` and ``validate_args`` (optional: Megatron-LM only)."""
    module = "megatron.training.arguments"
    return [
        Patch("arguments.parse_args", f"{module}.parse_args", _wrap_parse_args, optional=True),
        Patch("arguments.validate_args", f"{module}.validate_args", _wrap_validate_args, optional=True),
    ]
