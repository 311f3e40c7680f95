"""The GPU attention path reads nothing back from the device (issue 26), checked on CPU.

On CUDA a host read of a device tensor waits for every kernel queued before it; once per layer it
serialises the step. Here the flash path runs on CPU with torch's flash varlen kernel (CUDA only)
stood in for (``device_only.py``), and every tensor of the batch is a ``DeviceOnly``: any host read
of it, or of anything computed from it, fails the test. The GPU run itself, a training step under
``torch.cuda.set_sync_debug_mode("error")``, is ``test_training_step_is_sync_free_on_cuda``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from device_only import CALLS, DeviceOnly, plain, stand_in_flash
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
def test_training_step_is_sync_free_on_cuda():
    """One packed micro-batch's forward and backward under CUDA's sync debug mode set to error."""
    model = _model("llama").cuda()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _packed_batch([700, 1200, 300, 900]).items()}
    model(**batch, use_cache=False).loss.backward()  # warm-up: first calls may sync (allocator, kernels)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**batch, use_cache=False).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
