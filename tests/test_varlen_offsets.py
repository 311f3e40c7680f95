"""Document offsets for the flash varlen path of the per-document attention (CUDA); the kernel
itself is checked against the per-document loop on a GPU by benchmarks/gpu-2026-11-23/check_varlen.py."""

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
    cache = va._OffsetsCache()
    cpu = torch.device("cpu")
    pos = torch.tensor([[0, 1, 0]])
    first = cache.get(pos, 1, 3, cpu)
    assert cache.get(pos, 1, 3, cpu) is first  # the next layer of the same forward
    other = cache.get(torch.tensor([[0, 1, 2]]), 1, 3, cpu)  # the next micro-batch
    assert other is not first and other[0].tolist() == [0, 3]
    assert cache.get(None, 1, 3, cpu)[0].tolist() == [0, 3]


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
    out = va._flash_varlen(q, k, v, pos, 0.5)
    assert calls == [((6, 2, 4), [0, 3, 6], 3, va._CAUSAL)]
    assert torch.equal(out, q.transpose(1, 2))  # flattened rows come back as [b, s, heads, d]
    # one document per row: dense causal SDPA, as the per-document loop computes it
    module = torch.nn.Module().eval()
    dense = va._flash_varlen(q, k, v, None, 0.5)
    monkeypatch.setattr(va, "varlen_attn", None)
    assert len(calls) == 1
    assert torch.allclose(dense, va.varlen_attention(module, q, k, v, None, scaling=0.5)[0])
