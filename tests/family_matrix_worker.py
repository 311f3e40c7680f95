"""One rank of the family x path matrix (issue 23), run as a script on 2 gloo CPU ranks:

    family_matrix_worker.py PATH OUT_JSON [FAMILY ...]

For ONE training path of the plugin, every model family in turn (tiny random transformers configs,
fp32, windows of 16 tokens under documents of 40-90, soft-caps on where the family has them) trains
one planned step of packed rows, and is compared with the unmodified model (eager attention) run
document by document in one process: the token-mean loss and every gradient. Each family gives one
cell:

- ``exact``: the loss and every gradient within ``TOL`` relative to their largest entry (a gradient
  also within twice the fp32 reference's own rounding, below);
- ``refused``: a ValueError / NotImplementedError raised before training (model build or the path's
  ``initialize``) on every rank, whose message names the feature (the family, its class, or a
  feature word such as "window" or "soft-cap"); the message is recorded;
- ``wrong``: it trained, and the loss or a gradient differs (the worst ones are recorded);
- ``crash``: anything else (type and first line of the exception, the phase it was raised in).

Gradients are read from the step itself: SGD with ``LR`` = 2**20 and no momentum or weight decay, so
``(p_before - p_after) / LR`` is the gradient the path applied (the rounding of ``p_after`` is
then ~6e-8 of the gradient, not of the weight), whatever the path does with ``.grad`` (ZeRO
partitions, FSDP shards, pipeline stages). DeepSpeed's ``gradient_clipping`` is 0 (off), as the
reference does not clip.

A cell never hangs the next one: each cell runs in a fresh default process group (a prefix of
one TCPStore) with a ``PG_TIMEOUT`` on every collective, so a rank left waiting on a peer that
failed times out; the ranks agree on the cell's outcome through the store (no collective), and a
watchdog ends the process after ``CELL_LIMIT`` seconds (rank 0 records the cell as a hang first,
with where it was; tests/family_matrix.py relaunches the families left). FAMILY_MATRIX_FAULT
injects a failure on one rank to check all this (``_inject_fault``). Rank 0 rewrites OUT_JSON after
every cell: {"path", "cells": {family: cell}, "running": family or null}.

Beside the verdict each measured cell records the rounding it stands in: the fp32 reference's own
gradients against the same reference in float64 (``noise``) and this path's against float64
(``vs64``). TOL is near fp32's floor here: the fp32 reference itself is 6e-7 to 2.2e-6 away from
float64 (qk-norm families, Gemma3 and OLMo2, the most), so a gradient also counts as exact within
twice the reference's own rounding on that parameter; a real defect is orders of magnitude larger
(an ignored window: ~1e-1).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

PATHS = ("ds-zero1", "ds-zero3", "ds-pipe", "sp-ulysses", "sp-ring", "fsdp2", "fsdp1")
TOL = 1e-6
LR = 2.0**20
WINDOW = 16
ACTIVATION_MB = 2.0  # device memory beyond the model states: several micro-batches per rank
STATE_BYTES = 16  # per parameter, above what the planner counts for SGD under ZeRO-1/3 (fp32)
PG_TIMEOUT = float(os.environ.get("FAMILY_MATRIX_PG_TIMEOUT", 30))  # seconds, every collective of a cell
CELL_LIMIT = float(os.environ.get("FAMILY_MATRIX_CELL_LIMIT", 150))  # seconds, a whole cell (watchdog)

_BASE = dict(
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
_GEMMA = dict(
    sliding_window=WINDOW,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=3.0,
    head_dim=16,
    query_pre_attn_scalar=16,
)
# family -> transformers config (model_type and what differs from _BASE; None removes a _BASE key)
FAMILIES: dict[str, dict] = {
    "llama": dict(model_type="llama"),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW),
    # layer 0 full attention, layers 1-2 windowed
    "qwen2-window": dict(model_type="qwen2", sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1),
    "qwen2": dict(model_type="qwen2"),
    "qwen2_moe": dict(
        model_type="qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(model_type="phi3", pad_token_id=None),  # its default pad id 32000 is outside the vocabulary
    # local, global, local layers (the config's default pattern)
    "gemma2": dict(model_type="gemma2", **_GEMMA),
    "gemma3": dict(
        model_type="gemma3_text",  # Gemma3ForCausalLM, text only
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        **_GEMMA,
    ),
    "gpt_neox": dict(model_type="gpt_neox", num_key_value_heads=None),  # no GQA
    "gpt2": dict(
        model_type="gpt2",
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=512,
        attn_pdrop=0.0,  # GPT-2 drops out by default (0.1): a reference run per document could not match
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        hidden_size=None,
        intermediate_size=None,
        num_hidden_layers=None,
        num_attention_heads=None,
        num_key_value_heads=None,
        max_position_embeddings=None,
    ),
    "olmo2": dict(model_type="olmo2"),
    # multipliers around the layers (embedding, residuals, attention, logits)
    "granite": dict(
        model_type="granite",
        embedding_multiplier=3.0,
        residual_multiplier=0.5,
        attention_multiplier=0.3,
        logits_scaling=4.0,
    ),
    # attention and MLP in parallel from one norm; logits scaled
    "cohere": dict(model_type="cohere", logit_scale=0.5),
    # hybrid: linear-attention layers (a token mixer outside attention) around a softmax-attention one
    "minimax": dict(
        model_type="minimax",
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        head_dim=16,
        block_size=8,
    ),
    # the same, with microbatching.layout 'auto' (LAYOUTS): the start-up check plans padded rows
    "minimax-auto": dict(
        model_type="minimax",
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        head_dim=16,
        block_size=8,
    ),
    # multi-head latent attention: query/key heads of 16 + 8 (rotary), value heads of 8; routed experts
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_key_value_heads=4,
    ),
    # attention sinks (one learned logit per head), windowed and full layers, experts
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}

# families trained under another microbatching.layout than 'packed'
LAYOUTS = {"minimax-auto": "auto"}

# words a refusal may name the feature by (besides the family's model_type and class name)
FEATURE_WORDS = (
    "window",
    "softcap",
    "soft-cap",
    "soft cap",
    "rotary",
    "rope",
    "tied",
    "tie_word_embeddings",
    "expert",
    "moe",
    "embedding",
    "head_dim",
    "grouped-query",
    "key_value",
    "_supports_attention_backend",
    "attentioninterface",
    "attention implementation",
)
REFUSALS = (ValueError, NotImplementedError)


def model_config(family: str) -> dict:
    """The family's config dict, as dyn_plugin.models.hf.build_causal_lm takes it."""
    cfg = {**_BASE, **FAMILIES[family]}
    return {k: v for k, v in cfg.items() if v is not None or k == "pad_token_id"}


