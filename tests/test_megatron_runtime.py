"""The Megatron patches' pieces that need no process group: batches, settings, refusals."""

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

import megatron_patches  # noqa: E402
from dyn_plugin.config import ConfigError  # noqa: E402
from dyn_plugin.plan.instructions import PlannedMicroBatch  # noqa: E402
from dyn_plugin.runtime.collate import collate, scored_tokens  # noqa: E402
from megatron_patches import runtime  # noqa: E402
from megatron_patches.batches import megatron_batch, packed_seq_params  # noqa: E402
from megatron_patches.schedule import _checked_loss  # noqa: E402

DOCS = {0: list(range(10, 15)), 1: list(range(20, 29)), 2: [7, 8, 9]}


@pytest.mark.parametrize("layout,shape", [("packed", (1, 17)), ("padded", (3, 9)), ("padded", (1, 17))])
def test_the_loss_mask_scores_exactly_the_planned_tokens(layout, shape):
    seq_lens = [5, 9, 3]
    mb = collate([0, 1, 2], seq_lens, layout, shape, DOCS.__getitem__)
    desc = PlannedMicroBatch(
        sample_ids=(0, 1, 2),
        seq_lens=tuple(seq_lens),
        layout=layout,
        recompute="none",
        shape=tuple(shape),
        checkpointed=(),
        sp=1,
        group=0,
    )
    batch = megatron_batch(desc, mb)
    assert int(batch["loss_mask"].sum()) == scored_tokens(seq_lens)
    tokens, labels, mask = batch["tokens"], batch["labels"], batch["loss_mask"].bool()
    # every scored label is the next token of the same document
    assert (labels[:, :-1][mask[:, :-1]] == tokens[:, 1:][mask[:, :-1]]).all() and not mask[:, -1].any()
    if layout == "packed":
        # Megatron-LM's packed contract: cu_seqlens int32 [1, n + 1] (micro-batch size 1), max_seqlen 1-D
        cu = batch["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu.dim() == 2 and cu.size(0) == 1 and tokens.size(0) == 1
        assert batch["max_seqlen"].dim() == 1 and batch["max_seqlen"].tolist() == [max(seq_lens)]
        bounds = cu[0].tolist()
        assert bounds[:4] == [0, 5, 14, 17] and bounds[-1] == shape[1]
        params = packed_seq_params(batch)
        assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == bounds and params.max_seqlen_q == 9
        # a stage that loads nothing rebuilds the same metadata from the plan alone
        bare = megatron_batch(desc, None)
        assert torch.equal(bare["cu_seqlens"], cu)
        assert not {"tokens", "labels", "loss_mask"} & set(bare)
        assert (bare["position_ids"] == batch["position_ids"]).all()
    else:
        assert packed_seq_params(batch) is None
    # absent keys are absent, never None: Megatron-LM's get_batch_on_this_tp_rank calls .cuda() on every present key
    assert "attention_mask" not in batch and all(v is not None for v in batch.values())
    assert all(v is not None for v in megatron_batch(desc, None).values())


@pytest.fixture
def patched():
    megatron_patches.apply()
    yield
    megatron_patches.revert()


def test_every_transformer_config_gets_variable_shapes_and_the_per_token_loss(patched):
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    assert c.variable_seq_lengths and c.calculate_per_token_loss and c.moe_token_dispatcher_type == "alltoall"


@pytest.mark.parametrize(
    "section,field",
    [
        ({"sequence_parallel": {"enabled": True}}, "sequence_parallel.enabled"),
        ({"sharding": {"enabled": True}}, "sharding.enabled"),
    ],
)
def test_what_megatron_cannot_run_is_refused_naming_the_field(section, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        runtime.configure({"dyn_plugin": section})


def test_a_legacy_mean_loss_is_refused():
    def legacy(output):
        return output.mean(), {"lm loss": output.mean()}

    import torch

    with pytest.raises(ValueError, match="number of scored tokens"):
        _checked_loss(legacy)(torch.ones(3))


def test_configuring_the_same_file_twice_keeps_the_run(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"dyn_plugin": {}}')
    try:
        first = runtime.configure(str(cfg))
        assert runtime.configure(cfg) is first  # the launcher, then Megatron-LM's --dyn-plugin-config
    finally:
        runtime.RUN = None


def test_megatron_lm_packed_boundaries_reach_packed_seq_params_as_one_row(patched):
    """Megatron-LM's get_batch hands cu_seqlens [1, n + 1] to get_thd_batch_on_this_cp_rank; the
    PackedSeqParams it builds must hold [n + 1], what RoPE's THD path and the attention read."""
    from megatron.core import utils

    cu = torch.tensor([[0, 5, 14, 17]], dtype=torch.int32)
    batch, params = utils.get_thd_batch_on_this_cp_rank({}, cu, None, torch.tensor([9]), cp_size=1, cp_rank=0)
    assert params.cu_seqlens_q.tolist() == [0, 5, 14, 17] and params.cu_seqlens_kv.tolist() == [0, 5, 14, 17]
    assert params.max_seqlen_q == 9


def test_a_plan_longer_than_the_model_is_refused_naming_seq_length(patched):
    from types import SimpleNamespace

    from megatron_patches.arguments import check_seq_length

    runtime.configure({"dyn_plugin": {"microbatching": {"max_seq_len": 512}}})
    check_seq_length(SimpleNamespace(seq_length=512))  # fits
    with pytest.raises(ConfigError, match="max_seq_len = 512 exceeds Megatron's --seq-length 256"):
        check_seq_length(SimpleNamespace(seq_length=256))
