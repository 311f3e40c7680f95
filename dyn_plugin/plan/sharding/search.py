"""OSDP: the sharding search. For each unit of a model, the choice (shard_plan.py) that makes
the step fastest within the memory budget, as a multiple-choice knapsack (knapsack.py) over the
prices of cost/sharding.py.

What a choice costs depends on the step: every micro-batch gathers again, so the micro-batch
count matters, and the neighbouring units' compute hides the collectives. Those come from the
planner's plan of a typical global batch (``lengths``), planned with the sharding plan's own
model states (``planner_spec(state_bytes=...)``: activations get the budget the states leave).
So the two iterate: plan a step with some model states, search under the budget its activation
peak leaves, plan again with the states found, until the choices stop changing (a few rounds).
Every candidate is priced on the step planned with its own states, which is the step training
will plan (``DynLoader(state_bytes=plan.planning_state_bytes, zero_stage=3)``), and the fastest wins.
The iteration starts from both ends: the smallest model states (every unit sharded as far as it
goes: the most room for activations) and the largest the budget allows beside the smallest
activations (the longest sequence alone). The planner does not price communication, so with
room to spare it may cut more micro-batches, each gathering again: the search also gives the
planner activation budgets on a ladder (with the choices that fit beside each), prices every
candidate on every step planned with less room than it leaves (``ShardPlan.planner_state_bytes``
then tells the loader to keep that room clear), and counts FSDP's uniform strategies (every unit
the same choice) among the candidates, so it is never slower than one strategy for every module.

An encoder-decoder (``EncoderDecoderCostModel``) is searched the same way on a global batch of
(input, target) pairs, its typical steps planned by the pair planner (pair_sharding.py).

Shard sizes tried: ``sharding.shard_size`` if set, else the world and, where it divides the
world and is smaller, a node (hybrid sharding: gathers stay inside the node).
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...config import DynPluginConfig
from ...cost.encoder_decoder import EncoderDecoderCostModel
from ...cost.model import COMPONENTS, features
from ...cost.sharding import HOST_KINDS, Links, Prices, price, unit_compute
from ...cost.table import TableCostModel
from ..methods.planner import plan_step
from ..steps.pair_spec import pair_planner_spec
from ..steps.pricing import in_range, make_micro_batch
from ..steps.spec import PlannerSpec, planner_spec
from .knapsack import solve
from .pair_sharding import pair_least_activation, pair_step
from .shard_plan import MB, Choice, ShardPlan, ShardUnit, UnitPlan, uniform_choice_units

logger = logging.getLogger(__name__)

RESOLUTION = 4096  # memory units the knapsack splits the model-state budget into (weights rounded up)
ROUNDS = 4  # plans of a typical step per starting point
BASELINES = {"full_shard": Choice("full"), "shard_grad_op": Choice("grad_op"), "no_shard": Choice("replicate")}


@dataclass(frozen=True)
class TypicalStep:
    """The planner's plan of the typical global batch, as the sharding prices see it."""

    state_bytes: float  # the model states it was planned with
    micro_batches: int  # per rank (every rank runs as many)
    activation_bytes: float  # its activation peak
    compute_ms: float  # at each micro-batch index the slowest rank's forward + backward, summed
    # (forward, backward) per micro-batch index; "layer" (or an encoder-decoder's "encoder", "decoder"): one layer
    component_ms: dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Selection:
    """One knapsack's answer: a column per unit (forward order), and the frontier it explored."""

    choice: tuple[int, ...]
    unit_bytes: float  # bytes per memory unit of the frontier
    frontier: np.ndarray  # [units + 1]: least time within m units (inf: nothing fits)


