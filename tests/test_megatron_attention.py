"""Packed THD rows through megatron-core's local attention (``megatron_patches.attention``).

A packed row of documents must give what each document gives alone: the same logits, per-token
losses and (summed) gradients. Otherwise packing would change training, not just its speed.
"""

from __future__ import annotations

from typing import Iterator

import pytest

pytest.importorskip("megatron.core")

import torch
import torch.nn.functional as F

from device_only import CALLS, DeviceOnly, plain, stand_in_flash
from megatron_in_process import VOCAB, config, gpt, in_process
from megatron_patches.attention import PackedDotProductAttention, attention_patches
from megatron_patches.registry import Registry

LENGTHS = [5, 9, 3]


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with in_process(attention_patches()):
        yield


def _packed(lengths: list[int], max_seqlen: int | None = None):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    m = max(lengths) if max_seqlen is None else max_seqlen
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=m, max_seqlen_kv=m)


def _documents(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    docs = []
    for n in lengths:
        tokens = torch.randint(0, VOCAB, (n + 1,), generator=g)
        docs.append((tokens[:-1], tokens[1:]))  # inputs, next-token labels
    return docs


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _run_packed(model, docs, lengths):
    tokens = torch.cat([t for t, _ in docs])[None]
    labels = torch.cat([y for _, y in docs])[None]
    params = _packed(lengths)
    logits = model(tokens, _positions(lengths), None, packed_seq_params=params)
    loss = model(tokens, _positions(lengths), None, labels=labels, packed_seq_params=params)
    return logits[0], loss[0]


def _run_alone(model, docs):
    logits, losses = [], []
    for tokens, labels in docs:
        pos = torch.arange(tokens.numel())[None]
        logits.append(model(tokens[None], pos, None)[0])
        losses.append(model(tokens[None], pos, None, labels=labels[None])[0])
    return torch.cat(logits), torch.cat(losses)


def test_the_patch_reaches_the_local_layer_spec(megatron: None) -> None:
    model = gpt()
    kinds = {type(layer.self_attention.core_attention) for layer in model.decoder.layers}
    assert kinds == {PackedDotProductAttention}


def test_packed_row_equals_each_document_alone(megatron: None) -> None:
    model = gpt().eval()
    docs = _documents(LENGTHS)
    with torch.no_grad():
        packed_logits, packed_loss = _run_packed(model, docs, LENGTHS)
        alone_logits, alone_loss = _run_alone(model, docs)
    assert packed_logits.shape == (sum(LENGTHS), VOCAB)
    assert (packed_logits - alone_logits).abs().max().item() < 1e-5
    assert (packed_loss - alone_loss).abs().max().item() < 1e-5


def test_packed_gradients_equal_the_sum_over_documents(megatron: None) -> None:
    model = gpt()
    docs = _documents(LENGTHS)
    tokens = torch.cat([t for t, _ in docs])[None]
    labels = torch.cat([y for _, y in docs])[None]
    model(tokens, _positions(LENGTHS), None, labels=labels, packed_seq_params=_packed(LENGTHS)).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for t, y in docs:
        model(t[None], torch.arange(t.numel())[None], None, labels=y[None]).sum().backward()
    for name, p in model.named_parameters():
        assert (packed[name] - p.grad).abs().max().item() < 1e-5, name


def test_unpacked_input_equals_the_original_class(megatron: None) -> None:
    """SDPA in place of the local class's unfused softmax: the same attention up to rounding; with a
    mask the local class is used itself (bit for bit)."""
    original = PackedDotProductAttention.__mro__[1]
    patched, plain = gpt(), gpt(core_attention=original)
    assert type(plain.decoder.layers[0].self_attention.core_attention) is original
    plain.load_state_dict(patched.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        assert (patched(tokens, pos, None) - plain(tokens, pos, None)).abs().max().item() < 1e-5
        mask = torch.triu(torch.ones(1, 1, 11, 11, dtype=torch.bool), diagonal=1)
        assert torch.equal(patched(tokens, pos, mask), plain(tokens, pos, mask))


def test_core_attention_matches_sdpa_per_document(megatron: None) -> None:
    """Against an independent reference: GQA heads repeated, query-key layer scaling and a given
    softmax scale (their product is the scale the scores get), padding between documents zero."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    cfg = config(num_layers=4, apply_query_key_layer_scaling=True)
    attn = PackedDotProductAttention(
        cfg, layer_number=3, attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=0.2
    )
    lengths, pad = [4, 1, 6], [6, 2, 6]  # documents padded to even lengths, as for context parallelism
    t = sum(pad)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, heads, 16, generator=g) for heads in (4, 2, 2))
    cu = torch.tensor([0] + lengths).cumsum(0).int()
    cu_pad = torch.tensor([0] + pad).cumsum(0).int()
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu_pad,
        cu_seqlens_kv_padded=cu_pad,
        max_seqlen_q=max(pad),
        max_seqlen_kv=max(pad),
    )
    out = attn(q, k, v, None, packed_seq_params=params)
    assert out.shape == (t, 4 * 16)
    expected = torch.zeros(t, 4, 16)
    for start, n in zip(cu_pad[:-1].tolist(), lengths):
        qd, kd, vd = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        kd, vd = kd.repeat_interleave(2, dim=0), vd.repeat_interleave(2, dim=0)
        context = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=0.2)  # 0.2 = (0.2 / 3) * 3
        expected[start : start + n] = context.transpose(0, 1)
    assert (out - expected.reshape(t, -1)).abs().max().item() < 1e-5


def _per_document(q, k, v, lengths, scale):
    """Causal SDPA of each document alone (GQA heads repeated), as a ``[t, heads * hn]`` row."""
    out, start = [], 0
    for n in lengths:
        qd, kd, vd = (x[start : start + n].transpose(0, 1) for x in (q, k, v))
        rep = qd.size(0) // kd.size(0)
        kd, vd = kd.repeat_interleave(rep, dim=0), vd.repeat_interleave(rep, dim=0)
        out.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale).transpose(0, 1))
        start += n
    return torch.cat(out).reshape(start, -1)


def _attention_and_inputs(lengths):
    from megatron.core.transformer.enums import AttnMaskType

    attn = PackedDotProductAttention(
        config(), layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", softmax_scale=0.25
    )
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(sum(lengths), heads, 16, generator=g) for heads in (4, 2, 2))
    return attn, q, k, v


def test_megatron_lm_cu_seqlens_shape_attends_per_document(megatron: None) -> None:
    """Megatron-LM's packed batches carry ``cu_seqlens`` as ``[1, n + 1]`` int32 and its
    ``get_thd_batch_on_this_cp_rank`` passes it on as it is: each document must still attend alone
    (this shape once described no document and the output was silently all zeros)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = [5, 9, 3]
    attn, q, k, v = _attention_and_inputs(lengths)
    cu = torch.tensor([[0, *torch.tensor(lengths).cumsum(0).tolist()]], dtype=torch.int32)
    assert cu.shape == (1, len(lengths) + 1)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    out = attn(q, k, v, None, packed_seq_params=params)
    expected = _per_document(q, k, v, lengths, 0.25)
    assert (out - expected).abs().max().item() < 1e-5
    # not vacuous: every token's output is non-zero (the old bug returned zeros for this shape)
    assert (out.abs().sum(-1) > 0).all()
    # and it equals the flat [n + 1] form
    flat = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu[0], cu_seqlens_kv=cu[0], max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    assert torch.equal(out, attn(q, k, v, None, packed_seq_params=flat))


def test_packed_row_on_cuda_is_one_flash_call_that_reads_nothing_back(megatron: None, monkeypatch) -> None:
    """Megatron-LM's packed batch as its ``get_batch`` builds the attention's parameters (boundaries
    ``[1, n + 1]`` on the device, ``max_seqlen`` kept on the host by the patched TP-rank read) runs as
    one call of the flash varlen kernel with no host read of the boundaries (issue 26: they were read
    back once per micro-batch), and computes what each document alone does."""
    from megatron.core import utils

    stand_in_flash(monkeypatch)
    lengths = [5, 9, 3]
    attn, q, k, v = _attention_and_inputs(lengths)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    cu = torch.tensor([[0, *torch.tensor(lengths).cumsum(0).tolist()]], dtype=torch.int32).as_subclass(DeviceOnly)
    _, params = utils.get_thd_batch_on_this_cp_rank({}, cu, None, torch.tensor([max(lengths)], dtype=torch.int32))
    out = attn(q, k, v, None, packed_seq_params=params)
    assert len(CALLS) == 1
    expected = _per_document(q.float(), k.float(), v.float(), lengths, 0.25)
    assert (plain(out).float() - expected).abs().max().item() < 2e-2
    # without a host int for the longest document the per-document path runs (and reads the boundaries)
    params.max_seqlen_q = params.max_seqlen_kv = None
    with pytest.raises(AssertionError, match="host read"):
        attn(q, k, v, None, packed_seq_params=params)


@pytest.mark.parametrize(
    "cu, why",
    [
        (torch.tensor([[0, 5, 14], [0, 3, 17]], dtype=torch.int32), "one packed row"),  # two rows
        (torch.tensor([[0]], dtype=torch.int32), "one packed row"),  # no document
        (torch.tensor([0, 0, 0, 0], dtype=torch.int32), "no token"),  # documents of no token
        (torch.tensor([0, 9, 5, 17], dtype=torch.int32), "never decrease"),
        (torch.tensor([0, 5, 14, 30], dtype=torch.int32), "holds 17 queries"),  # past the row
    ],
)
def test_boundaries_that_describe_no_documents_raise_instead_of_zeros(megatron: None, cu, why) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    attn, q, k, v = _attention_and_inputs([5, 9, 3])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=9, max_seqlen_kv=9)
    with pytest.raises(ValueError, match=why):
        attn(q, k, v, None, packed_seq_params=params)


def test_rope_in_a_shard_is_megatrons_rope_of_the_whole_row_at_the_shards_tokens(megatron: None, monkeypatch) -> None:
    """Inside a sequence-parallel shard (rank 1 of 2 holds tokens 4..7 of every row) RoPE rotates
    each token by its own position: what Megatron's THD path gives the packed row (documents of 5
    and 3 tokens, positions restarting) and its plain path the padded row, at those tokens. Without
    the patch megatron-core gives every shard the positions 0..3."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import sequence_parallel as msp

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7]])  # packed, padded
    x = torch.randn(8, 2, 4, 16)  # [s, rows, heads, head dim]
    # a table longer than the row: Megatron's THD path restarts the positions per document (a table of
    # exactly the row's tokens would make it continue them across documents)
    table = RotaryEmbedding.forward(rope, 16)
    packed = apply_rotary_pos_emb(x[:, 0], table, config, cu_seqlens=torch.tensor([0, 5, 8], dtype=torch.int32))
    padded = apply_rotary_pos_emb(x[:, 1:], table[:8], config)[:, 0]
    from dyn_plugin.models.sequence_parallel import SequenceShard

    # rank 1 of 2 without a process group: SequenceShard's own slicing applied to a stand-in
    stand_in = SimpleNamespace(position_ids=positions, size=2, index=1)
    stand_in.own_positions = SequenceShard.own_positions.fget(stand_in)
    monkeypatch.setattr(msp, "current", lambda: stand_in)
    sharded = apply_rotary_pos_emb(x[4:], msp._rotary(RotaryEmbedding.forward)(rope, 4), config)
    assert torch.allclose(sharded[:, 0], packed[4:], atol=1e-6)
    assert torch.allclose(sharded[:, 1], padded[4:], atol=1e-6)
    unpatched = apply_rotary_pos_emb(x[4:], RotaryEmbedding.forward(rope, 4), config)
    assert not torch.allclose(unpatched[:, 1], padded[4:], atol=1e-3)  # the bug the patch fixes
    with pytest.raises(ValueError, match="RoPE asked for 3 positions"):
        msp._rotary(RotaryEmbedding.forward)(rope, 3)


def test_the_boundaries_are_read_once_per_micro_batch_not_per_layer(megatron: None, monkeypatch) -> None:
    """Each layer gets the same cu_seqlens tensor: reading it back (a device sync on GPU) happens
    once for all of them; a new micro-batch's tensor is read again."""
    from megatron_patches import attention

    reads = []
    read = attention._read_bounds
    monkeypatch.setattr(attention, "_read_bounds", lambda cu, name: reads.append(name) or read(cu, name))
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    assert [attention._bounds(cu, "cu_seqlens_q") for _ in range(4)] == [[0, 5, 14, 17]] * 4
    assert attention._bounds(cu.clone(), "cu_seqlens_q") == [0, 5, 14, 17]
    assert reads == ["cu_seqlens_q", "cu_seqlens_q"]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("table_rows", [16, 17])  # Megatron's two cases: max_seqlen rows, or one per token
def test_thd_rope_is_megatrons_bit_for_bit_and_reads_nothing_back(interleaved: bool, table_rows: int) -> None:
    """Megatron's unfused THD RoPE read the boundaries back per layer (``.tolist()``, and ``.item()`` per
    document when the table has one row per token); the patched one gathers the same table rows on
    the device: equal bit for bit, for both of Megatron's table sizes, and no host read."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings import rope_utils

    from megatron_patches.rope import rope_patches

    one_rank = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    lengths = [5, 9, 3]  # 17 tokens
    t = torch.randn(17, 4, 16)
    freqs = torch.randn(table_rows, 1, 1, 16)
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    expected = rope_utils._apply_rotary_pos_emb_thd(t, cu, freqs, interleaved, cp_group=one_rank)
    with pytest.raises(AssertionError, match="host read"):  # what the patch removes
        rope_utils._apply_rotary_pos_emb_thd(t, cu.as_subclass(DeviceOnly), freqs, interleaved, cp_group=one_rank)
    patches = Registry()
    for p in rope_patches():
        patches.register(p)
    patches.apply()
    try:
        got = rope_utils._apply_rotary_pos_emb_thd(
            t, cu.as_subclass(DeviceOnly), freqs, interleaved, mscale=1.0, cp_group=one_rank
        )
        assert torch.equal(plain(got), expected)
        if table_rows == 16:  # positions restart per document: the second document's first token is unturned
            first = rope_utils._apply_rotary_pos_emb_bshd(t[5:6, None], freqs[:1], interleaved)[0, 0]
            assert torch.equal(plain(got)[lengths[0]], first)
    finally:
        patches.revert()
