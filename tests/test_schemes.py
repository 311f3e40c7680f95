"""Parallel schemes (tp, pp, sp): calibrated cost models of larger models, each scheme's longest
sequence and per-sequence times."""

from dataclasses import replace

import numpy as np
import pytest

from dyn_plugin.config import DynPluginConfig
from dyn_plugin.cost.calibrated import MODELS, calibrated_cost_model, named_cost_model
from dyn_plugin.plan.steps.pricing import make_micro_batch, usable
from dyn_plugin.plan.strategies.schemes import Scheme, scheme_costs, scheme_spec

MAX_LEN = 32768
CONFIG = DynPluginConfig.model_validate(
    {
        "cluster": {"devices_per_node": 8, "device": {"memory_mb": 36000, "memory_fraction": 1.0}},
        "microbatching": {"max_seq_len": MAX_LEN},
        "sequence_parallel": {"enabled": True, "sizes": [1, 2, 4, 8]},
    }
)
GPT = named_cost_model("gpt-6.7b")


@pytest.fixture(scope="module")
def costs_1024():
    return {sc.scheme: sc for sc in scheme_costs(GPT, CONFIG, gpus=1024)}


def model_flops(name: str, lens: list[int]) -> float:
    """Forward FLOPs of the whole model, written out here independently of the analytic model."""
    s = MODELS[name]
    h, f = s.hidden_size, s.ffn_hidden_size
    kv = h * (s.num_kv_heads or s.num_heads) // s.num_heads
    linear = 2 * (h * (h + 2 * kv) + h * h + h * f * (3 if s.gated_mlp else 2))
    return s.num_layers * (linear * sum(lens) + 2 * h * sum(x * x for x in lens)) + 2 * h * s.vocab_size * sum(lens)


def test_calibrating_the_reference_reproduces_the_measurements():
    same = calibrated_cost_model(MODELS["gpt-6.7b"], reference=GPT)
    assert same.tables == GPT.tables and same.params == GPT.params
    assert (same.num_layers, same.hidden_size, same.num_heads) == (GPT.num_layers, GPT.hidden_size, GPT.num_heads)
    assert set(named_cost_model("llama-32b").tables) == set(GPT.tables)  # nothing invented


@pytest.mark.parametrize("name, tolerance", [("llama-7b", 0.01), ("llama-13b", 0.05), ("llama-32b", 0.08)])
def test_time_per_token_follows_the_flops(name, tolerance):
    # short packed documents: the linear layers dominate, the measured per-micro-batch constants are small
    lens = [512] * 16
    cost = named_cost_model(name)
    ratio = cost.micro_batch_cost(lens, layout="packed").time_ms / GPT.micro_batch_cost(lens, layout="packed").time_ms
    assert ratio == pytest.approx(model_flops(name, lens) / model_flops("gpt-6.7b", lens), rel=tolerance)


def test_longest_is_exact_and_grows_with_every_degree(costs_1024):
    assert len(costs_1024) == 64
    for scheme, sc in costs_1024.items():
        for bigger in (
            Scheme(2 * scheme.tp, scheme.pp, scheme.sp),
            Scheme(scheme.tp, 2 * scheme.pp, scheme.sp),
            Scheme(scheme.tp, scheme.pp, 2 * scheme.sp),
        ):
            if bigger in costs_1024:
                assert all(costs_1024[bigger].by_mode[rc] >= n for rc, n in sc.by_mode.items()), (scheme, bigger)
    for scheme in (Scheme(1, 1, 1), Scheme(2, 2, 2), Scheme(8, 1, 4), Scheme(1, 4, 8)):
        sc = costs_1024[scheme]
        for rc, n in sc.by_mode.items():
            assert usable(
                make_micro_batch([0], [n], spec=sc.spec, layout=sc.layout, recompute=rc, sp=scheme.sp), sc.spec
            )
            if n < MAX_LEN:
                assert not usable(
                    make_micro_batch([0], [n + 1], spec=sc.spec, layout=sc.layout, recompute=rc, sp=scheme.sp), sc.spec
                )
    assert costs_1024[Scheme(8, 8, 8)].longest == MAX_LEN > costs_1024[Scheme(1, 1, 1)].longest


def alone(sc, n: int):
    """A micro-batch of one sequence in the first recompute mode it fits in, as sequence_ms prices it."""
    rc = next(rc for rc in sc.spec.recomputes if n <= sc.by_mode[rc])
    return make_micro_batch([0], [n], spec=sc.spec, layout=sc.layout, recompute=rc, sp=sc.scheme.sp), rc


