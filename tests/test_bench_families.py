"""``dynplugin bench families``: every family's tiny model builds, is priced through its own shape
from a profile of another, and is measured (what it measures is recorded in BENCHMARKS.md; no
timing is asserted here)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dyn_plugin.bench.families import FAMILIES, family_config
from dyn_plugin.cli import main
from dyn_plugin.cost.profile import save_profile
from dyn_plugin.cost.shape import shape_from_config
from dyn_plugin.models.hf import PRESETS, hf_config
from dyn_plugin.profiling.profiler import ProfileRun, run_profile
from dyn_plugin.profiling.workload import ProfileGrid

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    grid = ProfileGrid(seq_lens=(16, 64), micro_batch_sizes=(1, 2), max_tokens=128, recomputes=("none",), repeats=1)
    profile = run_profile(PRESETS["tiny-llama"], ProfileRun(name="tiny-llama", grid=grid, validate=0, progress=False))
    path = tmp_path_factory.mktemp("families") / "profile.json"
    save_profile(profile, path)
    return path


def test_the_profile_records_the_shape_it_measured(profile_path):
    raw = json.loads(profile_path.read_text())
    assert raw["version"] == 5
    assert raw["model"]["shape"] == shape_from_config(hf_config(PRESETS["tiny-llama"])).model_dump()


def test_the_families_differ_from_llama_in_their_own_structure():
    llama = shape_from_config(hf_config(family_config("llama")))
    for family in FAMILIES:
        shape = shape_from_config(hf_config(family_config(family)))
        assert (shape.hidden_size, shape.num_layers, shape.num_heads, shape.vocab_size) == (128, 4, 4, 8192), family
    assert shape_from_config(hf_config(family_config("gpt_neox"))).num_kv_heads is None  # no key left over
    assert shape_from_config(hf_config(family_config("gemma2"))).query_width == 2 * llama.query_width
    assert shape_from_config(hf_config(family_config("mixtral"))).experts_per_token == 2


def test_bench_families_prices_each_family_by_its_shape(profile_path, capsys):
    args = ["bench", "families", "--profile", str(profile_path), "--families", "llama,mixtral,gpt2"]
    assert main(args + ["--seq-len", "64", "--micro-batch-size", "2", "--warmup", "0", "--repeats", "1", "--json"]) == 0
    rows = {r["family"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"llama", "mixtral", "gpt2"}
    assert all(r["measured_ms"] > 0 and sum(r["seq_lens"]) == 128 for r in rows.values())
    # the profile's own shape: priced as the profile prices it
    assert rows["llama"]["predicted_ms"] == pytest.approx(rows["llama"]["profile_as_is_ms"], rel=1e-12)
    # two experts per token cost more, no gate less: shown on a profile of known positive coefficients,
    # since a one-repeat profile measured on a loaded machine can fit any sign at these sizes
    from dyn_plugin.cost.calibrated import calibrated_cost_model
    from dyn_plugin.cost.profile import cost_model_from_profile
    from test_profile import make_profile, synthetic_samples

    profile = make_profile(synthetic_samples())
    llama = shape_from_config(hf_config(family_config("llama")))
    profile = profile.model_copy(update={"model": profile.model.model_copy(update={"shape": llama})})
    reference = replace(cost_model_from_profile(profile), allow_extrapolation=True)
    lens = [1024] * 4

    def priced(family):
        shape = shape_from_config(hf_config(family_config(family)))
        cost = calibrated_cost_model(shape, reference=reference, reference_shape=llama)
        return cost.micro_batch_cost(lens, layout="packed").time_ms

    as_is = reference.micro_batch_cost(lens, layout="packed").time_ms
    assert priced("llama") == pytest.approx(as_is, rel=1e-12)
    assert priced("mixtral") > as_is > priced("gpt2")


def test_a_profile_without_a_shape_or_an_unknown_family_is_refused(profile_path, tmp_path, capsys):
    raw = json.loads(profile_path.read_text())
    raw["model"]["shape"] = None
    del raw["sha256"]  # edited on purpose: without its checksum, as the refusal of a damaged profile says
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    assert main(["bench", "families", "--profile", str(old)]) == 2
    assert "records no model shape" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # refused while the command line is read
        main(["bench", "families", "--profile", str(profile_path), "--families", "llama,bert"])
    assert exit.value.code == 2 and "'bert': expected names among llama" in capsys.readouterr().err
