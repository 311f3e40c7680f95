import argparse
import os
from types import ModuleType
from typing import Callable

import pytest

from dyn_plugin.cost.native import core

# the real redis-server fixtures (redis_server, fresh_redis_server), for every test module
pytest_plugins = ["redis_server"]

# `make test` (and so CI) sets this: there a missing C++ extension is a broken build, not a
# reason to skip its tests; users without a compiler still run everything else in Python.
REQUIRE_NATIVE = os.environ.get("DYN_PLUGIN_REQUIRE_NATIVE") == "1"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("native") is None or core is not None:
        return
    why = "the C++ extension dyn_plugin._core is not importable (build it: python setup.py build_ext --inplace)"
    if REQUIRE_NATIVE:
        pytest.fail(f"{why}; DYN_PLUGIN_REQUIRE_NATIVE=1 (set by `make test`) requires it", pytrace=False)
    pytest.skip(why)


@pytest.fixture
def run_command() -> Callable[[ModuleType, list[str]], int]:
    """``run(command_module, argv)``: one command alone, without ``cli.main``'s logging and error handling."""

    def run(command: ModuleType, argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.run(parser.parse_args(argv))

    return run