class _Candidate:
    """One column per unit (forward order) priced on a typical step, with its step time and model
    states computed as ``ShardPlan`` computes them (the same sums in the same order, so the same
    floats); the plan itself is built only for the winner."""

    __slots__ = (
        "search",
        "choice",
        "cols",
        "prices",
        "typ",
        "shard_size",
        "selection",
        "state_bytes",
        "exposed_ms",
        "step_ms",
    )

    def __init__(self, search, choice, cols, prices, typ, shard_size, selection=None) -> None:
        self.search, self.choice, self.cols, self.prices = search, choice, cols, prices
        self.typ, self.shard_size, self.selection = typ, shard_size, selection
        rows = search.unit_rows
        chosen = np.asarray(choice)[rows]
        opened = prices.opens[np.asarray(choice)]
        reserve = float(prices.reserve_bytes[opened].max()) if opened.any() else 0.0
        self.state_bytes = sum(prices.memory_bytes[rows, chosen].tolist()) + reserve
        self.exposed_ms = sum(prices.exposed_ms[rows, chosen].tolist())
        if typ is None:
            self.step_ms = math.nan
        else:
            compute = (
                typ.compute_ms
                + search.optimizer_fixed_ms
                + float(prices.optimizer_ms[np.arange(len(choice)), np.asarray(choice)].sum())
            )
            self.step_ms = compute + self.exposed_ms

    def plan(self) -> ShardPlan:
        return self.search.shard_plan(self.choice, self.cols, self.prices, self.typ, self.shard_size, self.selection)


def shard_sizes(config: DynPluginConfig, world: int) -> list[int]:
    """``sharding.shard_size``, else the world and a node where that divides the world and is smaller."""
    size = config.sharding.shard_size
    if size is not None:
        if world % size:
            raise ValueError(
                f"sharding.shard_size = {size} does not divide the world of {world} ranks; "
                "choose a divisor (a node's ranks for hybrid sharding)"
            )
        return [size]
    node = config.cluster.devices_per_node
    return [world] + ([node] if node < world and world % node == 0 else [])


def choice_columns(config: DynPluginConfig, host: str, shard_size: int) -> list[Choice]:
    """Every choice the search may make, in tie-breaking order: the allowed kinds
    (``sharding.choices`` the host runs), reshard to each divisor of the shard size that is at
    least 2, smaller than it and fits in a node, split into k slices (2..max_slices) with
    1..k-1 of them sharded (units whose output features k does not divide never take it)."""
    if host not in HOST_KINDS:
        raise ValueError(f"sharding host {host!r} is unknown; choose one of {', '.join(HOST_KINDS)}")
    sharding = config.sharding
    kinds = [k for k in HOST_KINDS[host] if k in sharding.choices]
    if not kinds:
        raise ValueError(f"sharding.choices {sharding.choices} has nothing {host} runs ({', '.join(HOST_KINDS[host])})")
    cols = []
    for kind in kinds:
        if kind == "reshard":
            cols += [
                Choice("reshard", reshard_to=r)
                for r in range(2, shard_size)
                if shard_size % r == 0 and r <= config.cluster.devices_per_node
            ]
        elif kind == "split":
            cols += [
                Choice("split", slices=k, sharded=s) for k in range(2, sharding.max_slices + 1) for s in range(1, k)
            ]
        else:
            cols.append(Choice(kind))  # type: ignore[arg-type]
    return cols


def typical_step(
    lengths: Sequence[int] | Sequence[tuple[int, int]],
    cost: TableCostModel | EncoderDecoderCostModel,
    config: DynPluginConfig,
    *,
    world: int,
    state_bytes: float,
    native: bool = True,
) -> TypicalStep:
    """Plan ``lengths`` (one global batch; (input, target) pairs for an encoder-decoder) on ``world``
    ranks with ``state_bytes`` of model states per rank, with ZeRO-3's rules (equal micro-batch
    counts, the same recompute per index)."""
    if isinstance(cost, EncoderDecoderCostModel):
        return TypicalStep(state_bytes, *pair_step(lengths, cost, config, world=world, state_bytes=state_bytes))
    spec = planner_spec(cost, config, dp=world, zero_stage=3, state_bytes=state_bytes)
    plan = plan_step(lengths, spec, native=native)
    runs = [[r.micro_batches[i] for i in r.schedule.order] for r in plan.replicas]
    count = len(runs[0])
    # every rank gathers each unit together, so at each micro-batch index the slowest rank sets the pace
    slowest = [max((run[j] for run in runs), key=lambda mb: mb.time_ms) for j in range(count)]
    comp = {c: (np.zeros(count), np.zeros(count)) for c in COMPONENTS}
    for j, mb in enumerate(slowest):
        fits = spec.cost.table(mb.layout, mb.recompute, spec.tp).fits
        f = features(mb.seq_lens, mb.layout, spec.cost.pad_multiple, mb.sp)
        for part, metric, total in ((0, "forward_ms", mb.forward_ms[0]), (1, "backward_ms", mb.backward_ms[0])):
            emb, head = fits["embedding"][metric](f), fits["head"][metric](f)
            comp["embedding"][part][j], comp["head"][part][j] = emb, head
            # the layers' share from the priced stage: it holds pyramid checkpointing and collectives
            comp["layer"][part][j] = max(total - emb - head, 0.0) / spec.cost.num_layers
    return TypicalStep(state_bytes, count, plan.peak_bytes, sum(mb.time_ms for mb in slowest), comp)


