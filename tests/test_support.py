"""The support table (dyn_plugin/host/support.py, issue 38): what each host runs of the plugin's
features, checked by one call in each host at start, every refusal worded once, and the README's
table its rendering."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dyn_plugin.config import ConfigError, load_config
from dyn_plugin.host import support

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- support-table:begin -->", "<!-- support-table:end -->"


def run(zero: int = 0, encoder_decoder: bool = False, **plugin) -> support.Run:
    return support.Run(load_config({"dyn_plugin": plugin}).plugin, zero, encoder_decoder)


def test_the_readme_table_is_the_support_table():
    text = (ROOT / "README.md").read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")
    assert block == support.render(), "regenerate it: PYTHONPATH=. .venv/bin/python -m dyn_plugin.host.support"


def test_every_asked_feature_a_host_does_not_run_is_refused_at_once():
    asked = run(sequence_parallel={"enabled": True}, microbatching={"method": "packing_varlen"})
    with pytest.raises(ConfigError) as refused:
        support.check("FSDP2", asked)
    lines = str(refused.value).splitlines()
    assert lines[0].startswith("sequence_parallel.enabled on FSDP2: the FSDP entry trains data-parallel only; ")
    assert lines[1].startswith("microbatching.method 'packing_varlen' on FSDP2: sharded training needs")
    support.check("DeepSpeed", asked)  # DeepSpeed runs both (ZeRO 0-1)


def test_conditions_refuse_where_they_fail():
    sharded = dict(sharding={"enabled": True})
    support.check("DeepSpeed", run(3, **sharded))
    with pytest.raises(ConfigError, match="only under ZeRO-3; set zero_optimization.stage to 3"):
        support.check("DeepSpeed", run(1, **sharded))
    with pytest.raises(ConfigError, match="sharding.host to 'zero3' or 'auto'"):
        support.check("DeepSpeed", run(3, sharding={"enabled": True, "host": "fsdp2"}))
    with pytest.raises(ConfigError, match="pipeline engine supports ZeRO stages 0 and 1 only"):
        support.check("DeepSpeed pipeline", run(2, pipeline={"stages": 2}))
    with pytest.raises(ConfigError, match="T5 under Megatron is not built"):
        support.check("megatron-core", run(encoder_decoder=True))


def test_a_late_refusal_takes_the_tables_words():
    error = support.refusal("encoder-decoder (input, target) pairs", "Megatron-LM")
    assert str(error).startswith("an encoder-decoder model on Megatron-LM: T5 under Megatron is not built")
    with pytest.raises(ValueError, match="DeepSpeed runs"):
        support.refusal("encoder-decoder (input, target) pairs", "DeepSpeed")


@pytest.mark.parametrize(
    "path, host",
    [
        ("deepspeed_ext/engine.py", "DeepSpeed"),
        ("dyn_plugin/fsdp/engine.py", "FSDP"),
        ("megatron_patches/runtime.py", "megatron-core"),
        ("megatron_patches/arguments.py", "Megatron-LM"),
    ],
)
def test_each_host_checks_the_table_with_one_call(path, host):
    calls = re.findall(r"support\.check\(", (ROOT / path).read_text())
    assert len(calls) == 1, f"{path} should check the support table once, at start ({len(calls)} calls)"
