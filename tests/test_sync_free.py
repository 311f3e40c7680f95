"""The GPU attention path reads nothing back from the device (issue 26), checked on CPU.

On CUDA a host read of a device tensor waits for every kernel queued before it; once per layer it
serialises the step. Here the flash path runs on CPU with torch's flash varlen kernel (CUDA only)
stood in for (``device_only.py``), and every tensor of the batch is a ``DeviceOnly``: any host read
of it, or of anything computed from it, fails the test. The GPU run itself, a training step under
``torch.cuda.set_sync_debug_mode("error")``, is ``test_training_step_is_sync_free_on_cuda``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from device_only import CALLS, DeviceOnly, plain, stand_in_flash, stand_in_flex
from dyn_plugin.models import document_flex
from dyn_plugin.models import varlen_attention as va
from dyn_plugin.runtime.collate import collate


@pytest.fixture
def flash_on_cpu(monkeypatch):
    stand_in_flash(monkeypatch)


def _model(family: str, **extra):
    cfg = AutoConfig.for_model(
        family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=97,
        **extra,
    )
    cfg._attn_implementation = va.register()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)


def _packed_batch(lengths: list[int]) -> dict:
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    batch = collate(list(range(len(docs))), lengths, "packed", (1, sum(lengths)), docs.__getitem__)
    return {k: v for k, v in batch.items() if k != "cu_seq_lens_k" and k != "max_length_k"}


def _loss_and_grads(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch, use_cache=False).loss
    assert isinstance(loss, DeviceOnly) == isinstance(batch["input_ids"], DeviceOnly)
    loss.backward()
    return plain(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": 5})])
def test_hf_forward_and_backward_read_nothing_back(flash_on_cpu, monkeypatch, family, extra):
    """A packed micro-batch of a GQA model (and one with a sliding window) through the flash path:
    no host read of the batch or anything computed from it, and the same loss and gradients as the
    per-document loop."""
    model, lengths = _model(family, **extra), [7, 12, 3, 9]
    batch = _packed_batch(lengths)
    on_device = {k: v.as_subclass(DeviceOnly) if torch.is_tensor(v) else v for k, v in batch.items()}
    assert isinstance(on_device["max_length_q"], int)  # shipped as a host int by the collate
    loss, grads = _loss_and_grads(model, on_device)
    window = (-1, 0) if family == "llama" else (extra["sliding_window"] - 1, 0)
    assert CALLS == [(DeviceOnly, window)] * 2  # one call per layer, on values computed from the batch

    monkeypatch.setattr(va, "flash_device", lambda query: False)  # the per-document loop
    want_loss, want_grads = _loss_and_grads(model, batch)
    assert torch.allclose(loss.float(), want_loss.float(), atol=1e-2)
    for got, want in zip(grads, want_grads):
        assert torch.allclose(plain(got).float(), want.float(), atol=2e-2, rtol=2e-2)


def test_a_soft_capped_model_is_one_flex_call_per_layer_and_reads_nothing_back(monkeypatch):
    """Gemma2 soft-caps its attention logits, which the flash kernel cannot: on CUDA each layer is one
    compiled flex_attention call over the packed row (its local layers with their window), with the
    block mask built on the device from the shipped boundaries, and the logits are the per-document
    loop's. Forward only: torch's flex has no backward on CPU (the GPU check is pending)."""
    stand_in_flex(monkeypatch)
    model = _model("gemma2", head_dim=16, sliding_window=5, attn_logit_softcapping=2.0, query_pre_attn_scalar=16)
    with torch.no_grad():  # logits of a few units, so that the cap changes them (a random init's are ~1e-3)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    batch = _packed_batch([7, 12, 3, 9])
    on_device = {k: v.as_subclass(DeviceOnly) if torch.is_tensor(v) else v for k, v in batch.items()}
    with torch.no_grad():
        logits = plain(model(**on_device, use_cache=False).logits)
        assert CALLS == [(DeviceOnly, "flex")] * 2  # one call per layer, on values computed from the batch
        monkeypatch.setattr(va, "flash_device", lambda query: False)  # the per-document loop
        want = model(**batch, use_cache=False).logits
    assert torch.allclose(logits.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("window", [None, 40])
def test_the_document_block_mask_is_per_document_attention_and_skips_every_empty_block(window):
    """Across block boundaries (documents of 1 to 300 tokens, one empty): the block mask gives what
    each document alone gives, and visits exactly the key blocks holding a pair that attends."""
    from torch.nn.attention.flex_attention import flex_attention

    lengths = [300, 1, 0, 170, 5, 240, 9]
    tokens = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    mask = document_flex.document_block_mask(cu, tokens, window)
    document = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(tokens)
    seen = (document[:, None] == document[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        seen &= i[:, None] - i[None, :] < window
    blocks = -(-tokens // document_flex.BLOCK)
    padded = torch.zeros(blocks * document_flex.BLOCK, blocks * document_flex.BLOCK, dtype=torch.bool)
    padded[:tokens, :tokens] = seen
    needed = padded.view(blocks, document_flex.BLOCK, blocks, document_flex.BLOCK).any(3).any(1)
    visited = torch.zeros(blocks, blocks, dtype=torch.bool)
    for row, (n, keys) in enumerate(zip(mask.kv_num_blocks[0, 0].tolist(), mask.kv_indices[0, 0].tolist())):
        visited[row, keys[:n]] = True
    assert torch.equal(visited, needed)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, tokens, 16, generator=g) for h in (4, 2, 2))
    out = flex_attention(q, k, v, block_mask=mask, scale=0.25, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=0.25, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-5)


def test_pipeline_stages_read_nothing_back_with_the_boundaries_the_engine_enters(flash_on_cpu, monkeypatch):
    """A DeepSpeed pipeline passes (hidden, positions) between layers, so its layers' attention gets
    no shipped boundaries: the engine enters each micro-batch's (from the plan, around its forward
    and backward) and the stages then read nothing back; the same logits as the per-document loop."""
    pytest.importorskip("deepspeed")
    from deepspeed_ext import pipe_module
    from deepspeed_ext.pipe_engine import PlanPipelineEngine
    from dyn_plugin.runtime.collate import document_offsets

    stages = []
    monkeypatch.setattr(pipe_module, "PlannedPipelineModule", lambda layers, *a, **k: stages.extend(layers))
    model, lengths = _model("llama"), [7, 12, 3, 9]
    pipe_module.causal_lm_pipe(model, [1, 1])
    batch = _packed_batch(lengths)

    def run(ids, positions):
        x = (ids, positions)
        for stage in stages:
            x = stage(x)
        return x

    cu, longest = document_offsets(lengths, "packed", (1, sum(lengths)))
    with torch.no_grad(), va.documents((cu.as_subclass(DeviceOnly), longest)):
        logits = plain(run(*(batch[k].as_subclass(DeviceOnly) for k in ("input_ids", "position_ids"))))
    assert CALLS == [(DeviceOnly, (-1, 0))] * 2
    engine = PlanPipelineEngine.__new__(PlanPipelineEngine)  # what the engine enters for a micro-batch
    engine._offsets, engine.device = {}, torch.device("cpu")
    engine._step = SimpleNamespace(
        plan=SimpleNamespace(micro_batches=[SimpleNamespace(seq_lens=lengths, layout="packed", shape=(1, 31))])
    )
    assert engine._documents(0)[0].tolist() == cu.tolist() and engine._documents(0)[1] == longest
    monkeypatch.setattr(va, "flash_device", lambda query: False)  # the per-document loop
    with torch.no_grad():
        want = run(batch["input_ids"], batch["position_ids"])
    assert torch.allclose(logits.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_padded_rows_read_nothing_back(flash_on_cpu, monkeypatch):
    """Padded micro-batches ship their rows as documents too: each row is one dense causal call, and
    no layer finds the documents from the positions (a read of the device per forward)."""
    model, lengths = _model("llama"), [7, 12, 3]
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    batch = collate(list(range(3)), lengths, "padded", (3, 16), docs.__getitem__)
    on_device = {k: v.as_subclass(DeviceOnly) if torch.is_tensor(v) else v for k, v in batch.items()}
    on_device.pop("attention_mask")  # transformers gives the plugin's kernel none (rows are right-padded)
    # transformers makes the positions itself, from no batch tensor: finding rows from them is the read
    with monkeypatch.context() as m:
        m.setattr(va._offsets, "get", lambda *a: pytest.fail("the rows were found from the positions"))
        loss, _ = _loss_and_grads(model, on_device)
    assert CALLS == []  # one document per row: dense causal SDPA, no varlen call
    batch.pop("attention_mask")
    assert torch.allclose(loss.float(), _loss_and_grads(model, batch)[0].float(), atol=1e-2)


def test_the_guard_catches_a_read(flash_on_cpu):
    """Not vacuous: the fallback that finds documents from the positions reads the longest back."""
    pos = torch.tensor([[0, 1, 2, 0, 1]]).as_subclass(DeviceOnly)
    with pytest.raises(AssertionError, match="host read"):
        va.cumulative_offsets(pos, 1, 5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: listed as pending in BENCHMARKS.md")
@pytest.mark.parametrize(
    "family, extra",
    [
        ("llama", {}),  # the flash varlen kernel
        ("gemma2", {"head_dim": 16, "sliding_window": 512, "attn_logit_softcapping": 50.0}),  # compiled flex
    ],
)
def test_training_step_is_sync_free_on_cuda(monkeypatch, family, extra):
    """One packed micro-batch's forward and backward under CUDA's sync debug mode set to error, with
    the gradients of the per-document loop."""
    model = _model(family, **extra).cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _packed_batch([700, 1200, 300, 900]).items()}
    model(**batch, use_cache=False).loss.backward()  # warm-up: first calls may sync (allocator, kernels, compile)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, grads = _loss_and_grads(model, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(va, "flash_device", lambda query: False)  # the per-document loop
    want_loss, want_grads = _loss_and_grads(model, batch)
    assert torch.allclose(loss.float(), want_loss.float(), atol=1e-2)
    for got, want in zip(grads, want_grads):
        assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