def smallest_activation(lengths: Sequence[int], spec: PlannerSpec) -> float:
    """The least activation peak any plan of ``lengths`` has: its longest sequence alone, in the
    layout and recompute mode that keep the least."""
    longest = int(np.argmax(lengths))
    peaks = [
        mb.peak_bytes[0]
        for mb in (
            make_micro_batch([longest], lengths, spec=spec, layout=layout, recompute=rc)
            for layout in spec.layouts
            for rc in spec.recomputes
        )
        if in_range(mb, spec)
    ]
    if not peaks:
        raise ValueError(
            f"the longest sequence ({lengths[longest]} tokens) is beyond what cost model "
            f"{spec.cost.name!r} measured; profile longer sequences or allow extrapolation"
        )
    return min(peaks)


def select(
    prices: Prices, state_budget: float, *, resolution: int = RESOLUTION, native: bool = True
) -> Selection | None:
    """The fastest choice per unit whose model states (and the reserve) fit in ``state_budget``
    bytes; None if none does. Memory is counted in ``resolution`` units of the budget, rounded up
    per unit and choice (so the answer fits in bytes); where that rounding alone leaves nothing,
    the smallest plan, if it fits in bytes."""
    if state_budget <= 0:
        return None
    unit = state_budget / resolution
    over = resolution + 1  # any weight past the capacity is as good as infinite (and stays an int64)
    weights = np.where(prices.allowed, np.minimum(np.ceil(prices.memory_bytes / unit), over), 0).astype(np.int64)
    reserve = np.minimum(np.ceil(prices.reserve_bytes / unit), over).astype(np.int64)
    ks = solve(
        weights,
        prices.time_ms,
        resolution,
        opens=np.broadcast_to(prices.opens, weights.shape),
        reserve=reserve,
        native=native,
    )
    if ks is not None:
        return Selection(tuple(int(c) for c in ks.choice), unit, ks.frontier)
    least, choice = smallest(prices)
    if least > state_budget:
        return None
    frontier = np.full(resolution + 1, np.inf)
    frontier[min(math.ceil(least / unit), resolution) :] = float(prices.time_ms[np.arange(len(choice)), choice].sum())
    return Selection(tuple(int(c) for c in choice), unit, frontier)


def smallest(prices: Prices) -> tuple[float, np.ndarray]:
    """The least model-state bytes any choice per unit can have (the reserve included), and those
    choices. With the units in descending reserve order, the first that gathers on use fixes the
    reserve: every unit before it takes its smallest choice that does not, every unit from it on
    its smallest choice."""
    mem = np.where(prices.allowed, prices.memory_bytes, np.inf)
    closed = np.where(prices.opens[None, :], np.inf, mem)
    order = np.argsort(-prices.reserve_bytes, kind="stable")
    low_closed, low_any = closed[order].min(axis=1), mem[order].min(axis=1)
    before = np.concatenate([[0.0], np.cumsum(low_closed)])  # [j]: units before j, none gathering on use
    after = np.concatenate([np.cumsum(low_any[::-1])[::-1], [0.0]])  # [j]: units from j on, any choice
    totals = np.append(before[:-1] + prices.reserve_bytes[order] + after[:-1], before[-1])
    j = int(np.argmin(totals))
    choice = np.empty(len(order), dtype=np.int64)
    choice[order] = np.where(np.arange(len(order)) < j, closed[order].argmin(axis=1), mem[order].argmin(axis=1))
    return float(totals[j]), choice