def dataset(seed: int = 0):
    """24 documents of 40-90 random token ids: (lengths, dataset)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 91, size=24)
    return lengths, [{"input_ids": rng.integers(0, 256, size=int(n))} for n in lengths]


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """The unmodified transformers model with eager attention and ``model``'s weights."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = "eager"
    cfg.use_cache = False
    ref = AutoModelForCausalLM.from_config(cfg)
    ref.load_state_dict(model.state_dict())
    assert ref.config._attn_implementation == "eager"
    return ref


def reference(ref: torch.nn.Module, samples) -> tuple[float, dict[str, torch.Tensor]]:
    """Token-mean loss over every scored token of the global batch, document by document in one
    process, and its gradients (zeros where a parameter took no part, e.g. an unrouted expert)."""
    total = sum(len(s) - 1 for s in samples)
    loss = 0
    for s in samples:
        ids = torch.as_tensor(s).unsqueeze(0)
        labels = ids.clone()
        labels[0, 0] = -100
        loss = loss + ref(input_ids=ids, labels=labels, use_cache=False).loss * (len(s) - 1)
    loss = loss / total
    loss.backward()
    loss = loss.detach()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone() for n, p in ref.named_parameters()
    }
    return float(loss), grads


def plugin_section(memory_mb: float, layout: str = "packed") -> dict:
    return {
        "microbatching": {"layout": layout, "global_tokens": 800, "max_seq_len": 128, "recompute": "none"},
        # a device sized to the model states plus ACTIVATION_MB exactly: no allocator margin on top
        "cluster": {"device": {"memory_mb": memory_mb, "memory_fraction": 1.0, "allocator_margin": 0.0}},
        "cost_model": {"kind": "analytic", "dtype": "fp32"},
    }


