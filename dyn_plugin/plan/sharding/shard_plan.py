"""The sharding plan (OSDP): for each unit of a model, how its parameters are sharded.

A *unit* is a module the plan decides for as a whole: a decoder layer's attention block or
MLP, the embedding, the LM head, and the root (every parameter no other unit owns: norms, the
final norm). Hosts wrap each unit on its own (an FSDP unit, a ZeRO-3 leaf), bottom-up, so a
unit's parameters are gathered, kept and freed together.

The choices, per unit (``Choice.kind``), in host terms (FSDP2 first, FSDP1 in brackets):

- ``replicate``: no sharding; gradients all-reduced once per step [NO_SHARD].
- ``keep``: sharded at rest, gathered once per step and kept gathered for all its micro-batches;
  gradients accumulate unsharded and are reduce-scattered once [SHARD_GRAD_OP, which gathers per
  micro-batch: FSDP1 has no per-module "keep across micro-batches"].
- ``grad_op``: gathered in forward, kept until its backward, freed after; gradients
  reduce-scattered per micro-batch [SHARD_GRAD_OP].
- ``full``: gathered for forward, freed, gathered again for backward [FULL_SHARD].
- ``reshard``: like ``full``, but after forward the parameters stay sharded over
  ``reshard_to`` ranks of the node, so backward gathers within the node (FSDP2's integer
  ``reshard_after_forward``) [FULL_SHARD: FSDP1 cannot express it].
- ``split``: the unit is one linear layer cut into ``slices`` slices along its output features
  (``models/split_linear.py``: each output keeps its own sum, so results are bit-exact), of
  which ``sharded`` run ``full`` and the rest ``keep``.

``shard_size`` is the number of ranks a parameter is sharded over: ``world`` for plain
sharding, fewer for hybrid sharding (shard inside a group of ``shard_size`` ranks, replicate
across ``world / shard_size`` such groups; FSDP2's 2-D mesh, FSDP1's HYBRID_SHARD).

Plans are versioned JSON, like the execution plans; ``check_units`` refuses a plan made for
another model by naming the units it does not have.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Literal, Sequence

from ...atomic import check_sha256, with_sha256, write_json_atomic
from ...jsonfile import read_json

SCHEMA = "dyn_plugin.shard_plan"
VERSION = 1
KINDS = ("replicate", "keep", "grad_op", "full", "reshard", "split")
Kind = Literal["replicate", "keep", "grad_op", "full", "reshard", "split"]
# "encoder" and "decoder": an encoder-decoder's layers, priced per side (cost/encoder_decoder.py)
Component = Literal["embedding", "layer", "encoder", "decoder", "head", "other"]
MB = 1 << 20


@dataclass(frozen=True)
class Choice:
    """How one unit is sharded (see the module docstring)."""

    kind: Kind
    reshard_to: int = 0  # "reshard": ranks the parameters stay sharded over between forward and backward
    slices: int = 1  # "split": slices along the output features
    sharded: int = 0  # "split": slices that run "full" (the rest run "keep")

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"sharding choice {self.kind!r} is unknown; choose one of {', '.join(KINDS)}")
        if self.kind == "reshard" and self.reshard_to < 2:
            raise ValueError(
                f"'reshard' needs reshard_to >= 2 (ranks the parameters stay sharded over), got {self.reshard_to}"
            )
        if self.kind == "split" and not (self.slices >= 2 and 0 < self.sharded < self.slices):
            raise ValueError(
                f"'split' needs slices >= 2 and 0 < sharded < slices, got slices={self.slices}, sharded={self.sharded}"
            )

    @property
    def label(self) -> str:
        if self.kind == "reshard":
            return f"reshard({self.reshard_to})"
        if self.kind == "split":
            return f"split({self.sharded}/{self.slices})"
        return self.kind

    @classmethod
    def parse(cls, label: str) -> "Choice":
        """The inverse of ``label``: 'full', 'reshard(2)', 'split(1/4)'."""
        if label.startswith("reshard(") and label.endswith(")"):
            return cls("reshard", reshard_to=int(label[8:-1]))
        if label.startswith("split(") and label.endswith(")"):
            sharded, slices = label[6:-1].split("/")
            return cls("split", slices=int(slices), sharded=int(sharded))
        return cls(label)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ShardUnit:
    """One unit of the model, as the search sees it (plain data: no torch)."""

    name: str  # qualified module name ("" = the root)
    params: int  # parameters the unit owns (not those of units inside it)
    component: Component  # which profiled component's compute it is part of
    layer: int = -1  # transformer block index, forward order (components "layer", "encoder", "decoder"), else -1
    linear_out: int = 0  # > 0: the unit is one linear layer with this many output features (it can be split)


@dataclass(frozen=True)
class UnitPlan:
    """A unit's choice, with what the search priced for it (per rank, per step)."""

    name: str
    params: int
    choice: Choice
    memory_bytes: float  # model states this rank holds for the unit, plus parameters it keeps gathered at the peak
    comm_ms: float  # communication per step
    exposed_ms: float  # the part of comm_ms compute does not hide