class _Search:
    """One model, cluster and global batch: typical steps by model states, prices by shard size."""

    def __init__(
        self,
        units: Sequence[ShardUnit],
        cost: TableCostModel | EncoderDecoderCostModel,
        config: DynPluginConfig,
        *,
        world: int,
        lengths: Sequence[int] | Sequence[tuple[int, int]],
        host: str,
        model: str,
        native: bool,
        resolution: int,
        longest: int | tuple[int, int] | None = None,
    ) -> None:
        if not units:
            raise ValueError("a sharding search needs the model's units (models.shard_units.shard_units)")
        self.units, self.cost, self.config, self.world = list(units), cost, config, world
        self.lengths, self.host, self.model = list(lengths), host, model
        self.native, self.resolution = native, resolution
        # forward order: the root first (its forward encloses every other unit's), then as listed
        self.order = sorted(range(len(units)), key=lambda i: units[i].name != "")
        self.links = Links.of(config.cluster, cost.update)
        cluster = config.cluster
        budget_mb = config.sharding.memory_budget_mb
        self.budget = (budget_mb or cluster.device.plannable_mb) * MB
        # every step must fit the run's longest sequence alone, not only the typical batch's
        if isinstance(cost, EncoderDecoderCostModel):  # its longest input and longest target, together
            sides = np.asarray([longest or (0, 0), *self.lengths]).max(axis=0)
            self.longest: int | tuple[int, int] = (int(sides[0]), int(sides[1]))
            self.least_activation = pair_least_activation(
                self.longest, pair_planner_spec(cost, config, dp=world, zero_stage=3, state_bytes=0.0)
            )
        else:
            self.longest = max(longest or 0, max(self.lengths))
            self.least_activation = smallest_activation(
                [self.longest], planner_spec(cost, config, dp=world, zero_stage=3, state_bytes=0.0)
            )
        self._steps: dict[float, TypicalStep] = {}
        self._prices: dict[tuple[float, int, tuple[Choice, ...]], Prices] = {}
        at = {i: r for r, i in enumerate(self.order)}  # unit index -> its row in forward order
        self.unit_rows = np.array([at[i] for i in range(len(self.units))], dtype=np.int64)
        optimizer = cost.update.optimizer
        self.optimizer_fixed_ms = optimizer[0] if optimizer else 0.0
        self.seconds: Counter[str] = Counter()  # planning (typical steps), pricing, knapsack
        self.solves = 0

    def step(self, state_bytes: float) -> TypicalStep:
        if state_bytes not in self._steps:
            t0 = time.perf_counter()
            self._steps[state_bytes] = typical_step(
                self.lengths, self.cost, self.config, world=self.world, state_bytes=state_bytes, native=self.native
            )
            self.seconds["planning"] += time.perf_counter() - t0
        return self._steps[state_bytes]

    def select(self, prices: Prices, state_budget: float) -> Selection | None:
        t0 = time.perf_counter()
        found = select(prices, state_budget, resolution=self.resolution, native=self.native)
        self.seconds["knapsack"] += time.perf_counter() - t0
        self.solves += 1
        return found

    def prices(self, typ: TypicalStep | None, shard_size: int, cols: Sequence[Choice]) -> Prices:
        """Prices in forward order; without a step (memory only: it does not depend on the step) one
        micro-batch of no compute."""
        key = (typ.state_bytes if typ else -1.0, shard_size, tuple(cols))
        if key not in self._prices:
            t0 = time.perf_counter()
            ordered = [self.units[i] for i in self.order]
            if typ is None:
                fwd = bwd = np.zeros((len(ordered), 1))
            else:
                fwd, bwd = unit_compute(ordered, typ.component_ms)
            self._prices[key] = price(
                ordered,
                cols,
                dtype=self.cost.dtype,
                world=self.world,
                shard_size=shard_size,
                forward_ms=fwd,
                backward_ms=bwd,
                links=self.links,
                overlap=self.config.sharding.overlap,
                host=self.host,
            )
            self.seconds["pricing"] += time.perf_counter() - t0
        return self._prices[key]

    def shard_plan(
        self,
        choice: Sequence[int],
        cols: Sequence[Choice],
        prices: Prices,
        typ: TypicalStep | None,
        shard_size: int,
        selection: Selection | None = None,
    ) -> ShardPlan:
        """The plan of one column per unit (forward order), priced on ``typ``."""
        rows = np.arange(len(choice))
        chosen = np.asarray(choice)
        opened = prices.opens[chosen]
        reserve = float(prices.reserve_bytes[opened].max()) if opened.any() else 0.0
        at = {i: r for r, i in enumerate(self.order)}  # unit index -> its row in forward order
        units = tuple(
            UnitPlan(
                u.name,
                u.params,
                cols[c],
                float(prices.memory_bytes[r, c]),
                float(prices.comm_ms[r, c]),
                float(prices.exposed_ms[r, c]),
            )
            for u, r, c in ((u, at[i], chosen[at[i]]) for i, u in enumerate(self.units))
        )
        compute = (
            (typ.compute_ms if typ else 0.0) + self.optimizer_fixed_ms + float(prices.optimizer_ms[rows, chosen].sum())
        )
        frontier: tuple[tuple[float, float], ...] = ()
        if selection is not None and typ is not None:
            f = selection.frontier
            base = typ.compute_ms + self.optimizer_fixed_ms
            steps = [m for m in range(len(f)) if f[m] < np.inf and (m == 0 or f[m] < f[m - 1])]
            frontier = tuple(
                ((m * selection.unit_bytes + typ.activation_bytes) / MB, base + float(f[m])) for m in steps
            )
        return ShardPlan(
            self.model,
            self.world,
            shard_size,
            self.cost.dtype,
            self.host,
            self.budget,
            typ.micro_batches if typ else 0,
            typ.activation_bytes if typ else 0.0,
            reserve,
            compute,
            units,
            frontier,
            typ.state_bytes if typ else 0.0,
        )

    def minimum_error(self, least_states: float) -> ValueError:
        need = (least_states + self.least_activation) / MB
        longest = self.longest
        return ValueError(
            f"the memory budget, {self.budget / MB:.0f} MB per rank, is below the smallest possible sharding plan: "
            f"{need:.0f} MB ({least_states / MB:.0f} MB of model states with every module sharded as far as "
            f"{self.host} can, {self.least_activation / MB:.0f} MB of activations for the longest "
            f"{'(input, target) pair' if isinstance(longest, tuple) else 'sequence'}, {longest} tokens, alone); raise sharding.memory_budget_mb (or cluster.device.memory_mb) to at least "
            f"{math.ceil(need)} MB, or train on more ranks"
        )

    def candidate(
        self,
        choice: Sequence[int],
        cols: Sequence[Choice],
        prices: Prices,
        typ: TypicalStep | None,
        shard_size: int,
        selection: Selection | None = None,
    ) -> _Candidate:
        return _Candidate(self, tuple(choice), cols, prices, typ, shard_size, selection)

    def chain(
        self, shard_size: int, cols: list[Choice], choice: tuple[int, ...], state_bytes: float, rounds: int
    ) -> list[_Candidate]:
        """Plan, search, plan again with the states found, ...: each round's plan (and its choice)
        is the previous round's choices priced on the step planned with exactly their states."""
        out = []
        for k in range(rounds):
            typ = self.step(state_bytes)
            prices = self.prices(typ, shard_size, cols)
            # room for the typical step's activations, and for the run's longest sequence alone
            found = self.select(prices, self.budget - max(typ.activation_bytes, self.least_activation))
            plan = self.candidate(choice, cols, prices, typ, shard_size, found)
            out.append(plan)
            logger.debug(
                "sharding search, shard size %d, round %d: %d micro-batches, activations %.0f MB, model "
                "states %.0f MB, step %.1f ms (exposed %.1f ms)",
                shard_size,
                k,
                typ.micro_batches,
                typ.activation_bytes / MB,
                plan.state_bytes / MB,
                plan.step_ms,
                plan.exposed_ms,
            )
            if found is None or found.choice == choice:
                break
            choice = found.choice
            state_bytes = self.candidate(choice, cols, prices, None, shard_size).state_bytes
        return out

    def on_tighter_steps(self, plan: _Candidate) -> list[_Candidate]:
        """``plan``'s choices priced on every typical step planned with more model states than it
        holds (less room for activations, which it still fits in): where the planner, given the
        room, cuts more micro-batches than the communication is worth."""
        n, cols = plan.shard_size, plan.cols
        return [
            self.candidate(plan.choice, cols, self.prices(typ, n, cols), typ, n)
            for typ in list(self._steps.values())
            if typ.state_bytes > plan.state_bytes
        ]

    def ladder(self, shard_size: int, cols: list[Choice], least_state: float) -> list[_Candidate]:
        """The step planner given activation budgets on a ladder (the least any plan needs, times
        sqrt(2) per rung, up to what the smallest model states leave), and the fastest choices
        whose states fit beside each: the search over how the budget splits between model states
        and activations, which the chains reach only where the planner's steps lead them."""
        out = []
        room = self.budget - least_state
        rungs = int(math.floor(2 * math.log2(room / self.least_activation))) + 1 if room >= self.least_activation else 0
        for activations in [self.least_activation * 2 ** (k / 2) for k in range(rungs)] + [room]:
            typ = self.step(self.budget - activations)  # planned as if the states took the rest
            prices = self.prices(typ, shard_size, cols)
            found = self.select(prices, self.budget - activations)
            if found is not None:
                out.append(self.candidate(found.choice, cols, prices, typ, shard_size, found))
        return out

    def uniform(self, shard_size: int, cols: list[Choice], memory: Prices) -> list[_Candidate]:
        """Every unit the same choice (FSDP's strategies), each priced on its own planned step: the
        planner does not see communication, so a chain may settle on more micro-batches than one of
        these plans; with them among the candidates the search is never slower than a uniform plan."""
        plans = []
        for j, col in enumerate(cols):
            if col.kind == "split":
                continue
            choice = (j,) * len(self.units)
            state = self.candidate(choice, cols, memory, None, shard_size).state_bytes
            if state + self.least_activation <= self.budget:
                typ = self.step(state)
                plans.append(self.candidate(choice, cols, self.prices(typ, shard_size, cols), typ, shard_size))
        return plans

    def run(self, rounds: int) -> ShardPlan:
        candidates: list[_Candidate] = []
        least = math.inf
        for n in shard_sizes(self.config, self.world):
            cols = choice_columns(self.config, self.host, n)
            memory = self.prices(None, n, cols)
            small = tuple(int(c) for c in smallest(memory)[1])
            small_state = self.candidate(small, cols, memory, None, n).state_bytes
            least = min(least, small_state)
            if small_state + self.least_activation > self.budget:
                continue
            # the other end: the most model states the budget allows beside the smallest activations
            prices = self.prices(self.step(small_state), n, cols)
            big = self.select(prices, self.budget - self.least_activation)
            starts = [(small, small_state)]
            if big is not None and big.choice != small:
                starts.append((big.choice, self.candidate(big.choice, cols, memory, None, n).state_bytes))
            for choice, state in starts:
                candidates += self.chain(n, cols, choice, state, rounds)
            candidates += self.uniform(n, cols, memory) + self.ladder(n, cols, small_state)
        if not candidates:
            raise self.minimum_error(least)
        candidates += [p for plan in list(candidates) for p in self.on_tighter_steps(plan)]
        best = min(candidates, key=lambda p: p.step_ms).plan()
        logger.info(
            "sharding plan for %s on %d ranks (shard size %d, %s): %d micro-batches, peak %.0f of %.0f MB, "
            "step %.1f ms (compute %.1f, exposed communication %.1f); %d candidates from %d planned steps",
            self.model or "the model",
            self.world,
            best.shard_size,
            self.host,
            best.micro_batches,
            best.peak_bytes / MB,
            self.budget / MB,
            best.step_ms,
            best.compute_ms,
            best.exposed_ms,
            len(candidates),
            len(self._steps),
        )
        return best


