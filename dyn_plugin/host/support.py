"""What each host runs of the plugin's features: one table, checked by one call in each host at
start, every refusal worded here once, and rendered in the README (tests/test_support.py checks the
README holds ``render()``).

A row is a feature as the config (or the model) asks for it; a cell says what the host does with
it: runs it (``YES``), runs it only under a condition (``Only``: the condition in words, and the
refusal where it fails), refuses it (``Refused``: why, and the fix), or has no such setting
(``NOT_APPLICABLE``). ``check`` refuses every asked feature a host does not run, all at once, before
the host builds anything. What a host can only know later (a Megatron model's class, Megatron-LM's
flags) is refused there, in the words ``refusal`` takes from this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import ConfigError, DynPluginConfig

HOSTS = ("DeepSpeed", "DeepSpeed pipeline", "FSDP1", "FSDP2", "megatron-core", "Megatron-LM")
FSDP = ("FSDP1", "FSDP2")
MEGATRON = ("megatron-core", "Megatron-LM")


@dataclass(frozen=True)
class Run:
    """What the table's conditions read of a run at start."""

    plugin: DynPluginConfig
    zero_stage: int = 0  # DeepSpeed's zero_optimization.stage (0 where there is none)
    encoder_decoder: bool = False  # the model trains on (input, target) pairs
    precision: str | None = None  # what the host trains in (fp32, bf16, fp16), where the table needs it


@dataclass(frozen=True)
class Refused:
    why: str
    fix: str
    shown: Callable[[Run], str] | None = None  # the setting that failed, with the run's value


@dataclass(frozen=True)
class Only:
    """Run where every condition holds; each condition is (holds, its words, its refusal)."""

    conditions: tuple[tuple[Callable[[Run], bool], str, Refused], ...]


YES = "yes"
NOT_APPLICABLE = "-"
Cell = str | Refused | Only


@dataclass(frozen=True)
class Feature:
    name: str  # the README's row
    setting: str  # what asks for it, as a refusal names it
    asked: Callable[[Run], bool]
    cells: dict[str, Cell] = field(default_factory=dict)
    shown: Callable[[Run], str] | None = None  # the run's own value, named in place of ``setting``

    def cell(self, host: str) -> Cell:
        return self.cells.get(host, YES)


_FSDP_DATA_PARALLEL = Refused("the FSDP entry trains data-parallel only", "train through deepspeed_ext (or Megatron)")
_PIPELINE_ZERO = Refused(
    "DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only", "use ZeRO-1 with pipelines, or ZeRO-2/3 without"
)
_EQUAL_COUNTS = Refused(
    "that batching does not give every data-parallel rank the same number of micro-batches, which ZeRO-2/3 need",
    "use microbatching.method 'dynapipe' (it plans equal counts) or ZeRO stage 0 or 1",
)

