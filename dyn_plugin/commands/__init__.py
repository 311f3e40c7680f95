"""Subcommands of the ``dynplugin`` console script.

Each module here exposes ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
``add_arguments`` must stay cheap: heavy imports (torch, transformers) belong inside ``run``.
"""