@dataclass(frozen=True)
class ShardPlan:
    """Per-unit sharding of one model on ``world`` ranks, searched under a memory budget."""

    model: str
    world: int
    shard_size: int
    dtype: str
    host: str  # fsdp2 | fsdp1 | zero3: whose semantics priced the choices
    memory_budget_bytes: float
    micro_batches: int  # per rank and step, in the planner's typical plan the search priced
    activation_bytes: float  # that plan's activation peak
    gather_reserve_bytes: float  # parameters being gathered at any moment (the prefetched unit and the current one)
    compute_ms: float  # that plan's compute per step
    units: tuple[UnitPlan, ...]
    frontier: tuple[tuple[float, float], ...] = ()  # (peak MB, step ms) the search explored: the best step per memory
    # Model-state memory the step planner keeps clear (0: state_bytes). Larger than state_bytes where
    # a smaller activation budget makes a faster step: the planner does not price gathers, so with
    # room to spare it may cut more micro-batches, each gathering again.
    planner_state_bytes: float = 0.0
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.world % self.shard_size:
            raise ValueError(f"shard_size {self.shard_size} does not divide world {self.world}")

    @property
    def replicas(self) -> int:
        return self.world // self.shard_size

    @property
    def state_bytes(self) -> float:
        """Model states per rank: every unit's, plus the gather reserve."""
        return sum(u.memory_bytes for u in self.units) + self.gather_reserve_bytes

    @property
    def planning_state_bytes(self) -> float:
        """What the step planner is told the model states take (``DynLoader(state_bytes=...)``)."""
        return max(self.planner_state_bytes, self.state_bytes)

    @property
    def peak_bytes(self) -> float:
        """Predicted peak per rank: model states and the typical plan's activations."""
        return self.state_bytes + self.activation_bytes

    @property
    def exposed_ms(self) -> float:
        return sum(u.exposed_ms for u in self.units)

    @property
    def step_ms(self) -> float:
        """Simulated step: the typical plan's compute plus the communication it does not hide."""
        return self.compute_ms + self.exposed_ms

    def choices(self) -> dict[str, Choice]:
        return {u.name: u.choice for u in self.units}

    def check_units(self, names: Iterable[str]) -> None:
        """Refuse a plan made for another model: every planned unit must exist in ``names`` (the
        model's units, in its order), and every one of them must have a choice."""
        names = list(dict.fromkeys(names))
        have = set(names)
        unknown = [u.name for u in self.units if u.name not in have]
        if unknown:
            shown = ", ".join(repr(n) for n in unknown[:8]) + (
                f" and {len(unknown) - 8} more" if len(unknown) > 8 else ""
            )
            raise ValueError(
                f"sharding plan for model {self.model!r} names modules this model does not have: {shown}; "
                "search a plan for this model (`dynplugin shard`)"
            )
        planned = {u.name for u in self.units}
        undecided = [n for n in names if n not in planned]
        if undecided:
            raise ValueError(
                f"sharding plan for model {self.model!r} does not decide for units {undecided} of this "
                "model; search a plan for this model (`dynplugin shard`)"
            )

    def check_world(self, world: int) -> None:
        """Refuse a plan searched for another number of ranks."""
        if self.world != world:
            raise ValueError(
                f"sharding plan for model {self.model!r} was searched for {self.world} ranks but {world} are "
                f"running; search it for {world} (`dynplugin shard --world {world}`)"
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["units"] = [{**asdict(u), "choice": u.choice.label} for u in self.units]
        d["frontier"] = [list(p) for p in self.frontier]
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_dict(cls, d: object, where: str = "sharding plan") -> "ShardPlan":
        """Check and read a plan's dict; every problem is a ValueError naming ``where`` (its file). A
        ``sha256`` checksum (``save`` writes one) must match the rest."""
        again = "search the plan again with `dynplugin shard --out`"
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            schema = d.get("schema") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"{where} is not a sharding plan: schema {schema!r}, expected {SCHEMA!r}")
        if d.get("version") != VERSION:
            raise ValueError(
                f"{where} has sharding plan version {d.get('version')!r}, not readable by this version "
                f"(reads {VERSION}); {again}"
            )
        d = check_sha256(d, where)
        d = {k: v for k, v in d.items() if k != "schema"}
        try:
            units = tuple(UnitPlan(**{**u, "choice": Choice.parse(u["choice"])}) for u in d.pop("units"))
            frontier = tuple(tuple(p) for p in d.pop("frontier", ()))
            return cls(**d, units=units, frontier=frontier)
        except (KeyError, TypeError, ValueError, AttributeError, ArithmeticError) as exc:
            what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
            raise ValueError(f"{where} does not have the shape of a sharding plan ({what}); {again}") from None

    def save(self, path: str | os.PathLike) -> None:
        """Written whole or not at all, with its checksum (``dyn_plugin.atomic``)."""
        write_json_atomic(path, with_sha256(self.to_dict()), indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "ShardPlan":
        """FileNotFoundError when ``path`` does not exist; a ValueError naming it for anything wrong with it."""
        return cls.from_dict(read_json(path, "sharding plan"), f"sharding plan {os.fspath(path)}")

    def with_choices(self, choices: dict[str, Choice]) -> "ShardPlan":
        """The same plan with some units' choices replaced (costs left as priced): for tests and hosts' fallbacks."""
        return replace(self, units=tuple(replace(u, choice=choices.get(u.name, u.choice)) for u in self.units))


def uniform_choice_units(units: Sequence[ShardUnit], choice: Choice) -> dict[str, Choice]:
    """Every unit the same choice (FSDP's one strategy for all; split falls back to full)."""
    return {u.name: choice if choice.kind != "split" or u.linear_out else Choice("full") for u in units}


__all__ = ["Choice", "ShardUnit", "UnitPlan", "ShardPlan", "KINDS", "SCHEMA", "VERSION", "uniform_choice_units"]