def search_sharding(
    units: Sequence[ShardUnit],
    cost: TableCostModel | EncoderDecoderCostModel,
    config: DynPluginConfig,
    *,
    world: int,
    lengths: Sequence[int] | Sequence[tuple[int, int]],
    host: str = "fsdp2",
    model: str = "",
    native: bool = True,
    resolution: int = RESOLUTION,
    rounds: int = ROUNDS,
    timings: dict | None = None,
    longest: int | tuple[int, int] | None = None,
) -> ShardPlan:
    """The fastest sharding plan of ``units`` on ``world`` ranks within the memory budget
    (``sharding.memory_budget_mb``, else the device's memory times its fraction), for global
    batches like ``lengths``; ``host``: fsdp2 | fsdp1 | zero3, whose semantics price the choices;
    ``longest``: the longest sequence any step of the run may hold (default: ``lengths``'), which
    every plan leaves room for. An encoder-decoder: ``lengths`` (input, target) pairs, ``longest``
    the longest input and longest target. A budget below the smallest possible plan is a ValueError that says the minimum. ``timings``,
    if given, receives the milliseconds spent planning typical steps, pricing and in the knapsack,
    and how many knapsacks were solved."""
    search = _Search(
        units,
        cost,
        config,
        world=world,
        lengths=lengths,
        host=host,
        model=model,
        native=native,
        resolution=resolution,
        longest=longest,
    )
    try:
        return search.run(rounds)
    finally:
        if timings is not None:
            timings.update(
                {f"{k}_ms": v * 1e3 for k, v in search.seconds.items()},
                knapsack_solves=search.solves,
                typical_plans=len(search._steps),
            )