def deepspeed_config(path: str, params: int, layout: str = "packed") -> dict:
    # a small device: room for the model states and ACTIVATION_MB, so that the plan cuts each rank's
    # share of the global batch into several packed micro-batches (gradient accumulation)
    plugin = plugin_section(memory_mb=params * STATE_BYTES / 2**20 + ACTIVATION_MB, layout=layout)
    if path == "ds-pipe":
        plugin["pipeline"] = {"stages": 2}
    if path.startswith("sp-"):
        plugin["sequence_parallel"] = {"enabled": True, "sizes": [2], "attention": path[3:]}
    return {
        "zero_optimization": {"stage": 3 if path == "ds-zero3" else 1},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,  # off: the reference does not clip
        "dyn_plugin": plugin,
    }


FSDP_CYCLE = ("full", "grad_op", "keep", "replicate")


def fsdp_plan(model, world: int, host: str):
    """A hand-made sharding plan, as tests/fsdp_worker.py runs its exactness cases: the embedding
    fully sharded, the layers' attention and MLP units in turn grad_op, keep, replicate, full, ...,
    an untied head split in halves, the root (norms, a tied embedding) fully sharded."""
    from dyn_plugin.models.shard_units import shard_units
    from fsdp_worker import hand_plan

    labels, i = [], 0
    for u in shard_units(model):
        if u.component == "layer":
            i += 1
            labels.append(FSDP_CYCLE[i % len(FSDP_CYCLE)])
        else:
            labels.append({"embedding": "full", "head": "split(1/2)", "other": "full"}[u.component])
    return hand_plan(model, world, world, labels, host), labels


def _inject_fault(family: str, rank: int) -> None:
    """For checking the harness itself: FAMILY_MATRIX_FAULT=FAMILY:RANK:KIND makes that rank of that
    family's cell raise, hang or exit just before training (KIND raise | hang | exit), as a library
    failure on one rank would, while the other rank goes on into the step's collectives."""
    fault = os.environ.get("FAMILY_MATRIX_FAULT", "")
    if not fault:
        return
    target, at, kind = fault.split(":")
    if target != family or int(at) != rank:
        return
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "exit":
        os._exit(9)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to b's largest entry."""
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


