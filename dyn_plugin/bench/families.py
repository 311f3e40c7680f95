"""``dynplugin bench families``: the cost model on each model family, held out against its step.

A profile of one model measured on this machine (``dynplugin profile``, a tiny Llama) is the
reference; every family's tiny model is priced from it by the calibrated transfer
(cost/calibrated.py: the measured per-token and per-pair terms scaled by the analytic ratio of
the family's shape, read from its config by cost/shape.py, to the shape the profile records), and
then measured: forward+backward of one packed micro-batch, through the plugin's per-document
kernel, every family timed in the same randomised rounds as the profiler times its own held-out
micro-batches (profiling/profiler.py: a slow spell of the machine hits all alike, the minimum is
kept). None of these models was measured for its prediction. Beside it, the profile used as it
is: what pricing a family with another's profile would say.

The families keep tiny-llama's widths (hidden 128, 4 layers, 4 heads, vocabulary 8192) and
change what the family changes: its MLP (GELU without a gate: GPT-2, GPT-NeoX), its experts
(Mixtral: 8 of tiny-llama's MLP, 2 per token; Qwen2-MoE: 8 of 128, 2 per token, and a shared one
of 512), its head width (Gemma: 64 for 32), its key/value heads (GPT-2 and GPT-NeoX: none
shared), tied embeddings, and whatever else its own code does (norms, biases, rotary, soft-caps)
that the shape does not price.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..cli_args import SEED, STEPS, TOKENS, choices, count, input_file
from ..models.hf import PRESETS

TINY_LLAMA = {k: v for k, v in PRESETS["tiny-llama"].items() if k != "model_type"}
# family -> its tiny config: tiny-llama's, with the family's own structure (None: the key removed,
# as GPT-NeoX has no grouped key/value heads and would keep an unknown key as it is)
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},  # windows of 4096: wider than every document here
    "qwen2": {},
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=512
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "phi3": dict(pad_token_id=0),
    "gemma2": dict(head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "gemma3_text": dict(head_dim=64, query_pre_attn_scalar=64, tie_word_embeddings=True),
    "gpt_neox": dict(num_key_value_heads=None),
    "gpt2": dict(PRESETS["tiny-gpt2"]),
    "olmo2": {},
}
HELP = (
    "the cost model held out on each family's tiny model (Llama, Mistral, Qwen2, Qwen2-MoE, Mixtral, Phi3, "
    "Gemma2, Gemma3, GPT-NeoX, GPT-2, OLMo2): one packed micro-batch predicted from a profile of this "
    "machine through the family's shape, against its measured step (dyn_plugin/bench/families.py)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        type=input_file,
        required=True,
        help="a tiny-llama profile of this machine (dynplugin profile; CPU)",
    )
    parser.add_argument("--families", type=choices(tuple(FAMILIES)), help="comma-separated subset (default: all)")
    parser.add_argument(
        "--seq-len", type=TOKENS, default=512, help="the micro-batch's longest document (default %(default)s)"
    )
    parser.add_argument(
        "--micro-batch-size",
        type=count(1, 2**16),
        default=2,
        help="the micro-batch holds this many times --seq-len tokens, the rest cut into documents at random "
        "(default %(default)s: 1024 tokens, the largest a default profile measures)",
    )
    parser.add_argument("--warmup", type=count(0), default=1)
    parser.add_argument("--repeats", type=STEPS, default=10, help="timed rounds; the minimum is kept")
    parser.add_argument("--seed", type=SEED, default=0)


def family_config(family: str) -> dict[str, Any]:
    """The config dict (``model_type`` and overrides) of ``family``'s tiny model."""
    own = FAMILIES[family]
    if own.get("model_type"):
        return dict(own)
    merged = {**TINY_LLAMA, **own, "model_type": family}
    return {k: v for k, v in merged.items() if v is not None}


def run(args: argparse.Namespace) -> list[dict]:
    """One record per family: predicted and measured step of the same packed micro-batch."""
    import numpy as np
    import torch

    from ..cost.calibrated import calibrated_cost_model
    from ..cost.profile import cost_model_from_profile, load_profile
    from ..cost.shape import describe, shape_from_config
    from ..models.hf import build_causal_lm, hf_config
    from ..profiling.allocator import stable_cpu_allocator
    from ..profiling.profiler import Job, time_round_robin
    from ..profiling.workload import make_inputs, micro_batch_lengths

    profile = load_profile(args.profile)
    if profile.model.shape is None:
        raise ValueError(
            f"{args.profile} records no model shape (written before profile version 4, or imported): the "
            "families are priced from the shape it measured; re-run `dynplugin profile`"
        )
    if profile.device.type != "cpu":
        raise ValueError(f"{args.profile} was measured on {profile.device.type}: this check times CPU steps")
    stable_cpu_allocator()  # the allocator the profile was measured under
    if profile.device.threads:
        torch.set_num_threads(profile.device.threads)
    reference = cost_model_from_profile(profile)
    families = list(args.families or FAMILIES)  # checked against FAMILIES when the command line is read
    rng = np.random.default_rng(args.seed)
    # one document of seq_len and the rest cut at random, as the profile's own packed micro-batches
    lens = micro_batch_lengths("packed", args.seq_len, args.micro_batch_size, rng)
    jobs, rows = [], []
    for family in families:
        cfg = family_config(family)
        shape = shape_from_config(hf_config(cfg))
        cost = calibrated_cost_model(shape, reference=reference, reference_shape=profile.model.shape)
        torch.manual_seed(args.seed)
        model = build_causal_lm(cfg).train()
        jobs.append(Job(model, make_inputs(lens, "packed", model.config.vocab_size, profile.pad_multiple, rng)))
        rows.append(
            {
                "family": family,
                "shape": describe(shape),
                "predicted_ms": cost.micro_batch_cost(lens, layout="packed").time_ms,
                "profile_as_is_ms": reference.micro_batch_cost(lens, layout="packed").time_ms,
            }
        )
    times = time_round_robin(jobs, warmup=args.warmup, repeats=args.repeats, seed=args.seed)
    for row, (fwd, bwd) in zip(rows, times):
        measured = fwd + bwd
        row.update(
            measured_ms=measured,
            error=(row["predicted_ms"] - measured) / measured,
            profile_as_is_error=(row["profile_as_is_ms"] - measured) / measured,
            seq_lens=lens,
            profile=profile.model.name,
            threads=torch.get_num_threads(),
            repeats=args.repeats,
        )
    return rows
