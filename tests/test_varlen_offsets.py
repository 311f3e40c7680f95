"""Document offsets and routing of the flash varlen path of the per-document attention (CUDA);
the kernel itself is checked against the per-document loop on a GPU by
benchmarks/gpu-2026-11-23/check_varlen.py and, for grouped-query attention and windows,
benchmarks/gpu-2026-11-26/check_gqa.py."""

import pytest
import torch

from dyn_plugin.models import varlen_attention as va


def test_offsets_start_at_position_resets_and_at_every_row():
    cu, longest = va.cumulative_offsets(torch.tensor([[0, 1, 2, 0, 1, 0]]), 1, 6)
    assert cu.tolist() == [0, 3, 5, 6] and cu.dtype == torch.int32 and longest == 3
    # padded rows: no position ids, each row one document
    cu, longest = va.cumulative_offsets(None, 2, 4)
    assert cu.tolist() == [0, 4, 8] and longest == 4
    # HF's shared [1, s] positions stand for every row
    cu, longest = va.cumulative_offsets(torch.tensor([[0, 1, 2, 0]]), 2, 4)
    assert cu.tolist() == [0, 3, 4, 7, 8] and longest == 3


def test_offsets_are_found_once_per_position_tensor():
    from dyn_plugin.models.per_forward import PerForward

    cache, found = PerForward(), []
    cpu = torch.device("cpu")

    def offsets(pos):
        return cache.get(pos, (1, 3, cpu), lambda: found.append(pos) or va.cumulative_offsets(pos, 1, 3, cpu))

    pos = torch.tensor([[0, 1, 0]])
    first = offsets(pos)
    assert offsets(pos) is first and len(found) == 1  # the next layer of the same forward
    other = offsets(torch.tensor([[0, 1, 2]]))  # the next micro-batch
    assert other is not first and other[0].tolist() == [0, 3]
    assert offsets(None)[0].tolist() == [0, 3] and offsets(None) is offsets(None)
    assert len(found) == 3
    equal = torch.tensor([[0, 1, 2]])  # equal values, another tensor: found again (identity, not value)
    assert offsets(equal) is not other and len(found) == 4


def test_cuda_path_sends_shared_rows_to_flash_and_single_documents_to_sdpa(monkeypatch):
    """The flash path's routing and flattening, with torch's flash kernel (CUDA only) stood in for."""
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **causal):
        calls.append((q.shape, cu_q.tolist(), max_q, causal))
        return q  # [tokens, heads, d]: the flattened query

    monkeypatch.setattr(va, "varlen_attn", fake_varlen)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out = va._one_call(q, k, v, pos, 0.5)
    assert calls == [((6, 2, 4), [0, 3, 6], 3, va._CAUSAL)]
    assert torch.equal(out, q.transpose(1, 2))  # flattened rows come back as [b, s, heads, d]
    # one document per row: dense causal SDPA, as the per-document loop computes it
    module = torch.nn.Module().eval()
    dense = va._one_call(q, k, v, None, 0.5)
    monkeypatch.setattr(va, "varlen_attn", None)
    assert len(calls) == 1
    assert torch.allclose(dense, va.varlen_attention(module, q, k, v, None, scaling=0.5)[0])


def _qk(heads: int, kv_heads: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(1, heads, 8, 4, dtype=dtype), torch.zeros(1, kv_heads, 8, 4, dtype=dtype)


@pytest.mark.skipif(va.varlen_attn is None, reason="torch without torch.nn.attention.varlen")
def test_flash_takes_grouped_queries_and_windows_but_not_softcap_dropout_or_fp32():
    assert va.flash_exact(*_qk(4, 4), 0.0, None, None)
    assert va.flash_exact(*_qk(32, 8), 0.0, None, None)  # GQA: the kernel shares each key/value head
    assert va.flash_exact(*_qk(4, 1), 0.0, None, None)  # MQA
    assert va.flash_exact(*_qk(4, 4, torch.float16), 0.0, None, None)
    assert va.flash_exact(*_qk(32, 8), 0.0, 4096, None) == va._WINDOWS
    assert va.flash_exact(*_qk(32, 8), 0.0, 1, None) == va._WINDOWS  # the token alone
    assert not va.flash_exact(*_qk(32, 8), 0.0, 0, None)  # sees nothing: left to the reference
    assert not va.flash_exact(*_qk(4, 4), 0.0, None, 50.0)  # soft-cap: the kernel has none
    assert not va.flash_exact(*_qk(4, 4), 0.1, None, None)
    assert not va.flash_exact(*_qk(4, 4, torch.float32), 0.0, None, None)  # flash is half precision only
    assert not va.flash_exact(*_qk(6, 4), 0.0, None, None)  # no whole groups


def test_flash_needs_the_kernel_and_its_window_argument(monkeypatch):
    monkeypatch.setattr(va, "varlen_attn", None)
    assert not va.flash_exact(*_qk(4, 4), 0.0, None, None)
    monkeypatch.setattr(va, "varlen_attn", lambda *a, **k: None)
    monkeypatch.setattr(va, "_WINDOWS", False)  # torch 2.10: causal only
    assert va.flash_exact(*_qk(4, 4), 0.0, None, None)
    assert not va.flash_exact(*_qk(4, 4), 0.0, 16, None)


def test_cpu_calls_never_take_the_flash_path(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the flash kernel was called on CPU")

    monkeypatch.setattr(va, "varlen_attn", refuse)
    q, k, v = (torch.randn(1, h, 6, 4, dtype=torch.bfloat16) for h in (4, 2, 2))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert va.document_attention(q, k, v, pos, window=2).shape == (1, 6, 4, 4)


def test_flash_path_passes_grouped_heads_and_the_window_to_the_kernel(monkeypatch):
    """With torch's flash kernel (CUDA only) stood in for: key/value keep their fewer heads, the
    kernel is told to share them where it asks to be (torch 2.13), and the module's window (a key
    is seen by queries fewer than ``window`` after it) becomes the kernel's (left, 0) with
    left = window - 1 (keys up to ``left`` back); rows of one document take the kernel too when
    windowed, since dense causal SDPA has no window."""
    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **kwargs):
        calls.append((q.shape, k.shape, cu_q.tolist(), kwargs))
        return q

    monkeypatch.setattr(va, "varlen_attn", fake_varlen)
    q, k, v = (torch.randn(1, h, 6, 4) for h in (4, 2, 2))
    va._one_call(q, k, v, torch.tensor([[0, 1, 2, 0, 1, 2]]), 0.5, window=3)
    va._one_call(q, k, v, None, 0.5, window=3)
    va._one_call(q, k, v, torch.tensor([[0, 1, 2, 0, 1, 2]]), 0.5)
    windowed = {"window_size": (2, 0), **va._GQA}
    assert calls == [
        ((6, 4, 4), (6, 2, 4), [0, 3, 6], windowed),
        ((6, 4, 4), (6, 2, 4), [0, 6], windowed),
        ((6, 4, 4), (6, 2, 4), [0, 3, 6], {**va._CAUSAL, **va._GQA}),
    ]
    assert va._GQA == ({"enable_gqa": True} if "enable_gqa" in va._VARLEN_ARGS else {})


def test_grouped_rows_of_one_document_take_dense_sdpa_as_the_loop_computes(monkeypatch):
    monkeypatch.setattr(va, "varlen_attn", None)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 4) for h in (4, 2, 2))
    dense = va._one_call(q, k, v, None, 0.5)
    assert torch.allclose(dense, va.document_attention(q, k, v, None, scaling=0.5), atol=1e-6)


