"""The start-up check (dyn_plugin/host/exactness.py, issue 37): what a host built is run against the
user's model on a few tokens before training, and what differs is refused, or planned around, by
name. Toy mixers stand for the families that mix tokens outside attention (a running mean that
crosses documents; one that keeps to its document but not to a sequence shard); MiniMax's linear
attention and Granite's and Cohere's multipliers are the real ones."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

from dyn_plugin.config import load_config
from dyn_plugin.host import exactness
from dyn_plugin.models.hf import build_causal_lm

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=0,
)
MINIMAX = dict(
    model_type="minimax",
    num_local_experts=4,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    head_dim=16,
    block_size=8,
)


def llama(**over) -> nn.Module:
    torch.manual_seed(0)
    return build_causal_lm({**TINY, "model_type": "llama", **over})


class RunningMean(nn.Module):
    """A token mixer outside attention: each position adds the mean of every position up to it, or,
    ``by_document``, of its own document's (reset where position ids restart), as a padding-free
    state-space layer does."""

    def __init__(self, mlp: nn.Module, positions: list, by_document: bool) -> None:
        super().__init__()
        self.mlp, self.positions, self.by_document = mlp, positions, by_document

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mixed = torch.zeros_like(hidden)
        starts = [0] + (torch.nonzero(self.positions[0][0] == 0).flatten()[1:].tolist() if self.by_document else [])
        for lo, hi in zip(starts, starts[1:] + [hidden.shape[1]]):
            part = hidden[:, lo:hi]
            mixed[:, lo:hi] = part.cumsum(1) / torch.arange(1, hi - lo + 1).view(1, -1, 1)
        return self.mlp(hidden) + mixed


def mixing(by_document: bool) -> nn.Module:
    model = llama()
    positions: list = []
    model.model.register_forward_pre_hook(lambda m, a, k: positions.insert(0, k["position_ids"]), with_kwargs=True)
    model.model.layers[1].mlp = RunningMean(model.model.layers[1].mlp, positions, by_document)
    return model


def config(**plugin) -> object:
    return load_config({"dyn_plugin": plugin})


def test_llama_is_exact_on_every_check():
    model = llama()
    assert exactness.packed_difference(model) is None
    assert exactness.padded_difference(model) is None
    assert exactness.sharded_difference(model) is None


def test_a_mixer_that_crosses_documents_is_found_and_named():
    found = exactness.packed_difference(mixing(by_document=False))
    assert found is not None and found.piece == "model.layers.1.mlp (RunningMean)", found
    assert found.relative > 1e-2 and found.check == "packed rows"


def test_a_mixer_that_keeps_to_its_document_is_found_by_the_sequence_shards():
    model = mixing(by_document=True)
    assert exactness.packed_difference(model) is None
    found = exactness.sharded_difference(model)
    assert found is not None and found.piece == "model.layers.1.mlp (RunningMean)", found


def test_minimax_is_refused_packed_and_sharded_and_planned_padded_under_auto(caplog):
    torch.manual_seed(0)
    model = build_causal_lm({**TINY, **MINIMAX})
    piece = re.escape("model.layers.0.self_attn (MiniMaxLightningAttention)")
    with pytest.raises(exactness.ExactnessError, match=rf"minimax \(MiniMaxForCausalLM\).*{piece}.*'padded' or 'auto'"):
        exactness.check_at_start(model, config(microbatching={"layout": "packed"}))
    with pytest.raises(exactness.ExactnessError, match=r"sequence parallelism splits documents.*sequence_parallel"):
        exactness.check_at_start(model, config(sequence_parallel={"enabled": True}))
    with caplog.at_level(logging.WARNING):
        cfg = exactness.check_at_start(model, config(microbatching={"layout": "auto"}))
    assert cfg.plugin.microbatching.layout == "padded" and re.search(piece, caplog.text)
    skipped = exactness.check_at_start(
        model, config(microbatching={"layout": "packed"}, start_check={"enabled": False})
    )
    assert skipped.plugin.microbatching.layout == "packed"  # the documented switch: no check, as asked


def test_a_model_built_with_transformers_default_attention_is_switched_to_the_plugins_kernel(caplog):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in TINY.items()}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **spec))
    assert model.config._attn_implementation == "sdpa"
    with caplog.at_level(logging.INFO):
        cfg = exactness.checked(model, config(microbatching={"layout": "packed"}))
    assert model.config._attn_implementation == "dyn_varlen" and cfg.plugin.microbatching.layout == "packed"
    assert "attended with 'sdpa'; switched to the plugin's per-document kernel" in caplog.text
    padded = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **spec))
    exactness.checked(padded, config(microbatching={"layout": "padded"}))
    assert padded.config._attn_implementation == "sdpa"  # padded rows need no switch: none is made


@pytest.mark.parametrize(
    "family, over",
    [
        (
            "granite",
            dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0),
        ),
        ("cohere", dict(logit_scale=0.5)),
    ],
)
def test_the_stages_do_what_the_family_does_around_its_layers_and_a_broken_builder_is_caught(family, over, monkeypatch):
    """Granite scales its embeddings and divides its logits, Cohere scales its logits: the stage
    builder copies both (exact), and a builder that forgets either is refused at the piece."""
    pytest.importorskip("deepspeed")
    from deepspeed_ext import pipe_module

    torch.manual_seed(0)
    model = build_causal_lm({**TINY, "model_type": family, **over})
    assert pipe_module.stage_difference(model, [2, 1]) is None
    truth = pipe_module.around(model)
    if truth.embedding is not None:
        monkeypatch.setattr(pipe_module, "around", lambda m: pipe_module.Around(None, truth.logits, truth.softcap))
        found = pipe_module.stage_difference(model, [2, 1])
        assert found is not None and found.piece.startswith("the embedding"), found
    monkeypatch.setattr(pipe_module, "around", lambda m: pipe_module.Around(truth.embedding, None, truth.softcap))
    found = pipe_module.stage_difference(model, [2, 1])
    assert found is not None and found.piece.startswith("the head"), found


def test_attention_sinks_are_refused_at_start_where_the_run_trains_on_cuda(monkeypatch):
    """GPT-OSS runs with its sinks in the plugin's kernel on CPU; on CUDA the kernel would write them
    out per document, unpriced: refused before the first step, not inside it."""
    torch.manual_seed(0)
    gpt_oss = dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    model = build_causal_lm({**TINY, **gpt_oss})
    assert exactness.check_at_start(model, config()).plugin.microbatching.layout == "auto"  # CPU: exact
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(exactness.ExactnessError, match=r"gpt_oss \(GptOssForCausalLM\): attention sinks.*on CUDA"):
        exactness.check_at_start(model, config())
