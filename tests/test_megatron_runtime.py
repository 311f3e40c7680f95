"""The Megatron patches' pieces that need no process group: batches, settings, refusals."""

import re

import numpy as np
import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402

import megatron_patches  # noqa: E402
from dyn_plugin.config import ConfigError  # noqa: E402
from dyn_plugin.plan.steps.instructions import PlannedMicroBatch  # noqa: E402
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
        ({"sharding": {"enabled": True}}, "sharding.enabled"),
        ({"sequence_parallel": {"enabled": True}, "strategy": {"enabled": True}}, "strategy.enabled"),
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


# Megatron-LM arguments fine for the default plan (dynapipe, layout auto: may pack)
GOOD = dict(
    seq_length=512,
    global_batch_size=4,
    micro_batch_size=1,
    context_parallel_size=1,
    tensor_model_parallel_size=2,
    pipeline_model_parallel_size=2,
    sequence_parallel=False,
)
BAD_ARGUMENTS = {
    # name: (plugin microbatching, Megatron-LM arguments changed, what the error says)
    "rows longer than the model": ({}, {"seq_length": 256}, "max_seq_len = 512 exceeds Megatron's --seq-length 256"),
    "context parallelism": ({}, {"context_parallel_size": 2}, "--context-parallel-size 2"),
    "an encoder-decoder (pretrain_t5.py)": (
        {},
        {"decoder_seq_length": 128},
        "--decoder-seq-length 128 on Megatron-LM: T5 under Megatron is not built",
    ),
    "packed rows of several samples": ({}, {"micro_batch_size": 2}, "--micro-batch-size 2 with packed micro-batches"),
    "sequence parallel on packed rows": ({}, {"sequence_parallel": True}, "--sequence-parallel with packed"),
    "sequence parallel on odd widths": (
        {"layout": "padded", "pad_multiple": 3},
        {"sequence_parallel": True},
        "set pad_multiple to a multiple of 2",
    ),
    "packed rows in middle stages": ({}, {"pipeline_model_parallel_size": 4}, "--pipeline-model-parallel-size 4"),
    "checkpoints without the data position": ({}, {"ckpt_format": "torch", "save": "ckpt"}, "--ckpt-format torch"),
    "a global batch of other tokens": (
        {"global_tokens": 4096},
        {},
        "global_tokens = 4096 but Megatron-LM's global batch is --global-batch-size 4 x --seq-length 512 = 2048",
    ),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_megatron_lm_arguments_the_plan_cannot_run_under_are_refused_naming_the_flag(patched, name):
    from types import SimpleNamespace

    from megatron_patches.arguments import check_arguments

    microbatching, changed, message = BAD_ARGUMENTS[name]
    runtime.configure({"dyn_plugin": {"microbatching": {"max_seq_len": 512, **microbatching}}})
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_arguments(SimpleNamespace(**{**GOOD, **changed}))


def test_the_planned_global_batch_is_megatron_lms_unless_set(patched):
    """One planned step is one iteration of --global-batch-size samples of --seq-length tokens."""
    from types import SimpleNamespace

    from megatron_patches.arguments import check_arguments

    for microbatching in ({"layout": "padded"}, {"layout": "padded", "global_tokens": 2048}):
        run = runtime.configure({"dyn_plugin": {"microbatching": {"max_seq_len": 512, **microbatching}}})
        args = {**GOOD, "micro_batch_size": 4, "sequence_parallel": True, "pipeline_model_parallel_size": 4}
        check_arguments(SimpleNamespace(**args))  # padded rows: any micro-batch size, TP sequence parallel, 4 stages
        assert runtime.RUN is run and run.config.plugin.microbatching.global_tokens == 4 * 512


def _step(ops: list[tuple[str, int]], stage: int):
    from types import SimpleNamespace

    from dyn_plugin.plan.steps.instructions import BackwardPass, ForwardPass

    kinds = {"F": ForwardPass, "B": BackwardPass}
    return SimpleNamespace(
        index=0, plan=SimpleNamespace(stage=stage, instructions=[kinds[k](stage, m) for k, m in ops])
    )


def test_a_plan_megatron_would_run_in_another_order_is_refused():
    """Megatron's 1F1B warms up min(stages - stage - 1, n) forwards; a plan that capped the
    micro-batches in flight (memory) would run with more in flight than priced: refused. Plans made
    for Megatron never cap (pipeline.cap_in_flight false: tests/test_planner.py); this guards the others."""
    from megatron_patches.schedule import check_runs_as_planned, megatron_1f1b

    order = [2, 0, 1]
    assert megatron_1f1b(order, 2, 0) == [("F", 2), ("F", 0), ("B", 2), ("F", 1), ("B", 0), ("B", 1)]
    assert megatron_1f1b(order, 2, 1) == [("F", 2), ("B", 2), ("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    check_runs_as_planned(_step(megatron_1f1b(order, 2, 0), 0), 2)  # what Megatron runs: accepted
    capped = [("F", 2), ("B", 2), ("F", 0), ("B", 0), ("F", 1), ("B", 1)]  # stage 0 with one in flight
    with pytest.raises(ValueError, match="the plan was made for another schedule"):
        check_runs_as_planned(_step(capped, 0), 2)


def test_capping_micro_batches_in_flight_is_refused_under_megatron():
    """Refused when the config is read, before Megatron builds anything (the support table's row)."""
    try:
        with pytest.raises(ConfigError, match="pipeline.cap_in_flight = true on megatron-core: Megatron's 1F1B"):
            runtime.configure({"dyn_plugin": {"pipeline": {"stages": 2, "cap_in_flight": True}}})
    finally:
        runtime.RUN = None


def test_an_encoder_decoder_megatron_model_is_refused_before_planning():
    """megatron-core's T5Model, or any model Megatron-LM's get_model marks encoder_and_decoder."""
    from types import SimpleNamespace

    run = runtime.configure({"dyn_plugin": {}})
    run.documents = runtime.Documents([[1]], np.array([1]))
    marked = SimpleNamespace(model_type=SimpleNamespace(name="encoder_and_decoder"))
    for model in ([SimpleNamespace(module=marked)], type("T5Model", (), {})()):
        with pytest.raises(ConfigError, match="T5 under Megatron is not built"):
            runtime.build_loader(run, model)


def test_a_megatron_model_other_than_gpt_is_refused_packed():
    """megatron-core's other decoders (MambaModel's hybrids) are not checked to keep a packed row's
    documents apart: refused before planning, naming the padded layout that is exact for them."""
    from types import SimpleNamespace

    run = runtime.configure({"dyn_plugin": {"microbatching": {"layout": "packed"}}})
    run.documents = runtime.Documents([[1]], np.array([1]))
    ps = SimpleNamespace(
        get_virtual_pipeline_model_parallel_world_size=lambda: None,
        get_context_parallel_world_size=lambda: 1,
        get_pipeline_model_parallel_world_size=lambda: 1,
        get_data_parallel_world_size=lambda: 1,
        get_tensor_model_parallel_world_size=lambda: 1,
    )
    import megatron.core

    real = megatron.core.parallel_state
    megatron.core.parallel_state = ps
    try:
        with pytest.raises(ConfigError, match="MambaModel is not megatron-core's GPTModel.*'padded'"):
            runtime.build_loader(run, type("MambaModel", (), {})())
    finally:
        megatron.core.parallel_state = real
        runtime.RUN = None
