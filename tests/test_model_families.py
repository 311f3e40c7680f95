"""The plugin's per-document attention on the families that window or soft-cap their attention.

Mistral (a sliding window on every layer), Qwen2 (windowed layers above ``max_window_layers``),
Gemma2 (local layers with a window, attention-logit and final-logit soft-capping) and Gemma3
(local and global layers with rotary bases of their own), tiny random
configs with windows of 16 tokens under documents of 40-90: a packed row through ``dyn_varlen``
gives the logits and gradients of the unmodified model (eager attention) run document by
document. Before, the kernel ignored ``sliding_window`` and ``softcap`` and trained these
families silently wrong (logits off by 0.2-0.7). Both sequence-parallel attentions compute them
too (tests/sp_attention_worker.py; the family matrix runs them end to end).
"""

from __future__ import annotations

import functools

import pytest
import torch

from dyn_plugin.models.varlen_attention import register, varlen_attention

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

WINDOW = 16
FAMILIES = {
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    "qwen2-windowed": dict(model_type="qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    # sets the window on its sliding layers' modules only, without passing it to the kernel
    "qwen2_moe-windowed": dict(
        model_type="qwen2_moe",
        sliding_window=WINDOW,
        use_sliding_window=True,
        max_window_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    ),
    "gemma2": dict(
        model_type="gemma2",
        sliding_window=WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        head_dim=16,
        query_pre_attn_scalar=16,
    ),
    # local (windowed) and global layers with rotary bases of their own
    "gemma3": dict(
        model_type="gemma3_text",
        sliding_window=WINDOW,
        head_dim=16,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}
LENGTHS = [40, 90, 57]
# laid out otherwise than Llama (learned positions, other module names): for the pipeline's stages
LAYOUTS = {
    "gpt2": dict(model_type="gpt2", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": dict(model_type="gpt_neox"),
}


def model(family: str, attention: str, **overrides) -> torch.nn.Module:
    extra = {**{**FAMILIES, **LAYOUTS}[family], **overrides}
    cfg = AutoConfig.for_model(
        extra.pop("model_type"),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
        **extra,
    )
    cfg.use_cache = False
    cfg._attn_implementation = attention
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def packed_row() -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, position ids) of one row packing documents of ``LENGTHS`` tokens."""
    torch.manual_seed(1)
    ids = torch.cat([torch.randint(0, 256, (n,)) for n in LENGTHS])[None]
    return ids, torch.cat([torch.arange(n) for n in LENGTHS])[None]


@torch.no_grad()
def per_document_logits(reference: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The unmodified model's logits of each document of a packed row alone, concatenated."""
    docs = ids[0].split(LENGTHS)
    return torch.cat([reference(input_ids=d[None]).logits[0] for d in docs])[None]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_row_trains_as_its_documents_alone(family):
    reference, mine = model(family, "eager"), model(family, register())
    mine.load_state_dict(reference.state_dict())
    torch.manual_seed(1)
    docs = [torch.randint(0, 256, (n,)) for n in LENGTHS]
    # the reference: each document alone, the token-sum loss of every document
    logits, loss = [], 0.0
    for d in docs:
        out = reference(input_ids=d[None], labels=d[None])
        logits.append(out.logits[0])
        loss = loss + out.loss * (len(d) - 1)
    loss.backward()
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs])  # no label across documents
    out = mine(input_ids=ids, position_ids=positions)
    packed = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[1:], reduction="sum")
    packed.backward()
    assert torch.allclose(out.logits[0], torch.cat(logits), atol=1e-5, rtol=0), family
    assert torch.allclose(packed, loss, rtol=1e-6), (float(packed), float(loss))
    # relative to each gradient's largest entry: the summed loss's gradients reach ~10, and the
    # reduction order (threads) moves their last digits
    worst = max(
        float((a.grad - b.grad).abs().max() / b.grad.abs().max())
        for a, b in zip(mine.parameters(), reference.parameters())
        if a.grad is not None and b.grad.abs().max() > 0
    )
    assert worst < 1e-5, worst  # measured 6-8e-7; a window ignored gives ~1e-1


