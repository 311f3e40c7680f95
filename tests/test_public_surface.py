"""The public surfaces: every name in ``__all__`` resolves, and ``import dyn_plugin`` stays light."""

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("package", ["dyn_plugin", "deepspeed_ext", "megatron_patches", "dyn_plugin.fsdp"])
def test_every_public_name_resolves(package):
    module = importlib.import_module(package)
    assert module.__all__, f"{package} declares no public surface"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"


def test_importing_the_package_does_not_import_torch():
    """The CLI and the pure planners start without torch; the re-exports load on first use."""
    code = "import sys, dyn_plugin; assert 'torch' not in sys.modules, 'torch imported'; dyn_plugin.load_config"
    subprocess.run([sys.executable, "-c", code], check=True)
