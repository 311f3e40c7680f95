"""``dynplugin report``: what is installed and active, like DeepSpeed's ds_report."""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import platform

HELP = "versions of the host frameworks, the C++ extension, apex, and the devices seen"

PACKAGES = ("torch", "deepspeed", "transformers", "megatron-core", "highspy", "redis", "pydantic", "numpy", "pybind11")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _apex() -> str:
    """NVIDIA apex as Megatron uses it: its fused optimizers and multi-tensor kernels (``amp_C``). The
    package named apex on the public index is unrelated and has neither."""
    if importlib.util.find_spec("apex") is None:
        return "absent (optional: Megatron falls back to its local kernels and torch optimizers)"
    if importlib.util.find_spec("amp_C") is None or importlib.util.find_spec("apex.multi_tensor_apply") is None:
        return "a package named apex that is not NVIDIA's (no amp_C / apex.multi_tensor_apply): not used"
    return "NVIDIA apex with fused kernels (amp_C): Megatron uses its fused optimizers and kernels"


def collect() -> dict:
    import dyn_plugin

    report = {
        "dyn_plugin": dyn_plugin.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {p: _version(p) for p in PACKAGES},
        "cpp_extension": "active" if dyn_plugin.native_available() else "not built (pure-Python path in use)",
        "apex": _apex(),
    }
    try:
        import torch

        devices = [f"cpu ({torch.get_num_threads()} threads)"]
        if torch.cuda.is_available():
            devices += [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
        report["devices"] = devices
        report["torch_cuda"] = torch.version.cuda or "none"
    except ImportError:
        report["devices"] = ["torch not installed"]
    return report


def run(args: argparse.Namespace) -> int:
    report = collect()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    width = 16
    print("-" * 60)
    print("dyn-plugin report")
    print("-" * 60)
    for key in ("dyn_plugin", "python", "platform", "cpp_extension", "apex", "torch_cuda"):
        if key in report:
            print(f"{key:<{width}} {report[key]}")
    print("packages:")
    for name, ver in report["packages"].items():
        print(f"  {name:<{width - 2}} {ver}")
    print("devices:")
    for d in report["devices"]:
        print(f"  {d}")
    return 0
