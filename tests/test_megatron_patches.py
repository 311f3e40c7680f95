"""The Megatron patch registry, the command-line patches of Megatron-LM and the launcher.

The registry is tested on throwaway modules (a defining module and one that from-imported its
function), so that applying, idempotence and an exact revert are seen on every kind of binding;
the CPU shims once on the real torch and megatron-core. Megatron-LM (``megatron.training``) is not
installed here: a fake of its ``arguments`` module, mimicking its ``parse_args`` and
``validate_args``, stands in.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import types

import pytest

import megatron_patches
from dyn_plugin.cli import main as cli_main
from dyn_plugin.commands import megatron as megatron_command
from megatron_patches import launch
from megatron_patches.arguments import arguments_patches
from megatron_patches.registry import MARKER, Patch, Registry, UnsupportedVersion

VERSION = "0.16.1"  # a supported megatron-core version, so the fake targets need no megatron import


# --------------------------------------------------------------------------- fake targets


@pytest.fixture
def fake(monkeypatch):
    """A module ``dp_fake_target`` (a function, a base class and a subclass) and ``dp_fake_user``,
    which did ``from dp_fake_target import greet``."""
    target = types.ModuleType("dp_fake_target")

    def greet():
        return "hello"

    class Base:
        def inherited(self):
            return "base"

    class Sub(Base):
        def own(self):
            return "sub"

    target.greet, target.Base, target.Sub = greet, Base, Sub
    user = types.ModuleType("dp_fake_user")
    user.greet = target.greet
    monkeypatch.setitem(sys.modules, "dp_fake_target", target)
    monkeypatch.setitem(sys.modules, "dp_fake_user", user)
    return types.SimpleNamespace(target=target, user=user, greet=greet, Base=Base, Sub=Sub)


def _counting(result):
    """A ``make`` that counts its calls; the replacement returns ``result``."""

    def make(original):
        make.calls += 1
        return lambda *a, **k: result

    make.calls = 0
    return make


def test_applying_twice_equals_once(fake):
    make = _counting("patched")
    registry = Registry()
    registry.register(Patch("greet", "dp_fake_target.greet", make))
    assert registry.apply(version=VERSION) == ["greet"]
    replacement = fake.target.greet
    assert replacement is not fake.greet and fake.user.greet is replacement and replacement() == "patched"
    assert registry.apply(version=VERSION) == []
    assert fake.target.greet is replacement and fake.user.greet is replacement and make.calls == 1
    # another registry of the same process sees the marker and leaves it in place
    other = Registry()
    other.register(Patch("greet", "dp_fake_target.greet", make))
    assert other.apply(version=VERSION) == [] and make.calls == 1 and fake.target.greet is replacement
    assert registry.revert() == ["greet"]
    assert fake.target.greet is fake.greet and fake.user.greet is fake.greet


def test_revert_restores_every_binding(fake):
    registry = Registry()
    registry.register(Patch("greet", "dp_fake_target.greet", _counting("patched")))
    registry.register(Patch("own", "dp_fake_target.Sub.own", lambda orig: lambda self: "own:" + orig(self)))
    registry.register(
        Patch("inherited", "dp_fake_target.Sub.inherited", lambda orig: lambda self: "over:" + orig(self))
    )
    own = fake.Sub.__dict__["own"]
    assert registry.apply(version=VERSION) == ["greet", "own", "inherited"]
    assert fake.user.greet() == "patched"
    assert fake.Sub().own() == "own:sub" and fake.Sub().inherited() == "over:base"
    assert fake.Base().inherited() == "base"  # the base class is untouched
    assert getattr(fake.Sub.__dict__["inherited"], MARKER) == "inherited"

    assert registry.revert() == ["inherited", "own", "greet"]
    assert registry.applied == []
    assert fake.target.greet is fake.greet and fake.user.greet is fake.greet
    assert fake.Sub.__dict__["own"] is own
    assert "inherited" not in fake.Sub.__dict__ and fake.Sub.inherited is fake.Base.inherited
    assert fake.Sub().own() == "sub" and fake.Sub().inherited() == "base"
    assert registry.revert() == []
    # and it applies again after a revert
    assert registry.apply(version=VERSION) == ["greet", "own", "inherited"]
    registry.revert()


def test_revert_reaches_modules_imported_while_patched(fake, monkeypatch):
    registry = Registry()
    registry.register(Patch("greet", "dp_fake_target.greet", _counting("patched")))
    registry.apply(version=VERSION)
    late = types.ModuleType("dp_fake_late")
    late.greet = fake.target.greet  # ``from dp_fake_target import greet`` while the patch is on
    monkeypatch.setitem(sys.modules, "dp_fake_late", late)
    registry.revert()
    assert late.greet is fake.greet


def test_a_version_outside_the_range_is_refused(fake):
    registry = Registry()
    registry.register(Patch("greet", "dp_fake_target.greet", _counting("patched"), versions=">=0.16,<0.17"))
    for refuse in (
        lambda: registry.apply(version="0.15.0"),
        lambda: registry.check_version("0.15.0"),
        lambda: registry.check_version("0.17.0"),
    ):
        with pytest.raises(UnsupportedVersion) as err:
            refuse()
        assert ">=0.16,<0.17" in str(err.value) and ("0.15.0" in str(err.value) or "0.17.0" in str(err.value))
    assert fake.target.greet is fake.greet and registry.applied == []  # nothing was applied
    registry.check_version(VERSION)
    registry.check_version()  # the installed megatron-core


def test_an_absent_optional_target_is_skipped(monkeypatch):
    # a package that imports but lacks the submodule (``megatron`` without ``megatron.training``)
    package = types.ModuleType("dp_fake_pkg")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "dp_fake_pkg", package)
    for target in ("dp_absent_pkg.mod.func", "dp_fake_pkg.training.arguments.parse_args"):
        registry = Registry()
        registry.register(Patch("optional", target, _counting(None), optional=True))
        assert registry.apply(version=VERSION) == [] and registry.applied == []
        registry = Registry()
        registry.register(Patch("required", target, _counting(None)))
        with pytest.raises(ModuleNotFoundError):
            registry.apply(version=VERSION)


def test_a_missing_attribute_is_an_error_even_when_optional(fake):
    registry = Registry()
    registry.register(Patch("gone", "dp_fake_target.no_such_function", _counting(None), optional=True))
    with pytest.raises(AttributeError, match="no_such_function"):
        registry.apply(version=VERSION)


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is not None, reason="Megatron-LM is installed")
def test_the_arguments_patches_are_skipped_without_megatron_lm():
    registry = Registry()
    for p in arguments_patches():
        registry.register(p)
    assert registry.apply() == []


def test_the_cpu_patches_apply_and_revert_on_the_real_packages():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("the CPU shims apply only without CUDA")
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random

    from megatron_patches.cpu import cpu_patches, stub_triton_kernels
    from megatron_patches.launch import megatron_lm_installed

    if getattr(torch.cuda.current_device, MARKER, None):
        pytest.skip("the CPU shims were applied earlier in this process")
    originals = {
        "current_device": torch.cuda.current_device,
        "synchronize": torch.cuda.synchronize,
        "get_rng_state": torch.cuda.get_rng_state,
        "manual_seed": torch.cuda.manual_seed,
    }
    rng = tp_random._get_cuda_rng_state
    registry = Registry()
    for p in cpu_patches():
        registry.register(p)
    stub_triton_kernels()  # as megatron_patches.apply does: megatron.training imports a triton module
    tensor_cuda, module_cuda = torch.Tensor.cuda, torch.nn.Module.cuda
    applied = registry.apply()
    # the shims of Megatron-LM's own modules are optional: applied where megatron.training is importable
    expected = [p.name for p in cpu_patches() if not p.optional or megatron_lm_installed()]
    assert applied == expected and registry.apply() == []
    assert torch.ones(2).cuda().device.type == "cpu" and torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    assert torch.cuda.current_device() == "cpu"
    assert schedules.torch is not torch and schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    assert isinstance(tp_random._get_cuda_rng_state(), torch.Tensor)

    assert registry.revert() == applied[::-1]
    assert {name: getattr(torch.cuda, name) for name in originals} == originals
    assert schedules.torch is torch and tp_random._get_cuda_rng_state is rng
    assert torch.Tensor.cuda is tensor_cuda and torch.nn.Module.cuda is module_cuda


# --------------------------------------------------------------------------- Megatron-LM's arguments


def _fake_arguments_module() -> types.ModuleType:
    """``megatron.training.arguments`` as far as the patches see it."""
    module = types.ModuleType("megatron.training.arguments")

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser.add_argument("--num-layers", type=int)
        parser.add_argument("--variable-seq-lengths", action="store_true")
        parser.add_argument("--calculate-per-token-loss", action="store_true")
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        if ignore_unknown_args:
            args, _ = parser.parse_known_args()
        else:
            args = parser.parse_args()
        args.variable_seq_lengths = False  # as Megatron-LM's validate_args does
        return args

    def validate_args(args, defaults=None):
        args.variable_seq_lengths = False
        return args

    module.parse_args, module.validate_args = parse_args, validate_args
    return module


@pytest.fixture
def megatron_lm(monkeypatch):
    """Fake ``megatron.training`` (+ ``.arguments`` and an ``.initialize`` that from-imported its
    functions) in sys.modules, and a fake ``megatron_patches.runtime`` recording ``configure``."""
    training = types.ModuleType("megatron.training")
    training.__path__ = []
    arguments = _fake_arguments_module()
    initialize = types.ModuleType("megatron.training.initialize")
    initialize.parse_args, initialize.validate_args = arguments.parse_args, arguments.validate_args
    training.arguments, training.initialize = arguments, initialize
    for name, module in (
        ("megatron.training", training),
        ("megatron.training.arguments", arguments),
        ("megatron.training.initialize", initialize),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    runtime = types.ModuleType("megatron_patches.runtime")
    runtime.configured = []
    runtime.configure = runtime.configured.append
    monkeypatch.setitem(sys.modules, "megatron_patches.runtime", runtime)
    monkeypatch.setattr(megatron_patches, "runtime", runtime, raising=False)
    return types.SimpleNamespace(
        arguments=arguments,
        initialize=initialize,
        runtime=runtime,
        originals=(arguments.parse_args, arguments.validate_args),
    )


@pytest.fixture
def patched(megatron_lm):
    registry = Registry()
    for p in arguments_patches():
        registry.register(p)
    assert registry.apply(version=VERSION) == ["arguments.parse_args", "arguments.validate_args"]
    yield megatron_lm
    registry.revert()
    assert (megatron_lm.arguments.parse_args, megatron_lm.arguments.validate_args) == megatron_lm.originals
    assert (megatron_lm.initialize.parse_args, megatron_lm.initialize.validate_args) == megatron_lm.originals


def test_the_patched_parse_args_accepts_the_flag_and_configures(patched, monkeypatch, caplog):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2", "--dyn-plugin-config", "x.json"])
    with caplog.at_level(logging.INFO, logger="megatron_patches.arguments"):
        args = patched.initialize.parse_args()  # the alias initialize_megatron calls
    assert args.dyn_plugin_config == "x.json" and args.num_layers == 2
    assert args.variable_seq_lengths and args.calculate_per_token_loss
    assert patched.runtime.configured == ["x.json"]
    assert "variable_seq_lengths" in caplog.text and "calculate_per_token_loss" in caplog.text
    # initialize_megatron validates next, and validate_args turns variable_seq_lengths off again
    args = patched.initialize.validate_args(args, {})
    assert args.variable_seq_lengths and args.calculate_per_token_loss


def test_the_scripts_own_provider_still_works(patched, monkeypatch):
    def provider(parser):
        parser.add_argument_group(title="script").add_argument("--my-flag", type=int, default=0)
        return parser

    monkeypatch.setattr(sys, "argv", ["s.py", "--my-flag", "3", "--dyn-plugin-config=y.json"])
    args = patched.arguments.parse_args(provider)
    assert args.my_flag == 3 and args.dyn_plugin_config == "y.json"
    monkeypatch.setattr(sys, "argv", ["s.py", "--unknown", "1"])
    args = patched.arguments.parse_args(extra_args_provider=provider, ignore_unknown_args=True)
    assert args.dyn_plugin_config is None and args.my_flag == 0 and args.variable_seq_lengths
    assert patched.runtime.configured == ["y.json"]  # no flag, no configure


def test_without_the_patch_the_flag_fails_parsing(megatron_lm, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--dyn-plugin-config", "x.json"])
    with pytest.raises(SystemExit):
        megatron_lm.arguments.parse_args()
    assert "--dyn-plugin-config" in capsys.readouterr().err and megatron_lm.runtime.configured == []


# --------------------------------------------------------------------------- the launcher


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--dyn-plugin-config", "c.json", "--", "s.py", "--lr", "1"], ("c.json", "s.py", ["--lr", "1"])),
        (["--dyn-plugin-config=c.json", "s.py", "x"], ("c.json", "s.py", ["x"])),
        (
            ["s.py", "--lr", "1", "--dyn-plugin-config", "c.json", "--seed=2"],
            ("c.json", "s.py", ["--lr", "1", "--seed=2"]),
        ),
        (
            ["--dyn-plugin-config", "c.json", "--", "s.py", "--", "--dyn-plugin-config=c.json"],
            ("c.json", "s.py", ["--"]),
        ),
        (["--dyn-plugin-config", "c.json", "s.py", "--", "-x"], ("c.json", "s.py", ["--", "-x"])),
    ],
)
def test_the_launcher_strips_its_flag(argv, expected):
    assert launch.split_argv(argv) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["s.py"], "--dyn-plugin-config FILE is required"),
        (["--dyn-plugin-config"], "--dyn-plugin-config needs a FILE"),
        (["--dyn-plugin-config", "c.json"], "no SCRIPT"),
        (["--dyn-plugin-config", "c.json", "--"], "no SCRIPT"),
        (["--nproc", "2", "s.py"], "unknown launcher option '--nproc'"),
        (["--dyn-plugin-config=a.json", "s.py", "--dyn-plugin-config=b.json"], "different files"),
    ],
)
def test_bad_launcher_arguments(argv, message):
    with pytest.raises(launch.LaunchError, match=message):
        launch.split_argv(argv)


@pytest.fixture
def script(tmp_path, monkeypatch):
    """A script printing what it sees as JSON, a config file, and a fake ``megatron_patches.apply``."""
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir()
    path.write_text(
        "import json, sys\n"
        "import megatron_patches\n"
        "print(json.dumps({'argv': sys.argv, 'applied': megatron_patches.apply.calls, 'path0': sys.path[0],\n"
        "                  'name': __name__}))\n"
    )
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"dyn_plugin": {}}))

    def apply(config=None):
        apply.calls.append(config)
        return ["fake"]

    apply.calls = []
    monkeypatch.setattr(megatron_patches, "apply", apply, raising=False)
    return types.SimpleNamespace(path=str(path), config=str(config))


def _run(argv, capsys) -> dict:
    saved = (list(sys.argv), list(sys.path))
    launch.main(argv)
    assert (sys.argv, sys.path) == saved  # restored after the script
    return json.loads(capsys.readouterr().out)


def test_the_launcher_applies_then_runs_the_script(script, monkeypatch, capsys):
    monkeypatch.setattr(launch, "megatron_lm_installed", lambda: False)
    seen = _run(["--dyn-plugin-config", script.config, "--", script.path, "--num-layers", "2", "--", "x"], capsys)
    assert seen == {
        "argv": [script.path, "--num-layers", "2", "--", "x"],
        "applied": [script.config],
        "path0": str(launch.os.path.dirname(script.path)),
        "name": "__main__",
    }
    seen = _run([script.path, f"--dyn-plugin-config={script.config}", "--lr", "1"], capsys)
    assert seen["argv"] == [script.path, "--lr", "1"]


def test_the_launcher_passes_the_flag_on_to_megatron_lm(script, monkeypatch, capsys):
    monkeypatch.setattr(launch, "megatron_lm_installed", lambda: True)
    seen = _run([f"--dyn-plugin-config={script.config}", script.path, "--lr", "1"], capsys)
    assert seen["argv"] == [script.path, "--dyn-plugin-config", script.config, "--lr", "1"]


def test_the_launcher_names_its_flag_when_the_config_is_missing(script, tmp_path):
    with pytest.raises(SystemExit) as err:
        launch.main(["--dyn-plugin-config", str(tmp_path / "nope.json"), script.path])
    assert "--dyn-plugin-config" in str(err.value) and "nope.json" in str(err.value)
    with pytest.raises(SystemExit, match="--dyn-plugin-config FILE is required"):
        launch.main([script.path])
    with pytest.raises(SystemExit, match="no such file"):
        launch.main(["--dyn-plugin-config", script.config, str(tmp_path / "missing.py")])
    assert megatron_patches.apply.calls == []


# --------------------------------------------------------------------------- dynplugin megatron


def test_dynplugin_megatron_help(capsys):
    with pytest.raises(SystemExit) as err:
        cli_main(["megatron", "--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert "--dyn-plugin-config" in out and "--nproc-per-node" in out and "torchrun" in out


def _command_args(argv):
    parser = argparse.ArgumentParser()
    megatron_command.add_arguments(parser)
    return parser.parse_args(argv)


def test_dynplugin_megatron_command_lines(tmp_path):
    config, script = tmp_path / "ds.json", tmp_path / "s.py"  # both checked to exist before launching
    config.write_text("{}")
    script.write_text("")
    one = megatron_command.command(_command_args(["--dyn-plugin-config", str(config), "--", str(script), "--lr", "1"]))
    assert one == [
        sys.executable,
        "-m",
        "megatron_patches.launch",
        "--dyn-plugin-config",
        str(config),
        "--",
        str(script),
        "--lr",
        "1",
    ]
    many = megatron_command.command(
        _command_args(["--dyn-plugin-config", str(config), "--nproc-per-node", "4", str(script), "--lr", "1"])
    )
    assert (
        many[:7]
        == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "-m", "megatron_patches.launch"]
        and many[7:] == one[3:]
    )


def test_dynplugin_megatron_missing_config_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:  # refused while the command line is read
        cli_main(["megatron", "--dyn-plugin-config", str(tmp_path / "nope.json"), "--", "s.py"])
    assert exit.value.code == 2 and "--dyn-plugin-config" in capsys.readouterr().err


def test_dynplugin_megatron_runs_the_launcher_and_returns_its_exit_code(tmp_path, monkeypatch):
    config, script = tmp_path / "ds.json", tmp_path / "s.py"
    config.write_text("{}")
    script.write_text("")
    calls = []
    monkeypatch.setattr(megatron_command.subprocess, "call", lambda cmd, env: calls.append((cmd, env)) or 3)
    assert cli_main(["megatron", "--dyn-plugin-config", str(config), "--", str(script), "--lr", "1"]) == 3
    ((cmd, env),) = calls
    assert cmd[1:3] == ["-m", "megatron_patches.launch"] and cmd[-3:] == [str(script), "--lr", "1"]
    root = launch.os.path.dirname(launch.os.path.dirname(launch.__file__))
    assert env["PYTHONPATH"].split(launch.os.pathsep)[0] == root
