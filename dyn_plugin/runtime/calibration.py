"""The run's online calibration: what each step measured, on every rank, refits the cost model's
time terms (cost/online.py), and each new version prices the global batches from a set position
on, for every rank and every planner process alike.

Plans must be the same on every rank without talking (runtime/plan_source.py), so every rank runs
the same calibrator on the same measurements: after each step the ranks all-gather their
micro-batches' (forward, backward) times, in rank order, and feed them all. A version fitted after
the step at position ``p`` prices positions from ``p + 1 + lag`` on: with a store, planner processes
have planned up to ``prefetch`` positions ahead already (``lag`` = ``loader.prefetch``), and the host
rank publishes every version under ``CALIBRATION_KEY`` before it moves the store's cursor past
``p``, so no planner plans a position a version covers without holding it (planner_worker.py
reads the key after the cursor). Without a store each rank plans the next step after this one
ran (``lag`` 0).

Memory: each rank's peak device bytes of the step (a GPU's allocator count) against the plan's
prediction for it: their activation part sets the memory factor (cost/online.py), which rises at
once (the next position is planned with it, and a plan made ahead with the older one is made
again: plan_source.py) and falls slowly.

What is observed: micro-batches that ran alone on this rank (a sequence-parallel shard's time
holds its collectives, which the tables do not price) under one recompute mode on every layer
(a pyramid's partial checkpointing mixes two tables). The calibrator's state and the versions
travel with the loader's position in checkpoints, so a resume prices its steps as the run did.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from ..config import CalibrationConfig
from ..cost.online import Calibration, CalibrationSettings, Observation, OnlineCalibrator
from ..plan.steps.instructions import PlannedMicroBatch
from ..plan.steps.spec import MB
from .planning import PlanningContext

logger = logging.getLogger(__name__)

CALIBRATION_KEY = "calibration"  # in the plan store: every version after 0, as a JSON list


class RunCalibration:
    """The calibrator of one rank's loader. ``store()``: the plan store, or None (read when
    publishing: the loader opens it); ``host``: whether this rank publishes the versions."""

    def __init__(
        self,
        context: PlanningContext,
        config: CalibrationConfig,
        *,
        lag: int,
        store: Callable[[], Any],
        host: bool,
    ) -> None:
        self.context, self.lag, self._store, self._host = context, lag, store, host
        settings = CalibrationSettings(
            warmup_steps=config.warmup_steps,
            window=config.window,
            every=config.every,
            max_change=config.max_change,
            min_observations=config.min_observations,
        )
        # the base is the spec's model: priced at the pad multiple the runtime pads to
        self.calibrator = OnlineCalibrator(context.spec.cost, context.spec.stages, settings)
        self.errors: list[tuple[int, float]] = []  # (position, mean abs. % error of its micro-batches as planned)
        self._unpublished = False  # a version the store did not take (it was down): put again at the next step

    def observe(
        self,
        position: int,
        stage: int,
        loaded: list[PlannedMicroBatch],
        timings: list,
        peak_bytes: float | None = None,
        predicted_peak_mb: float | None = None,
    ) -> None:
        """One step's (forward ms, backward ms or None) per micro-batch this rank ran (``timings``), and its
        measured peak device bytes against the plan's prediction for this rank (either None where
        not known); every rank calls it after the step, and they gather what each measured."""
        import torch.distributed as dist

        mine = [
            obs.to_dict()
            for desc, times in zip(loaded, timings)
            if (obs := self._observation(position, stage, desc, times)) is not None
        ]
        planned = self.context.calibration_at(position)
        ratio = self._memory_ratio(planned, stage, peak_bytes, predicted_peak_mb)
        gathered = [(mine, ratio)]
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (mine, ratio))
        observations = [Observation.from_dict(d) for rank, _ in gathered for d in rank]
        if observations:
            error = self.calibrator.prediction_error(observations, planned)
            self.errors.append((position, error))
            logger.debug("step %d: prediction error %.1f%% (calibration v%d)", position, 100 * error, planned.version)
        self.calibrator.observe(observations)
        self.calibrator.observe_memory(position, [r for _, r in gathered if r is not None])
        # a rise of the memory factor prices the very next step: a plan made ahead with the old one
        # is made again (plan_source) rather than run into an overflow
        new = self.calibrator.maybe_update(position, from_step=position + 1 + self.lag, memory_from_step=position + 1)
        if new is not None:
            self.context.add_calibration(new)
        if new is not None or self._unpublished:
            self._publish()

    def _memory_ratio(
        self, planned: Calibration, stage: int, peak_bytes: float | None, predicted_peak_mb: float | None
    ) -> float | None:
        """The step's measured activation bytes over what the profile (uncalibrated) predicted for
        them: the plan's peak less the stage's model states, divided by the memory factor of
        ``planned``, the calibration it was priced with."""
        if peak_bytes is None or predicted_peak_mb is None:
            return None
        states = self.context.spec.memory[stage].states
        predicted = (predicted_peak_mb * MB - states) / planned.memory
        if predicted <= 0:
            return None
        return (peak_bytes - states) / predicted

    def _observation(self, position: int, stage: int, desc: PlannedMicroBatch, times: tuple) -> Observation | None:
        forward, backward = times
        layers = desc.checkpointed[stage] if desc.checkpointed else None
        full = self.context.spec.stages[stage].num_layers
        if desc.sp > 1 or (layers is not None and 0 < layers < full):
            return None
        recompute = "none" if layers == 0 else desc.recompute
        pairs = self.context.pairs  # then seq_lens are (input, target) pairs, priced by the shape
        return Observation(
            seq_lens=tuple(int(n[0]) if pairs else int(n) for n in desc.seq_lens),
            layout=desc.layout,
            recompute=recompute,
            tp=self.context.tp,
            stage=stage,
            forward_ms=float(forward),
            backward_ms=None if backward is None else float(backward),
            step=position,
            shape=desc.shape if pairs else (),  # (rows, input width, target width)
        )

    def _publish(self) -> None:
        """Put every version in the store (the host rank). A store that is down does not stop
        training: the ranks plan for themselves meanwhile (plan_source.py), planners that missed a
        version price with an older one, whose plans the ranks make again, and the versions are put
        again after the next step until the store takes them."""
        from ..store import StoreUnavailable

        store = self._store()
        if store is None or not self._host:
            return
        versions = [c.to_dict() for c in self.context.calibrations[1:]]
        try:
            store.put(CALIBRATION_KEY, json.dumps(versions).encode())
        except StoreUnavailable as exc:
            if not self._unpublished:
                logger.warning(
                    "calibration v%d not published (%s); put again after the next step",
                    self.context.calibrations[-1].version,
                    exc,
                )
            self._unpublished = True
            return
        self._unpublished = False

    def state_dict(self) -> dict[str, Any]:
        return {
            "calibrator": self.calibrator.state_dict(),
            "versions": [c.to_dict() for c in self.context.calibrations[1:]],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved calibration; one fitted against another profile (the resumed run prices
        with another model, or pads otherwise) starts afresh: its factors would mean something else."""
        try:
            self.calibrator.load_state_dict(state["calibrator"])
        except ValueError as exc:
            logger.warning("%s: the online calibration starts afresh", exc)
            return
        for version in state["versions"]:
            self.context.add_calibration(Calibration.from_dict(version))
        self._publish()
