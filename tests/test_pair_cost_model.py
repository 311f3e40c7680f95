"""An encoder-decoder's cost model named by the config alone (``cost_model.profile``: tables of
pairs), checked against the model trained as a decoder-only profile is: exact or refused."""

import copy
import json
import logging

import pytest

from dyn_plugin.config import CostModelConfig
from dyn_plugin.cost.bundled import MEASURED_DIR
from dyn_plugin.cost.encoder_decoder import EncoderDecoderCostModel
from dyn_plugin.cost.from_config import pair_cost_model
from dyn_plugin.models.hf import PRESETS, hf_config

A100_T5 = json.loads((MEASURED_DIR / "a100-t5-11b.json").read_text())


def tiny_t5(**overrides):
    return hf_config({**PRESETS["tiny-t5"], **overrides})


def profile_of(tmp_path, model: dict, dtype: str = "fp32") -> str:
    """Tables of pairs that record ``model`` (as `dynplugin profile --model tiny-t5` writes them)."""
    raw = copy.deepcopy(A100_T5)
    raw.update(dtype=dtype, model={"encoder_layers": 2, "decoder_layers": 2, "hidden_size": 64, "vocab_size": 8192})
    raw["model"]["config"] = model
    path = tmp_path / "t5-profile.json"
    path.write_text(json.dumps(raw))
    return str(path)


def config(profile: str, **kw) -> CostModelConfig:
    return CostModelConfig(kind="profile", profile=profile, **kw)


def test_tables_measured_on_the_model_price_it(tmp_path):
    cost = pair_cost_model(config(profile_of(tmp_path, PRESETS["tiny-t5"])), tiny_t5(), "fp32")
    assert isinstance(cost, EncoderDecoderCostModel) and cost.dtype == "fp32"
    assert (cost.encoder_layers, cost.decoder_layers, cost.hidden_size, cost.vocab_size) == (2, 2, 64, 8192)


@pytest.mark.parametrize(
    "trained, says",
    [({"d_ff": 512}, "d_ff 256 measured, 512 trained"), ({"num_decoder_layers": 3}, "num_decoder_layers 2 measured")],
)
def test_tables_of_another_model_are_refused_naming_what_differs(tmp_path, trained, says):
    with pytest.raises(ValueError, match="measured on another model") as refused:
        pair_cost_model(config(profile_of(tmp_path, PRESETS["tiny-t5"])), tiny_t5(**trained), "fp32")
    assert says in str(refused.value) and "dynplugin profile --model" in str(refused.value)


def test_bundled_a100_tables_price_the_model_trained_with_a_warning(caplog):
    model = hf_config({**PRESETS["tiny-t5"], "num_layers": 3, "num_decoder_layers": 5})
    with caplog.at_level(logging.WARNING):
        cost = pair_cost_model(config("a100-t5-11b"), model, "fp16")
    assert (cost.encoder_layers, cost.decoder_layers, cost.hidden_size, cost.dtype) == (3, 5, 64, "fp16")
    assert "records no model" in caplog.text and "unchecked" in caplog.text


@pytest.mark.parametrize(
    "cfg, dtype, says",
    [
        (CostModelConfig(kind="analytic"), "fp32", "no analytic model prices an encoder-decoder"),
        (config("nowhere.json"), "fp32", "no such file, and not bundled tables"),
        (config(str(MEASURED_DIR / "a100-gpt-6.7b.json")), "fp16", "no decoder tables of (input, target) pairs"),
        (config("a100-t5-11b"), "fp32", "measured in fp16, but the run trains in fp32"),
        (config("a100-t5-11b", dtype="bf16"), "fp16", "measured in fp16, but dyn_plugin.cost_model.dtype is bf16"),
    ],
)
def test_what_cannot_price_the_run_is_refused_naming_the_field_and_the_fix(cfg, dtype, says):
    with pytest.raises(ValueError) as refused:
        pair_cost_model(cfg, tiny_t5(), dtype)
    assert says in str(refused.value)
    assert "cost_model" in str(refused.value) and "dynplugin profile" in str(refused.value)


@pytest.mark.parametrize("name", ["a100-t5-11b", str(MEASURED_DIR / "a100-t5-11b.json")])
def test_tables_of_pairs_named_for_a_decoder_only_model_are_refused_as_such(name):
    from dyn_plugin.config import ClusterConfig
    from dyn_plugin.cost.from_config import build_cost_model

    with pytest.raises(ValueError, match="tables of an encoder-decoder's \\(input, target\\) pairs") as refused:
        build_cost_model(config(name), ClusterConfig())
    assert "a100-gpt-6.7b" in str(refused.value)