FEATURES: tuple[Feature, ...] = (
    Feature(
        "pipeline stages",
        "pipeline.stages > 1",
        lambda r: r.plugin.pipeline.stages > 1,
        {"DeepSpeed": NOT_APPLICABLE, **{h: _FSDP_DATA_PARALLEL for h in FSDP}},
    ),
    Feature(
        "zero-bubble schedules (split backward)",
        "pipeline.schedule 'zero_bubble'",
        lambda r: r.plugin.pipeline.stages > 1 and r.plugin.pipeline.schedule == "zero_bubble",
        {
            **{h: NOT_APPLICABLE for h in ("DeepSpeed", *FSDP)},
            "DeepSpeed pipeline": Only(
                (
                    (
                        lambda r: r.precision in ("fp32", "bf16"),
                        "in fp32 and bf16 (each W's gradients taken into the bf16 optimizer's fp32 ones as a backward's are)",
                        Refused(
                            "DeepSpeed's fp16 optimizer takes each backward's gradients as it ends, before a split "
                            "backward's weight gradients exist",
                            "train in fp32 or bf16, or set pipeline.schedule to 'auto'",
                            shown=lambda r: f"pipeline.schedule 'zero_bubble' in {r.precision}",
                        ),
                    ),
                )
            ),
            **{
                h: Only(
                    (
                        (
                            lambda r: not r.plugin.sequence_parallel.enabled,
                            "on the plugin's executor (the plan's own order), without a sequence-parallel size per "
                            "micro-batch",
                            Refused(
                                "the plugin's Megatron executor does not enter a micro-batch's sequence-parallel group",
                                "set sequence_parallel.enabled to false, or pipeline.schedule to 'auto'",
                            ),
                        ),
                    )
                )
                for h in MEGATRON
            },
        },
    ),
    Feature(
        "a sequence-parallel size per micro-batch (DCP)",
        "sequence_parallel.enabled",
        lambda r: r.plugin.sequence_parallel.enabled,
        {h: _FSDP_DATA_PARALLEL for h in FSDP},
    ),
    Feature(
        "sequence-parallel balance 'inter'",
        "sequence_parallel.balance 'inter'",
        lambda r: r.plugin.sequence_parallel.enabled and r.plugin.sequence_parallel.balance == "inter",
        {
            "DeepSpeed": Only(
                (
                    (
                        lambda r: r.zero_stage <= 1,
                        "under ZeRO 0-1",
                        Refused(
                            "groups would run different numbers of micro-batches, but ZeRO-2/3 need the same number on "
                            "every rank",
                            "use balance 'intra' or 'auto', or ZeRO stage 0 or 1",
                        ),
                    ),
                )
            ),
            **{h: NOT_APPLICABLE for h in FSDP},
        },
    ),
    Feature(
        "per-module sharding plans (OSDP)",
        "sharding.enabled",
        lambda r: r.plugin.sharding.enabled,
        {
            "DeepSpeed": Only(
                (
                    (
                        lambda r: r.zero_stage == 3,
                        "as ZeRO-3 settings",
                        Refused(
                            "DeepSpeed expresses a per-module sharding plan only under ZeRO-3",
                            "set zero_optimization.stage to 3, or train with the FSDP entry dyn_plugin.fsdp",
                            lambda r: f"sharding.enabled with zero_optimization.stage {r.zero_stage}",
                        ),
                    ),
                    (
                        lambda r: r.plugin.sharding.host in ("auto", "zero3"),
                        "sharding.host 'zero3' or 'auto'",
                        Refused(
                            "plans under DeepSpeed run as ZeRO-3 settings",
                            "set sharding.host to 'zero3' or 'auto', or train with the FSDP entry dyn_plugin.fsdp",
                            lambda r: f"sharding.host {r.plugin.sharding.host!r}",
                        ),
                    ),
                )
            ),
            "DeepSpeed pipeline": _PIPELINE_ZERO,
            **{
                h: Refused(
                    "per-module sharding plans run with FSDP or DeepSpeed ZeRO-3", "set sharding.enabled to false"
                )
                for h in MEGATRON
            },
        },
    ),
    Feature(
        "heterogeneous strategies (Hydraulis)",
        "strategy.enabled",
        lambda r: r.plugin.strategy.enabled,
        {
            **{h: _FSDP_DATA_PARALLEL for h in FSDP},
            **{
                h: Refused("heterogeneous strategies run with the DeepSpeed host only", "set strategy.enabled to false")
                for h in MEGATRON
            },
        },
    ),
    Feature(
        "ZeRO stage 2 or 3",
        "zero_optimization.stage 2 or 3",
        lambda r: r.zero_stage >= 2,
        {"DeepSpeed pipeline": _PIPELINE_ZERO, **{h: NOT_APPLICABLE for h in (*FSDP, *MEGATRON)}},
        lambda r: f"zero_optimization.stage {r.zero_stage}",
    ),
    Feature(
        "the baselines' batchings",
        "microbatching.method other than 'dynapipe'",
        lambda r: r.plugin.microbatching.method != "dynapipe",
        {
            "DeepSpeed": Only(((lambda r: r.zero_stage <= 1, "under ZeRO 0-1", _EQUAL_COUNTS),)),
            **{
                h: Refused(
                    "sharded training needs the same number of micro-batches on every rank (each forward gathers "
                    "parameters), which only 'dynapipe' plans",
                    "set microbatching.method to 'dynapipe'",
                )
                for h in FSDP
            },
        },
        lambda r: f"microbatching.method {r.plugin.microbatching.method!r}",
    ),
    Feature(
        "pipeline.cap_in_flight",
        "pipeline.cap_in_flight = true",
        lambda r: (
            r.plugin.pipeline.stages > 1
            and "cap_in_flight" in r.plugin.pipeline.model_fields_set
            and r.plugin.pipeline.cap_in_flight
        ),
        {
            "DeepSpeed": NOT_APPLICABLE,
            **{h: NOT_APPLICABLE for h in FSDP},
            **{
                h: Only(
                    (
                        (
                            lambda r: r.plugin.pipeline.schedule == "zero_bubble",
                            "with pipeline.schedule 'zero_bubble' (the plugin's executor runs the plan's order)",
                            Refused(
                                "Megatron's 1F1B warms every stage up with stages - stage - 1 forwards and cannot "
                                "hold fewer micro-batches in flight",
                                "leave pipeline.cap_in_flight out (the plans fit memory by recompute instead), or set "
                                "pipeline.schedule to 'zero_bubble' (the plugin's executor runs the plan's order)",
                            ),
                        ),
                    )
                )
                for h in MEGATRON
            },
        },
    ),
    Feature(
        "encoder-decoder (input, target) pairs",
        "an encoder-decoder model",
        lambda r: r.encoder_decoder,
        {
            "DeepSpeed pipeline": Only(
                (
                    (
                        lambda r: r.plugin.microbatching.method != "packing_full",
                        "encoder stages then decoder stages, not packing_full",
                        Refused(
                            "pipelines of packed pairs are not built (packing_full trains data parallel: "
                            "models.seq2seq)",
                            "use another microbatching.method with pipeline stages",
                        ),
                    ),
                )
            ),
            **{
                h: Only(
                    (
                        (
                            lambda r: r.plugin.microbatching.method != "packing_full",
                            "T5, not packing_full",
                            Refused(
                                "packed pairs train under deepspeed_ext (data parallel) only",
                                "use another microbatching.method under FSDP",
                            ),
                        ),
                    )
                )
                for h in FSDP
            },
            **{
                h: Refused(
                    "T5 under Megatron is not built: the plugin plans decoder-only models under Megatron "
                    "(megatron-core's GPTModel)",
                    "train an encoder-decoder data-parallel through deepspeed_ext",
                )
                for h in MEGATRON
            },
        },
    ),
    Feature(
        "pairs with sequence parallelism",
        "sequence_parallel.enabled with an encoder-decoder model",
        lambda r: r.encoder_decoder and r.plugin.sequence_parallel.enabled,
        {
            **{
                h: Refused(
                    "sequence parallelism over pairs is not built for encoder-decoder models",
                    "train it on padded pairs without sequence_parallel",
                )
                for h in ("DeepSpeed", "DeepSpeed pipeline")
            },
            **{h: NOT_APPLICABLE for h in (*FSDP, *MEGATRON)},
        },
    ),
    Feature(
        "pairs with sharding plans",
        "sharding.enabled with an encoder-decoder model",
        lambda r: r.encoder_decoder and r.plugin.sharding.enabled,
        {
            **{
                h: Refused(
                    "sharding plans are not built for encoder-decoder models under DeepSpeed",
                    "train it with sharding off, or through the FSDP entry dyn_plugin.fsdp",
                )
                for h in ("DeepSpeed", "DeepSpeed pipeline")
            },
            **{h: NOT_APPLICABLE for h in MEGATRON},
        },
    ),
    Feature(
        "rows packed with several pairs",
        "microbatching.layout 'packed' with an encoder-decoder model",
        lambda r: r.encoder_decoder and r.plugin.microbatching.layout == "packed",
        {
            **{
                h: Refused(
                    "rows packed with several pairs are not built for encoder-decoder models",
                    "set microbatching.layout to 'padded' or 'auto'",
                )
                for h in (*HOSTS[:4],)
            },
            **{h: NOT_APPLICABLE for h in MEGATRON},
        },
    ),
    Feature(
        "bf16 with ZeRO stage 0",
        "bf16.enabled with zero_optimization.stage 0",
        lambda r: r.precision == "bf16" and r.zero_stage == 0,
        {
            "DeepSpeed pipeline": Refused(
                "DeepSpeed 0.19.8's bf16 optimizer cannot load the pipeline checkpoints it saves under ZeRO stage 0 "
                "(KeyError in its legacy loader): the run could not resume",
                "set zero_optimization.stage to 1",
            ),
            **{h: NOT_APPLICABLE for h in (*FSDP, *MEGATRON)},
        },
    ),
)


