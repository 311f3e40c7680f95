import json

import pytest
from pydantic import ValidationError

from dyn_plugin.config import ConfigError, DynPluginConfig, load_config


def errors_of(section: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "dyn_plugin": section})
    return str(info.value)


def test_defaults_and_deepspeed_keys_handed_on():
    cfg = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2}})
    assert cfg.plugin == DynPluginConfig()
    assert cfg.deepspeed == {"train_batch_size": 8, "zero_optimization": {"stage": 2}}
    assert cfg.zero_stage == 2


def test_example_config_loads(tmp_path):
    cfg = load_config("examples/ds_config.json")
    assert cfg.plugin.microbatching.global_tokens == 16384
    assert "dyn_plugin" not in cfg.deepspeed and cfg.deepspeed["zero_optimization"] == {"stage": 1}


def test_misspelled_key_suggests_closest():
    msg = errors_of({"microbatching": {"global_tokns": 100}})
    assert "dyn_plugin.microbatching.global_tokns: unknown key; did you mean 'global_tokens'?" in msg


def test_misspelled_section_suggests_closest():
    msg = errors_of({"pipline": {"stages": 2}})
    assert "dyn_plugin.pipline" in msg and "did you mean 'pipeline'?" in msg


def test_unknown_key_without_near_match_lists_valid_keys():
    msg = errors_of({"cluster": {"zzz": 1}})
    assert "unknown key (valid keys here: devices_per_node, num_nodes, device" in msg


def test_nested_unknown_key():
    msg = errors_of({"cluster": {"device": {"memory_gb": 40}}})
    assert "dyn_plugin.cluster.device.memory_gb" in msg and "did you mean 'memory_mb'?" in msg


def test_out_of_range_names_field_value_and_bound():
    msg = errors_of({"microbatching": {"global_tokens": -5}})
    assert "dyn_plugin.microbatching.global_tokens = -5: Input should be greater than 0" in msg


def test_wrong_type_names_field_and_value():
    msg = errors_of({"cluster": {"device": {"memory_mb": "lots"}}})
    assert "dyn_plugin.cluster.device.memory_mb = 'lots'" in msg and "valid number" in msg


def test_bad_choice_lists_allowed_values():
    msg = errors_of({"pipeline": {"schedule": "gpipe"}})
    assert "dyn_plugin.pipeline.schedule = 'gpipe'" in msg and "'1f1b', 'adaptive', 'auto' or 'zero_bubble'" in msg


def test_fraction_bounds():
    assert "less than or equal to 1" in errors_of({"cluster": {"device": {"memory_fraction": 1.5}}})


def test_cross_field_checks():
    assert "layers_per_stage has 1 entries but stages = 2" in errors_of(
        {"pipeline": {"stages": 2, "layers_per_stage": [4]}}
    )
    assert "needs 'profile'" in errors_of({"cost_model": {"kind": "profile"}})
    shape = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 128, "vocab_size": 100}
    assert "exceeds cost_model.model.num_layers = 2" in errors_of(
        {"cost_model": {"model": shape}, "pipeline": {"stages": 4}}
    )
    assert "divisible by num_heads" in errors_of({"cost_model": {"model": {**shape, "num_heads": 3}}})


def test_every_problem_reported_at_once():
    msg = errors_of({"pipeline": {"stages": 0}, "microbatching": {"layout": "tight"}})
    assert "pipeline.stages = 0" in msg and "microbatching.layout = 'tight'" in msg


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    dup = tmp_path / "dup.json"
    dup.write_text('{"train_batch_size": 1, "train_batch_size": 2}')
    with pytest.raises(ConfigError, match="duplicate key"):
        load_config(dup)
    section = tmp_path / "section.json"
    section.write_text(json.dumps({"dyn_plugin": [1, 2]}))
    with pytest.raises(ConfigError, match="must be an object"):
        load_config(section)


@pytest.mark.parametrize(
    "section,path,fix",
    [
        ({"microbatching": {"pad_multiple": "8"}}, "dyn_plugin.microbatching.pad_multiple = '8'", "JSON integer"),
        ({"microbatching": {"global_tokens": 8.0}}, "dyn_plugin.microbatching.global_tokens = 8.0", "JSON integer"),
        ({"microbatching": {"truncate": "true"}}, "dyn_plugin.microbatching.truncate = 'true'", "true or false"),
        ({"microbatching": {"truncate": 1}}, "dyn_plugin.microbatching.truncate = 1", "true or false"),
        ({"cluster": {"device": {"memory_mb": "2000"}}}, "dyn_plugin.cluster.device.memory_mb = '2000'", "JSON number"),
        ({"store": {"backend": "tcp", "port": "29500"}}, "dyn_plugin.store.port = '29500'", "JSON integer"),
    ],
)
def test_strings_for_numbers_and_bools_are_refused_not_coerced(section, path, fix):
    msg = errors_of(section)
    assert path in msg and fix in msg, msg


def test_numbers_stay_accepted_where_numbers_are_wanted():
    cfg = load_config({"dyn_plugin": {"cluster": {"device": {"memory_mb": 2000}}, "microbatching": {"truncate": True}}})
    assert cfg.plugin.cluster.device.memory_mb == 2000.0 and cfg.plugin.microbatching.truncate is True


