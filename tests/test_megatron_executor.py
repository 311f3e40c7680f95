"""The split backward inside megatron-core (``megatron_patches.split_linear``) and what the plugin's
Megatron executor refuses (``megatron_patches.plan_executor.check_model``). The executor running
whole steps against Megatron's own training is checked in tests/test_megatron_lm.py
(``pretrain_gpt.py``, PP=2 and TP2 x PP2) and tests/test_megatron_training.py (megatron-core's loop).
"""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("megatron.core")

import torch

from dyn_plugin.config import ConfigError
from megatron_in_process import VOCAB, config, gpt, in_process
from megatron_patches.plan_executor import check_model
from megatron_patches.split_linear import megatron_split


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with in_process():
        yield


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    return model(tokens, positions, None, labels=tokens).sum()


def test_i_then_w_gives_the_whole_backwards_gradients_through_the_hooks(megatron):
    """A micro-batch's forward and I under ``deferring`` leave the tensor-parallel linear layers'
    weights without a gradient (W's work) and the rest with theirs; W completes them, equal to one
    whole backward's, each accumulated through autograd (its post-accumulate hook fires, as Megatron
    DDP's gradient hooks must), and leaves nothing pending. Two micro-batches' W's stay apart."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    model = gpt()
    tokens = [torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    for t in tokens:
        _loss(model, t).backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    linears = {
        f"{n}.weight" for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    }
    assert linears, "the tiny GPT has tensor-parallel linear layers"
    fired: list[str] = []
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, n=n: fired.append(n))
    split = megatron_split(model)
    for mb, t in enumerate(tokens):
        with split.deferring(mb):
            _loss(model, t).backward()  # I
    for n, p in model.named_parameters():
        assert (p.grad is None) == (n in linears), n
    split.weights(1)
    split.weights(0)
    assert not split.pending
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, whole[n], rtol=1e-6, atol=1e-7, msg=n)
    assert set(fired) == set(whole), set(whole) - set(fired)


def test_outside_deferring_the_layers_run_megatrons_own_backward(megatron):
    model = gpt()
    megatron_split(model)
    t = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    _loss(model, t).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert not megatron_split(model).pending


def test_what_a_split_cannot_defer_is_refused_by_name(megatron):
    check_model(gpt())  # megatron-core's local layers: runs

    fused = gpt()
    fused.config = config(gradient_accumulation_fusion=True)
    with pytest.raises(ConfigError, match="--no-gradient-accumulation-fusion"):
        check_model(fused)

    class FusedLinear(torch.nn.Module):  # a layer computing its own weight gradient (as TE's do)
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4, 4))

    foreign = gpt()
    foreign.decoder.layers[0].add_module("extra", FusedLinear())
    with pytest.raises(ConfigError, match="FusedLinear compute their weight gradients inside the backward"):
        check_model(foreign)