@pytest.mark.parametrize(
    "family,tied", [("gemma2", True), ("gemma2", False), ("gemma3", True), ("gpt2", True), ("gpt_neox", False)]
)
def test_pipeline_stages_run_each_family_as_the_model_does(family, tied, monkeypatch):
    """The pipeline's stages (embedding, decoder layers with their rotary tables, norm and head),
    run one after another on a packed row, give the per-document logits of the unmodified model:
    Gemma's scaled embedding, Gemma3's rotary embedding per layer type (local and global layers
    rotate with different bases), windows, both soft-caps, and the head tied to the embedding on
    another stage (DeepSpeed's tied layer, built here as DeepSpeed builds it; tests/ds_pipe_worker.py
    runs it on two ranks); GPT-2's learned positions and GPT-NeoX's module names. Before, Gemma,
    GPT-2 and GPT-NeoX were refused in stages, and tied embeddings across stages."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed_ext import pipe_module

    stages = []
    monkeypatch.setattr(pipe_module, "PlannedPipelineModule", lambda layers, *a, **k: stages.extend(layers))
    reference, mine = (
        model(family, "eager", tie_word_embeddings=tied),
        model(family, register(), tie_word_embeddings=tied),
    )
    mine.load_state_dict(reference.state_dict())
    if family == "gemma3":  # two rotary bases: a layer given the other one's table would differ
        assert (
            reference.config.rope_parameters["sliding_attention"] != reference.config.rope_parameters["full_attention"]
        )
    pipe_module.causal_lm_pipe(mine, [2, 1])
    specs = [s for s in stages if isinstance(s, deepspeed.pipe.TiedLayerSpec)]
    assert len(specs) == (2 if tied else 0)
    built = {}
    ids, positions = packed_row()
    x = (ids, positions)
    for stage in stages:
        if isinstance(stage, deepspeed.pipe.TiedLayerSpec):  # one module per key, as PipelineModule builds it
            module = built.setdefault(stage.key, stage.build())
            stage = module if stage.forward_fn is None else functools.partial(stage.forward_fn, module)
        x = stage(x)
    torch.testing.assert_close(x, per_document_logits(reference, ids), rtol=1e-5, atol=1e-5)


def test_the_pipeline_head_applies_the_logit_factor_then_the_final_soft_cap():
    pytest.importorskip("deepspeed")
    from deepspeed_ext.pipe_module import Around, Head

    torch.manual_seed(0)
    head = Head(torch.nn.Identity(), torch.nn.Linear(8, 16), Around(softcap=3.0))
    h = torch.randn(2, 5, 8) * 10
    assert torch.equal(head((h, None)), torch.tanh(head.lm_head(h) / 3.0) * 3.0)
    scaled = Head(torch.nn.Identity(), head.lm_head, Around(logits=0.25, softcap=3.0))
    assert torch.equal(scaled((h, None)), torch.tanh(head.lm_head(h) * 0.25 / 3.0) * 3.0)


def test_gpt_neox_blocks_are_found_and_recompute_exactly():
    """GPT-NeoX calls its attention ``attention``: its blocks are found (transformers names them in
    ``_no_split_modules``) and full and selective recompute give the gradients of none; a packed row
    through the plugin's kernel gives the per-document logits."""
    from dyn_plugin.models.recompute import RecomputeSwitch, decoder_layers

    def neox(attention: str) -> torch.nn.Module:
        cfg = AutoConfig.for_model(
            "gpt_neox",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            vocab_size=256,
            max_position_embeddings=512,
        )
        cfg.use_cache, cfg._attn_implementation = False, attention
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg)

    reference, mine = neox("eager"), neox(register())
    mine.load_state_dict(reference.state_dict())
    assert len(decoder_layers(mine)) == 3
    torch.manual_seed(1)
    docs = [torch.randint(0, 256, (n,)) for n in LENGTHS]
    expected = torch.cat([reference(input_ids=d[None]).logits[0] for d in docs])
    ids, positions = torch.cat(docs)[None], torch.cat([torch.arange(n) for n in LENGTHS])[None]
    switch, grads = RecomputeSwitch(mine), {}
    for mode in ("none", "full", "selective"):
        switch.set(mode)
        mine.zero_grad()
        out = mine(input_ids=ids, position_ids=positions).logits
        assert torch.allclose(out[0], expected, atol=1e-5, rtol=0), mode
        out.square().mean().backward()
        grads[mode] = [p.grad.clone() for p in mine.parameters()]
    for mode in ("full", "selective"):
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(grads[mode], grads["none"])), mode


