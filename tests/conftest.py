import argparse
from types import ModuleType
from typing import Callable

import pytest


@pytest.fixture
def run_command() -> Callable[[ModuleType, list[str]], int]:
    """``run(command_module, argv)``: one command alone, without ``cli.main``'s logging and error handling."""

    def run(command: ModuleType, argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.run(parser.parse_args(argv))

    return run
