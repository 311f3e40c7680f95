"""Run a Megatron training script with the plugin's patches applied.

``python -m megatron_patches.launch --dyn-plugin-config cfg.json [--] SCRIPT ARGS...``, also as
``torchrun ... -m megatron_patches.launch ...``: the patches must be in place before the script
imports Megatron's schedules and builds its model, and an unmodified script (``pretrain_gpt.py``)
cannot apply them itself, so the launcher applies them and then runs the script as
``python SCRIPT ARGS...`` would: ``sys.argv = [SCRIPT, *ARGS]``, the script's folder first on
``sys.path``, run as ``__main__``.

The launcher's flag is taken out of the script's arguments (the script's parser would not know
it), except where Megatron-LM (``megatron.training``) is importable: its ``parse_args`` then accepts
the flag through the arguments patch, and passing it on sets ``args.dyn_plugin_config``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import runpy
import sys

logger = logging.getLogger(__name__)

FLAG = "--dyn-plugin-config"
USAGE = f"usage: python -m megatron_patches.launch {FLAG} FILE [--] SCRIPT [ARGS...]"


class LaunchError(ValueError):
    pass


def _take_flag(tokens: list[str], i: int) -> tuple[str, int]:
    """The flag's value at ``tokens[i]`` (``FLAG X`` or ``FLAG=X``) and the index after it."""
    token = tokens[i]
    if token.startswith(FLAG + "="):
        value = token[len(FLAG) + 1 :]
        i += 1
    elif i + 1 < len(tokens):
        value = tokens[i + 1]
        i += 2
    else:
        raise LaunchError(f"{FLAG} needs a FILE (the dyn_plugin JSON config)")
    if not value:
        raise LaunchError(f"{FLAG} needs a FILE (the dyn_plugin JSON config)")
    return value, i


def _is_flag(token: str) -> bool:
    return token == FLAG or token.startswith(FLAG + "=")


def split_argv(argv: list[str]) -> tuple[str, str, list[str]]:
    """``(config, script, script_args)`` from the launcher's argv, the flag stripped wherever it is.

    The launcher's part ends at the first ``--`` or the first argument not an option (the script);
    the flag is also accepted among the script's arguments, where users of Megatron-LM put it."""
    configs = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if _is_flag(token):
            value, i = _take_flag(argv, i)
            configs.append(value)
        elif token in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        elif token.startswith("-"):
            raise LaunchError(f"unknown launcher option {token!r} (only {FLAG}); put the script's options after it")
        else:
            break
    if i >= len(argv):
        raise LaunchError("no SCRIPT to run")
    script, rest = argv[i], argv[i + 1 :]
    script_args = []
    j = 0
    while j < len(rest):
        if _is_flag(rest[j]):
            value, j = _take_flag(rest, j)
            configs.append(value)
        else:
            script_args.append(rest[j])
            j += 1
    if not configs:
        raise LaunchError(f"{FLAG} FILE is required (the dyn_plugin JSON config)")
    if len(set(configs)) > 1:
        raise LaunchError(f"{FLAG} given more than once with different files: {', '.join(configs)}")
    return configs[0], script, script_args


def megatron_lm_installed() -> bool:
    """Whether Megatron-LM's ``megatron.training`` is importable (megatron-core's wheel lacks it)."""
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    """Apply the patches (configured by the config file), then run the script as ``__main__``."""
    try:
        config, script, script_args = split_argv(list(sys.argv[1:] if argv is None else argv))
    except LaunchError as exc:
        raise SystemExit(f"megatron_patches.launch: error: {exc}\n{USAGE}") from None
    if not os.path.isfile(config):
        raise SystemExit(f"megatron_patches.launch: error: {FLAG} {config}: no such file")
    if not os.path.exists(script):
        raise SystemExit(f"megatron_patches.launch: error: script {script}: no such file")
    config = os.path.abspath(config)

    import megatron_patches

    applied = megatron_patches.apply(config)
    logger.info("dyn_plugin: %d Megatron patches applied (config %s); running %s", len(applied), config, script)
    if megatron_lm_installed():
        script_args = [FLAG, config, *script_args]  # the patched parse_args accepts it: args.dyn_plugin_config

    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


if __name__ == "__main__":
    main()