def _by_name() -> dict[str, Feature]:
    return {f.name: f for f in FEATURES}


def _failed(feature: Feature, host: str, run: Run) -> Refused | None:
    cell = feature.cell(host)
    if isinstance(cell, Refused):
        return cell
    if isinstance(cell, Only):
        return next((refused for holds, _, refused in cell.conditions if not holds(run)), None)
    return None


def _words(feature: Feature, host: str, refused: Refused, run: Run | None, asked_by: str | None = None) -> str:
    shown = refused.shown or feature.shown
    setting = asked_by or (shown(run) if shown and run is not None else feature.setting)
    return f"{setting} on {host}: {refused.why}; {refused.fix}"


def check(host: str, run: Run) -> None:
    """Refuse, all at once, every feature ``run`` asks for that ``host`` does not run (ConfigError)."""
    if host not in HOSTS:
        raise ValueError(f"unknown host {host!r}; the support table knows {', '.join(HOSTS)}")
    refusals = [
        _words(f, host, refused, run)
        for f in FEATURES
        if f.asked(run) and (refused := _failed(f, host, run)) is not None
    ]
    if refusals:
        raise ConfigError("\n".join(refusals))


def refusal(feature: str, host: str, run: Run | None = None, *, asked_by: str | None = None) -> ConfigError:
    """The table's refusal of ``feature`` on ``host``, for a host that finds it asked only later;
    ``asked_by``: what asked for it there (a flag and its value), named in place of the table's setting."""
    found = _by_name()[feature]
    refused = _failed(found, host, run) if run is not None else found.cell(host)
    if not isinstance(refused, Refused):
        raise ValueError(f"{host} runs {feature!r} (the support table): nothing to refuse")
    return ConfigError(_words(found, host, refused, run, asked_by))


def _shown(cell: Cell) -> str:
    if isinstance(cell, Refused):
        return f"no: {cell.why}"
    if isinstance(cell, Only):
        return "yes, " + "; ".join(words for _, words, _ in cell.conditions)
    return cell


def render() -> str:
    """The table as markdown: a row per feature, a column per host."""
    lines = ["| feature | " + " | ".join(HOSTS) + " |", "|---|" + "---|" * len(HOSTS)]
    for f in FEATURES:
        cells = " | ".join(_shown(f.cell(h)).replace("|", "\\|") for h in HOSTS)
        lines.append(f"| {f.name} (`{f.setting}`) | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the README's table: PYTHONPATH=. .venv/bin/python -m dyn_plugin.host.support
    print(render())