def test_a_family_without_attention_backends_is_refused_by_the_builder():
    """StableLM's attention classes hard-code their kernels (``_supports_attention_backend`` is
    false): the builder refuses it naming the reason and the fix, where it once set the plugin's
    backend anyway and training crashed inside transformers (KeyError: 'dyn_varlen')."""
    from dyn_plugin.models.hf import build_causal_lm

    tiny = dict(model_type="stablelm", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    tiny.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    with pytest.raises(ValueError, match="_supports_attention_backend is false.*attn_implementation='sdpa'"):
        build_causal_lm(tiny)
    assert build_causal_lm(tiny, attn_implementation="sdpa").config._attn_implementation == "sdpa"


def test_the_kernel_refuses_bidirectional_layers():
    """Bidirectional layers reach the kernel as a keyword argument: refused by name, never attended
    causally."""
    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="attends bidirectionally"):
        varlen_attention(torch.nn.Linear(1, 1), q, q, q, None, is_causal=False)


def test_attention_sinks_are_gpt_oss_eager_attention_per_document_and_refused_on_cuda(monkeypatch):
    """GPT-OSS's sinks (one learned logit per head beside the keys', ``s_aux``) on a packed row of two
    documents, windowed, against transformers' own eager attention run on each document alone, the
    gradients too; on CUDA (the flash path, stood in for) they are refused by name: the flash kernel
    has none, and the written-out loop there is not what the plan prices."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 2, False
    module.sinks = sinks = torch.nn.Parameter(torch.randn(4))  # eager reads them from the module
    lens, window = (5, 7), 4
    q = torch.randn(1, 4, 12, 8, requires_grad=True)
    k, v = (torch.randn(1, 2, 12, 8, requires_grad=True) for _ in range(2))
    positions = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    out, _ = varlen_attention(
        module, q, k, v, None, scaling=0.3, sliding_window=window, s_aux=sinks, position_ids=positions
    )
    parts, start = [], 0
    for n in lens:
        i = torch.arange(n)
        seen = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
        mask = torch.zeros(n, n).masked_fill(~seen, float("-inf"))[None, None]
        part, _ = eager_attention_forward(
            module, *(t[:, :, start : start + n] for t in (q, k, v)), mask, scaling=0.3, dropout=0.0, s_aux=sinks
        )
        parts.append(part)
        start += n
    want = torch.cat(parts, dim=1)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v, sinks))):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    monkeypatch.setattr("dyn_plugin.models.varlen_attention.flash_device", lambda query: True)
    with pytest.raises(ValueError, match="attention sinks.*on CUDA.*not price"):
        varlen_attention(module, q, k, v, None, s_aux=sinks)


def test_packed_rows_are_planned_only_where_the_attention_runs_them_at_the_planned_cost():
    """The user's own SDPA attention trains packed rows exactly but over the whole row's square: a
    run plans padded rows there ('auto'), refuses 'packed' naming both fixes, and keeps packed rows
    for the per-document kernels the plan prices."""
    from dyn_plugin.config import load_config
    from dyn_plugin.host.attention import priced_layouts

    def layout(attention: str, chosen: str) -> str:
        cfg = load_config({"dyn_plugin": {"microbatching": {"layout": chosen}}})
        return priced_layouts(model("mistral", attention), cfg).plugin.microbatching.layout

    assert layout("sdpa", "auto") == "padded" and layout("eager", "padded") == "padded"
    assert layout(register(), "auto") == "auto" and layout(register(), "packed") == "packed"
    with pytest.raises(ValueError, match="layout 'packed' with attn_implementation 'sdpa'.*'dyn_varlen'.*'padded'"):
        layout("sdpa", "packed")