class Cell:
    """One rank's run of one family on the path; ``phase`` is where it is."""

    def __init__(self, path: str, family: str, data, lengths, world: int, rank: int):
        self.path, self.family, self.data, self.lengths = path, family, data, lengths
        self.world, self.rank = world, rank
        self.phase = "build"
        self.engine = self.loader = None
        self.info: dict = {}

    def run(self) -> dict:
        from dyn_plugin.models.hf import build_causal_lm

        torch.manual_seed(0)
        model = build_causal_lm(model_config(self.family))
        self.info["model"] = type(model).__name__
        ref = reference_model(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.phase = "initialize"
        if self.path.startswith("fsdp"):
            step_fn, module = self._fsdp(model)
        else:
            step_fn, module = self._deepspeed(model)
        step = next(iter(self.loader))
        self.info["micro_batches"] = [
            {"seq_lens": list(d.seq_lens), "sp": d.sp, "layout": d.layout} for d in step.plan.micro_batches
        ]
        self.phase = "train"
        _inject_fault(self.family, self.rank)
        loss = step_fn(step)
        self.phase = "compare"
        batch = [int(i) for i in self.loader.context.batches(step.epoch)[step.index]]
        samples = [self.data[i]["input_ids"] for i in batch]
        exact64 = copy.deepcopy(ref).double()  # before ref's backward: no gradients copied
        if getattr(exact64, "_can_set_experts_implementation", lambda: False)():
            exact64.set_experts_implementation("eager")  # MoE: torch's grouped matmul takes no float64
        ref_loss, ref_grads = reference(ref, samples)
        _, grads64 = reference(exact64, samples)
        after = self._params_after(model, module)
        grads = {
            n: ((before[n].double() - p.double()) / LR, ref_grads[n].double()) for n, p in after.items() if n in before
        }
        unknown = sorted(set(after) - set(before))
        return {
            "loss": loss,
            "ref_loss": ref_loss,
            "docs": len(batch),
            # per parameter: (max |g - g_ref|, max |g_ref|)
            "grads": {n: (float((g - r).abs().max()), float(r.abs().max())) for n, (g, r) in grads.items()},
            # the fp32 reference's own error against the same reference in float64: the noise floor
            "noise": {n: _rel(ref_grads[n].double(), g) for n, g in grads64.items()},
            # this path's gradients against the float64 reference
            "vs64": {n: _rel(g, grads64[n]) for n, (g, _) in grads.items()},
            "params": sorted(before),
            "unknown": unknown,
        }

    def _deepspeed(self, model):
        import deepspeed_ext

        engine, _, loader, _ = deepspeed_ext.initialize(
            model=model,
            config=deepspeed_config(
                self.path, sum(p.numel() for p in model.parameters()), LAYOUTS.get(self.family, "packed")
            ),
            dataset=self.data,
            lengths=self.lengths,
            optimizer=lambda params: torch.optim.SGD(params, lr=LR),
            seed=3,
        )
        self.engine, self.loader = engine, loader
        return (lambda step: deepspeed_ext.train_step(engine, step)), engine.module

    def _fsdp(self, model):
        from dyn_plugin.fsdp import initialize, train_step

        host = self.path
        plan, labels = fsdp_plan(model, self.world, host)
        self.info["shard_plan"] = labels
        plugin = plugin_section(
            memory_mb=ACTIVATION_MB + plan.state_bytes / 2**20, layout=LAYOUTS.get(self.family, "packed")
        )
        wrapped, optimizer, loader, _ = initialize(
            model,
            {"dyn_plugin": plugin},
            self.data,
            self.lengths,
            shard_plan=plan,
            fsdp=host,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR),
            seed=3,
        )
        self.loader = loader
        return (lambda step: train_step(wrapped, optimizer, step)), wrapped

    def _params_after(self, model, module) -> dict[str, torch.Tensor]:
        """The parameters this rank can vouch for after the step, under the unwrapped model's names."""
        if self.path.startswith("fsdp"):
            from fsdp_worker import full_params

            return full_params(module, self.path)
        if self.path == "ds-zero3":
            import deepspeed

            params = list(module.parameters())
            with deepspeed.zero.GatheredParameters(params):
                return {n: p.detach().clone() for n, p in model.named_parameters()}
        if self.path == "ds-pipe":  # this stage's parameters: the pipeline module holds the model's own
            local = {id(p) for p in module.parameters()}
            return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in local}
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    def close(self) -> None:
        for closing in (
            lambda: self.engine is not None and hasattr(self.engine, "destroy") and self.engine.destroy(),
            lambda: self.loader is not None and self.loader.close(),
        ):
            try:
                closing()
            except Exception:  # noqa: BLE001 -- teardown of a failed cell: its outcome is already recorded
                pass


def rank_outcome(path: str, family: str, data, lengths, world: int, rank: int) -> dict:
    """This rank's run of the cell: {"ok": result} or {"error": ...}, with the phase and the time."""
    cell = Cell(path, family, data, lengths, world, rank)
    t0 = time.perf_counter()
    try:
        out = {"ok": cell.run()}
    except BaseException as e:  # noqa: BLE001 -- every failure is a cell's outcome
        lines = str(e).strip().splitlines() or [""]
        out = {
            "error": {
                "type": type(e).__name__,
                "refusal": isinstance(e, REFUSALS),  # the start-up check's ExactnessError is a ValueError
                "message": str(e).strip(),
                "first_line": lines[0],
                "phase": cell.phase,
                "at": time.time(),
                "where": _where(e),
            }
        }
    finally:
        cell.close()
    out["seconds"] = time.perf_counter() - t0
    out["info"] = cell.info
    return out


def _where(e: BaseException) -> str:
    """The innermost frame of the exception (file:line function), for the report."""
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    return f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}"


def names_feature(message: str, family: str, model_cls: str | None) -> bool:
    text = message.lower()
    words = (*FEATURE_WORDS, FAMILIES[family]["model_type"], family.split("-")[0], (model_cls or "").lower())
    return any(w and w in text for w in words)


