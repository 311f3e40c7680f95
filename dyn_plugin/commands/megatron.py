"""``dynplugin megatron``: run a Megatron training script with the plugin's patches applied.

The work is done by ``python -m megatron_patches.launch`` (under ``torchrun`` for several
processes per node) in a child process: ``dyn_plugin`` never imports ``megatron_patches``
(the adapter depends on the planner, not the other way round), and the script's own exit, its
``sys.argv`` and its ``sys.path`` stay its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import subprocess
import sys

from ..cli_args import RANKS, input_file

HELP = (
    "run a Megatron training script with the plugin's patches applied (python -m megatron_patches.launch, "
    "under torchrun for --nproc-per-node > 1)"
)

LAUNCHER = "megatron_patches.launch"

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dyn-plugin-config",
        metavar="FILE",
        required=True,
        type=input_file,
        help="the run's JSON config (DeepSpeed-style, with a dyn_plugin section)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=RANKS,
        default=1,
        help="processes on this node; above 1 the script runs under torchrun (default %(default)s)",
    )
    parser.add_argument("script", help="the training script (e.g. Megatron-LM's pretrain_gpt.py)")
    parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments (after --)"
    )
    parser.epilog = "example: dynplugin megatron --dyn-plugin-config ds.json --nproc-per-node 8 -- pretrain_gpt.py ..."


def command(args: argparse.Namespace) -> list[str]:
    """The child's command line."""
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node {args.nproc_per_node}: at least 1")
    launch = [
        LAUNCHER,
        "--dyn-plugin-config",
        os.path.abspath(args.dyn_plugin_config),
        "--",
        args.script,
        *args.script_args,
    ]
    if args.nproc_per_node > 1:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(args.nproc_per_node),
            "-m",
            *launch,
        ]
    return [sys.executable, "-m", *launch]


def _child_env() -> dict[str, str]:
    """The environment with ``megatron_patches``'s folder on PYTHONPATH (it may be found only from here)."""
    spec = importlib.util.find_spec("megatron_patches")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the megatron_patches package is not installed (pip install dyn-plugin[megatron])")
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run(args: argparse.Namespace) -> int:
    from ..config import load_config

    load_config(args.dyn_plugin_config)  # a broken config is refused here, not in every rank's traceback
    if not os.path.isfile(args.script):
        raise FileNotFoundError(f"script {args.script}: no such file")
    cmd = command(args)
    env = _child_env()
    logger.info("running %s", " ".join(cmd))
    return subprocess.call(cmd, env=env)