def uniform_plan(
    units: Sequence[ShardUnit],
    cost: TableCostModel,
    config: DynPluginConfig,
    choice: Choice,
    *,
    world: int,
    lengths: Sequence[int],
    host: str = "fsdp2",
    model: str = "",
    shard_size: int | None = None,
    native: bool = True,
    longest: int | tuple[int, int] | None = None,
) -> ShardPlan:
    """Every unit the same ``choice`` (``BASELINES``: FSDP's FULL_SHARD, SHARD_GRAD_OP, NO_SHARD),
    priced as the search prices its plans, on the step planned with its model states; sharded
    over ``shard_size`` ranks (default the world). A ValueError when it does not fit the budget."""
    search = _Search(
        units,
        cost,
        config,
        world=world,
        lengths=lengths,
        host=host,
        model=model,
        native=native,
        resolution=RESOLUTION,
        longest=longest,
    )
    n = shard_size or world
    per_unit = uniform_choice_units(units, choice)
    cols = sorted(set(per_unit.values()), key=lambda c: c.label)
    forward = tuple(cols.index(per_unit[units[i].name]) for i in search.order)
    memory = search.prices(None, n, cols)
    state = search.candidate(forward, cols, memory, None, n).state_bytes
    if state + search.least_activation > search.budget:
        raise ValueError(
            f"every module {choice.label} over {n} ranks does not fit: {state / MB:.0f} MB of model "
            f"states and at least {search.least_activation / MB:.0f} MB of activations (the longest "
            f"sequence alone) exceed the memory budget of {search.budget / MB:.0f} MB per rank "
            "(sharding.memory_budget_mb)"
        )
    typ = search.step(state)
    return search.shard_plan(forward, cols, search.prices(typ, n, cols), typ, n)


__all__ = [
    "BASELINES",
    "RESOLUTION",
    "ROUNDS",
    "Selection",
    "TypicalStep",
    "choice_columns",
    "search_sharding",
    "select",
    "shard_sizes",
    "smallest",
    "smallest_activation",
    "typical_step",
    "uniform_plan",
]