def combine(family: str, outcomes: list[dict]) -> dict:
    """The cell from every rank's outcome."""
    seconds = max(o["seconds"] for o in outcomes)
    info = outcomes[0]["info"]
    errors = [(r, o["error"]) for r, o in enumerate(outcomes) if "error" in o]
    if errors:
        rank, first = min(errors, key=lambda e: e[1]["at"])  # the earliest: the others may be its consequence
        ranks = {r: {k: e[k] for k in ("type", "first_line", "phase", "where")} for r, e in errors}
        cell = {"seconds": seconds, "info": info, "ranks": ranks}
        before_training = all("error" in o and o["error"]["phase"] in ("build", "initialize") for o in outcomes)
        if (
            before_training
            and all(e["refusal"] for _, e in errors)
            and names_feature(first["message"], family, info.get("model"))
        ):
            return {"status": "refused", "message": first["message"], **cell}
        note = ""
        if before_training and first["refusal"]:
            note = " (raised before training, but its message names no feature)"
        elif first["refusal"]:
            note = f" (raised in phase {first['phase']!r}, not before training)"
        return {
            "status": "crash",
            "message": f"{first['type']}: {first['first_line']}{note}",
            "phase": first["phase"],
            "where": first["where"],
            "rank": rank,
            **cell,
        }
    results = [o["ok"] for o in outcomes]
    merged: dict[str, list[float]] = {}
    for res in results:
        for n, (diff, scale) in res["grads"].items():
            d, s = merged.setdefault(n, [0.0, 0.0])
            merged[n] = [max(d, diff), max(s, scale)]
    rel = {n: (d / s if s > 0 else (0.0 if d == 0 else float("inf"))) for n, (d, s) in merged.items()}
    # which ranks hold a parameter off (a pipeline stage's copy of a shared module, a shard, ...)
    off_on = {
        n: [r for r, res in enumerate(results) if n in res["grads"] and not res["grads"][n][0] <= TOL * merged[n][1]]
        for n in rel
    }
    r0 = results[0]
    noise = r0["noise"]
    loss_rel = abs(r0["loss"] - r0["ref_loss"]) / abs(r0["ref_loss"])
    missing = sorted(set(r0["params"]) - set(merged))
    worst = sorted(rel.items(), key=lambda kv: -kv[1])
    # a gradient is exact within TOL, or within twice the fp32 reference's own rounding on it (its
    # distance from the float64 reference): a path cannot be held closer than the reference itself
    over = [(n, v) for n, v in worst if not v <= max(TOL, 2 * noise.get(n, 0.0))]
    cell = {
        "loss": r0["loss"],
        "ref_loss": r0["ref_loss"],
        "loss_rel": loss_rel,
        "grad_rel": worst[0][1] if worst else None,
        "worst_param": worst[0][0] if worst else None,
        "noise": max(noise.values(), default=0.0),  # the fp32 reference vs float64, worst parameter
        # this path vs float64, worst parameter (over ranks)
        "vs64": max((v for res in results for v in res["vs64"].values()), default=0.0),
        "docs": r0["docs"],
        "seconds": seconds,
        "info": info,
    }
    if loss_rel <= TOL and not over and not missing and not any(r["unknown"] for r in results):
        return {"status": "exact", **cell}
    parts = []
    if not loss_rel <= TOL:
        parts.append(f"loss {r0['loss']:.8g} vs {r0['ref_loss']:.8g} (rel {loss_rel:.2e})")
    if over:
        listed = ", ".join(f"{n} {v:.2e} (rank {','.join(map(str, off_on[n]))})" for n, v in over[:4])
        parts.append(f"{len(over)}/{len(rel)} gradients off (rel to largest entry): {listed}")
        # the same parameters' fp32 reference against float64: a gradient off by about as much is rounding
        parts.append("fp32 reference vs float64 on them: " + ", ".join(f"{noise.get(n, 0):.2e}" for n, _ in over[:4]))
        vs64 = {n: max(res["vs64"].get(n, 0.0) for res in results) for n, _ in over[:4]}
        parts.append("this path vs float64 on them: " + ", ".join(f"{v:.2e}" for v in vs64.values()))
    if missing:
        parts.append(f"parameters on no rank after the step: {missing[:4]}")
    unknown = sorted({n for r in results for n in r["unknown"]})
    if unknown:
        parts.append(f"parameters the model does not have: {unknown[:4]}")
    return {"status": "wrong", "message": "; ".join(parts), "over": [(n, v, off_on[n]) for n, v in over[:20]], **cell}