def test_a_packed_row_shipping_its_boundaries_is_attended_without_reading_the_device(monkeypatch):
    """The loader ships a packed row's cu_seqlens and longest document with the batch (collate, on
    the host from the plan); transformers hands them to the kernel, which passes them to the flash
    kernel as they are: nothing is searched for in position_ids, so nothing is read back from the
    device in the forward (on CUDA: no host sync per forward; torch.cuda.set_sync_debug_mode
    'error' in benchmarks/gpu-2026-11-26)."""
    from dyn_plugin.runtime.collate import MODEL_KEYS, collate

    batch = collate([0, 1], [3, 2], "packed", (1, 5), lambda i: list(range(1, 4 - i)), pad_id=0)
    assert {"cu_seq_lens_q", "max_length_q"} <= set(MODEL_KEYS) and batch["max_length_q"] == 3
    assert isinstance(batch["max_length_q"], int) and batch["cu_seq_lens_q"].tolist() == [0, 3, 5]

    def no_search(*_args):
        raise AssertionError("documents searched for in position_ids although the batch carried them")

    calls = []

    def fake_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, **kwargs):
        calls.append((cu_q.tolist(), max_q))
        return q

    monkeypatch.setattr(va._offsets, "get", no_search)
    monkeypatch.setattr(va, "varlen_attn", fake_varlen)
    q = torch.randn(1, 4, 5, 4)
    offsets = (batch["cu_seq_lens_q"], batch["max_length_q"])
    va._one_call(q, q, q, batch["position_ids"], 0.5, offsets=offsets)
    assert calls == [([0, 3, 5], 3)]


@pytest.mark.parametrize(
    "lens, layout, shape, sp",
    [
        ([3, 2], "packed", (1, 5), 1),
        ([3, 2], "packed", (1, 6), 2),  # rounded for a group of two: a padding document at the end
        ([4, 2, 3], "padded", (3, 4), 1),
        ([2, 3], "padded", (1, 5), 1),
    ],
)
def test_a_pipeline_stage_enters_the_boundaries_collate_ships(lens, layout, shape, sp):
    """Pipeline stages after the first load no batch: the engine enters each micro-batch's
    boundaries from its plan (runtime.collate.document_offsets), the same as collate ships to the
    first stage (a padding document at the end of a packed row included), and an attention call
    without shipped boundaries takes them."""
    from dyn_plugin.runtime.collate import collate, document_offsets

    batch = collate(list(range(len(lens))), lens, layout, shape, lambda i: list(range(1, lens[i] + 1)), sp=sp)
    cu, longest = document_offsets(lens, layout, shape)
    assert cu.tolist() == batch["cu_seq_lens_q"].tolist() and longest == batch["max_length_q"]
    assert cu.dtype == batch["cu_seq_lens_q"].dtype == torch.int32


def test_an_attention_call_without_shipped_boundaries_takes_the_entered_ones(monkeypatch):
    seen = []
    monkeypatch.setattr(va, "document_attention", lambda *a, offsets=None, **k: seen.append(offsets) or a[0])
    q = torch.randn(1, 2, 5, 4)
    module = torch.nn.Module()
    entered = (torch.tensor([0, 3, 5], dtype=torch.int32), 3)
    with va.documents(entered):
        va.varlen_attention(module, q, q, q, None, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
        shipped = {"cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32), "max_length_q": 5}
        va.varlen_attention(module, q, q, q, None, **shipped)  # what the batch carries comes first
    va.varlen_attention(module, q, q, q, None)  # outside: none
    assert seen[0] is entered and seen[1][1] == 5 and seen[2] is None