@pytest.mark.parametrize("key", ["dyn_plugn", "dynplugin", "dyn-plugin", "Dyn_Plugin", "dyn_plugins"])
def test_misspelled_top_level_section_warns_with_the_valid_name(key, caplog):
    with caplog.at_level("WARNING", logger="dyn_plugin.config"):
        cfg = load_config({"train_batch_size": 8, key: {"pipeline": {"stages": 2}}})
    assert cfg.plugin == DynPluginConfig()  # still not read: the warning is the only trace
    assert f"top-level key '{key}'" in caplog.text and "did you mean 'dyn_plugin'?" in caplog.text


def test_deepspeed_keys_do_not_look_like_the_plugin_section(caplog):
    import deepspeed.runtime.constants as ds
    import deepspeed.runtime.zero.config as zero

    keys = {
        v for m in (ds, zero) for k, v in vars(m).items() if k.isupper() and isinstance(v, str) and v.isidentifier()
    }
    assert {"train_batch_size", "zero_optimization", "bf16", "gradient_accumulation_steps"} <= keys
    with caplog.at_level("WARNING", logger="dyn_plugin.config"):
        load_config({**{k: None for k in keys}, "dyn_plugin": {}})
    assert caplog.text == ""


def test_strategy_section_refusals_name_the_fields_and_the_fix():
    assert "strategy.enabled needs sequence_parallel.enabled = true" in errors_of({"strategy": {"enabled": True}})
    on = {"sequence_parallel": {"enabled": True}, "strategy": {"enabled": True}}
    msg = errors_of({**on, "microbatching": {"method": "token_budget"}})
    assert "strategy.enabled with microbatching.method = 'token_budget'" in msg and "set method to 'dynapipe'" in msg
    ilp = {"stage2": "ilp", "ilp_time_budget_ms": 50.0}
    msg = errors_of({**on, "strategy": {"enabled": True, **ilp}})
    assert "strategy.ilp_time_budget_ms needs a store (store.backend 'tcp' or 'redis')" in msg
    assert "strategy.ilp_node_limit" in msg  # the deterministic alternative
    msg = errors_of({"strategy": {"ilp_node_limit": 100}})
    assert "dyn_plugin.strategy: 'ilp_node_limit' is only used by stage2 'ilp' but stage2 is 'dp'" in msg
    assert "dyn_plugin.strategy.max_strategies = 0" in errors_of({"strategy": {"max_strategies": 0}})
    cfg = load_config(
        {
            "dyn_plugin": {
                **on,
                "strategy": {"enabled": True, **ilp},
                "store": {"backend": "redis", "url": "redis://localhost:6379/0"},
            }
        }
    )
    assert cfg.plugin.strategy.ilp_time_budget_ms == 50.0 and cfg.plugin.strategy.proposal is None


@pytest.mark.parametrize(
    "section, key, registry",
    [
        ("microbatching", "method", "dyn_plugin.plan.methods.registry:METHODS"),
        ("pipeline", "schedule", "dyn_plugin.plan.steps.schedule:SCHEDULES"),
        ("store", "backend", "dyn_plugin.store.factory:BACKENDS"),
    ],
)
def test_config_names_are_the_registries(section, key, registry):
    """The config (which imports no other layer) lists each registry's names in a Literal: adding an
    entry to a registry means adding its name there too, and this says so."""
    import importlib
    import typing

    module, _, name = registry.partition(":")
    names = getattr(importlib.import_module(module), name)
    field = type(getattr(DynPluginConfig(), section)).model_fields[key]
    assert set(typing.get_args(field.annotation)) == set(names), (
        f"dyn_plugin.config: {section}.{key} allows {typing.get_args(field.annotation)}, {registry} has {tuple(names)}"
    )


def test_plans_keep_the_measured_margin_of_the_allocator_in_use(monkeypatch):
    from dyn_plugin.config import CACHING_ALLOCATOR_MARGIN, EXPANDABLE_SEGMENTS_MARGIN, DeviceSpec

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    device = DeviceSpec(memory_mb=72000, memory_fraction=0.9)
    assert device.margin == CACHING_ALLOCATOR_MARGIN == 0.065
    assert device.plannable_mb == pytest.approx(72000 * 0.9 / 1.065)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6, expandable_segments:True")
    assert device.margin == EXPANDABLE_SEGMENTS_MARGIN == 0.01
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert device.margin == CACHING_ALLOCATOR_MARGIN
    assert DeviceSpec(memory_mb=72000, allocator_margin=0.2).margin == 0.2  # a stated margin wins
    with pytest.raises(ValidationError):
        DeviceSpec(allocator_margin=-0.1)


def test_the_planner_fills_the_plannable_memory_only():
    from dyn_plugin.cost.bundled import load_bundled
    from dyn_plugin.cost.profile import cost_model_from_profile
    from dyn_plugin.plan.steps.spec import planner_spec

    cost = cost_model_from_profile(load_bundled("a100-gpt-6.7b"))
    cfg = DynPluginConfig.model_validate(
        {"pipeline": {"stages": 4}, "cluster": {"device": {"memory_mb": 72000, "memory_fraction": 1.0}}}
    )
    spec = planner_spec(cost, cfg, dp=2, zero_stage=1)
    for mem in spec.memory:
        assert mem.budget + mem.states == pytest.approx(cfg.cluster.device.plannable_mb * 2**20)