def end_process_group() -> None:
    """Destroy the cell's default process group (and DeepSpeed's groups cached on it), whatever state
    a failed cell left it in: the next cell makes its own."""
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and comm.cdb is not None and dist.is_initialized():
        try:
            comm.destroy_process_group()
        except Exception:  # noqa: BLE001 -- torch's own destroy below still runs
            pass
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


class Watchdog:
    """Ends the process if a cell runs past CELL_LIMIT; rank 0 records the cell as a hang first."""

    def __init__(self, on_expiry):
        self.on_expiry = on_expiry
        self.timer: threading.Timer | None = None

    def start(self, family: str) -> None:
        self.timer = threading.Timer(CELL_LIMIT, self._expired, args=(family,))
        self.timer.daemon = True
        self.timer.start()

    def stop(self) -> None:
        if self.timer:
            self.timer.cancel()

    def _expired(self, family: str) -> None:
        try:
            self.on_expiry(family)
        finally:
            os._exit(3)


def main():
    path, out = sys.argv[1], sys.argv[2]
    if path not in PATHS:
        raise SystemExit(f"path {path!r}: one of {PATHS}")
    families = sys.argv[3:] or list(FAMILIES)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # every collective of a cell gives up after PG_TIMEOUT, those of the groups DeepSpeed, FSDP and the
    # plugin make with dist.new_group too (they take torch's default otherwise: 30 minutes)
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    c10d._get_default_timeout = lambda backend: datetime.timedelta(seconds=PG_TIMEOUT)
    if path.startswith(("ds-", "sp-")):
        import deepspeed_ext

        deepspeed_ext.skip_cpu_shm_build()
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=CELL_LIMIT + 30),
    )
    lengths, data = dataset()
    record = {"path": path, "cells": {}, "running": None}

    def write() -> None:
        if rank == 0:
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
            os.replace(tmp, out)

    main_thread = threading.get_ident()
    own: dict[str, dict] = {}  # this rank's outcome of each cell, once it has one

    def hang(family: str) -> None:
        stack = traceback.extract_stack(sys._current_frames()[main_thread])
        inner = [f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in stack[-8:]]
        print(f"[{path}] {family}: hang; rank {rank} is in:\n  " + "\n  ".join(inner), file=sys.stderr, flush=True)
        mine = own.get(family)
        if mine is None:
            message = f"hang: the cell ran past {CELL_LIMIT:.0f} s (watchdog); rank 0 was in {inner[-1]}"
        else:  # rank 0 finished the cell; another rank never reported (died or hung)
            what = f"{mine['error']['type']}: {mine['error']['first_line']}" if "error" in mine else "ran the step"
            message = f"hang: another rank never reported within {CELL_LIMIT:.0f} s (died or hung); rank 0: {what}"
        record["cells"][family] = {"status": "crash", "message": message, "phase": "unknown", "stack": inner}
        record["running"] = None
        write()

    watchdog = Watchdog(hang)
    for i, family in enumerate(families):
        record["running"] = family
        write()
        watchdog.start(family)
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"cell-{i}-{family}", store),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT),
        )
        if path.startswith(("ds-", "sp-")):
            import deepspeed

            # as the DeepSpeed workers start (tests/ds_pipe_sp_worker.py): DeepSpeed's comm backend
            # over the group, which its PipelineModule needs before deepspeed.initialize
            deepspeed.init_distributed(dist_backend="gloo")
        outcome = own[family] = rank_outcome(path, family, data, lengths, world, rank)
        end_process_group()
        store.set(f"outcome/{i}/{rank}", json.dumps(outcome))
        outcomes = [json.loads(store.get(f"outcome/{i}/{r}")) for r in range(world)]
        watchdog.stop()
        cell = combine(family, outcomes)
        record["cells"][family] = cell
        record["running"] = None
        write()
        if rank == 0:
            print(f"[{path}] {family}: {cell['status']} {cell.get('message', '')[:200]}", flush=True)
    store.set(f"done/{rank}", "1")
    if rank == 0:  # the store's host leaves last
        for r in range(world):
            store.get(f"done/{r}")
    os._exit(0)  # without DeepSpeed's exit handlers, which sometimes abort on CPU


if __name__ == "__main__":
    main()