def test_sequence_ms_is_the_marginal_cost(costs_1024):
    for scheme in (Scheme(1, 1, 1), Scheme(2, 1, 4), Scheme(4, 1, 2)):
        sc = costs_1024[scheme]
        # long enough per rank that no kernel sits on its table's floor (the fixed cost leaves floors out)
        wide = 2048 * scheme.sp
        lens = [
            n
            for n in sorted({wide, 3 * wide // 2, 2 * wide, 16384, sc.by_mode["none"] + 1, *sc.by_mode.values()})
            if wide <= n <= sc.longest
        ]
        assert len(lens) >= 3
        for n, t in zip(lens, sc.sequence_ms(lens)):
            mb, rc = alone(sc, n)
            assert t == pytest.approx(mb.time_ms - sc.fixed_by_mode[rc], rel=1e-9)
    piped = costs_1024[Scheme(1, 4, 1)]  # stages differ: the slowest stage's marginal, within its fixed cost
    mb, rc = alone(piped, 4096)
    assert 0 < mb.time_ms - piped.sequence_ms([4096])[0] <= piped.fixed_by_mode[rc] + 1e-9
    short = costs_1024[Scheme(1, 1, 1)]
    assert np.isinf(short.sequence_ms([short.longest + 1, MAX_LEN])).all()


def test_schemes_that_cannot_run_are_refused_or_skipped():
    llama = named_cost_model("llama-32b")
    with pytest.raises(ValueError, match=r"scheme tp1pp1sp1 .*model states.*larger tp or pp"):
        scheme_spec(llama, CONFIG, Scheme(1, 1, 1), gpus=64)
    with pytest.raises(ValueError, match=r"no tables at tp=16; use tp in \[1, 2, 4, 8\]"):
        scheme_spec(llama, CONFIG, Scheme(16, 1, 1), gpus=64)
    with pytest.raises(ValueError, match=r"12 query / 12 key-value heads do not divide by tp=8"):
        scheme_spec(replace(GPT, num_heads=12, num_kv_heads=12), CONFIG, Scheme(8, 1, 1), gpus=64)
    with pytest.raises(ValueError, match="must divide the cluster's 64"):
        scheme_spec(llama, CONFIG, Scheme(8, 8, 2), gpus=64)
    ulysses = CONFIG.model_copy(
        update={"sequence_parallel": CONFIG.sequence_parallel.model_copy(update={"attention": "ulysses"})}
    )
    with pytest.raises(ValueError, match="tp8pp1sp2 .* heads per tensor-parallel rank: .*do not divide by 2"):
        scheme_spec(llama, ulysses, Scheme(8, 1, 2), gpus=64)
    schemes = [sc.scheme for sc in scheme_costs(llama, CONFIG, gpus=64)]
    assert Scheme(1, 1, 1) not in schemes and Scheme(8, 2, 1) in schemes
    assert schemes == sorted(schemes, key=lambda s: (s.tp, s.pp, s.sp))


def test_scheme_costs_are_deterministic_and_the_cluster_shards_states():
    a = scheme_costs(GPT, CONFIG, gpus=64, tps=(2,), pps=(2,))
    b = scheme_costs(GPT, CONFIG, gpus=64, tps=(2,), pps=(2,))
    key = lambda runs: [(x.scheme, x.by_mode, x.fixed_ms, x.update_ms) for x in runs]  # noqa: E731
    assert key(a) == key(b)
    # ZeRO-1 over 1024 GPUs' data-parallel ranks leaves more room than over 64's
    big = {sc.scheme: sc.longest for sc in scheme_costs(GPT, CONFIG, gpus=1024, tps=(2,), pps=(2,))}
    assert all(big[x.scheme] >= x.longest for x in a) and big[Scheme(2, 2, 1)] > a[0].longest
    assert Scheme.from_json(Scheme(2, 4, 8).to_json()) == Scheme(2, 4, 8) and Scheme(2, 4, 8).gpus == 64


def test_named_cost_model():
    assert GPT.allow_extrapolation and GPT.num_heads == 32
    assert named_cost_model("llama-32b").num_kv_heads == 8
    with pytest.raises(ValueError, match="unknown model 'gpt-175b'; known: gpt-6.7b, llama-7b, llama-13b, llama-32b"):
        named_cost_model("gpt-175b")
