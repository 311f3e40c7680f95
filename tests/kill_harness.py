"""The fault harness every host's kill test drives: a job of a few ranks is killed, by SIGKILL, on
a random rank (or all of them) at a random point, and relaunched from its newest whole checkpoint
until one launch finishes; then the test checks each sample was trained exactly once and the
final parameters equal an uninterrupted run's.

Two halves:
- the driver (``train_with_kills``), in the test: draws the kill points from a seed it prints, and,
  as torchrun's agent does, takes the whole job down once one rank has died (the survivors would
  otherwise fail in their next collective, or under NCCL wait forever);
- the switch (``KillSwitch``), in the worker: reads ``KILL`` from the environment and kills its
  rank there. Points: ``startup`` (before the first step), ``forward:N`` (inside the N-th forward
  of this launch, half-way through the model: during a micro-batch), ``pre-forward:N`` (as the N-th
  forward starts: between micro-batches), ``save:N`` (inside the N-th checkpoint save, after its
  first file is half written), ``commit:N`` (the N-th save's files all written, its marker not yet),
  ``after-save:N`` (the N-th save published), ``planner:N`` (the job's planner processes, as the
  N-th forward starts: the ranks plan around them and the launch goes on; only where the worker
  runs planners and calls ``arm_planners``).

Each worker keeps, inside its checkpoints, what every step trained (the ``consumed`` log: each
step's global position and sample ids), so a resumed launch carries the history of the steps its
checkpoint holds and nothing of the steps it lost.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

POINTS = ("forward", "pre-forward", "save", "commit", "after-save")


@dataclass
class Kill:
    point: str  # "startup" or one of POINTS
    at: int  # the N-th event of that kind in the launch (1-based); 0 for startup
    victim: int | None  # the rank killed, None for every rank

    def env(self) -> str:
        who = "all" if self.victim is None else str(self.victim)
        return "none" if self.point == "none" else f"{self.point}:{self.at}@{who}"


NONE = Kill("none", 0, None)


def draw(rng: np.random.Generator, world: int, *, forwards: int, saves: int, planners: bool = False) -> Kill:
    """A kill point: a random kind (every kind equally), when in the launch, and on whom."""
    victim = None if rng.random() < 0.3 else int(rng.integers(world))
    point = str(rng.choice(("startup",) + POINTS + (("planner",) if planners else ())))
    if point == "planner":
        return Kill(point, int(rng.integers(1, forwards + 1)), 0)  # the host rank runs the planners
    if point == "commit" and victim is not None:
        victim = 0  # only a node's local rank 0 commits (the tests run one node)
    if point == "startup":
        return Kill(point, 0, victim)
    count = forwards if point in ("forward", "pre-forward") else saves
    return Kill(point, int(rng.integers(1, count + 1)), victim)


def _launch(
    launch: Callable[[dict], list[subprocess.Popen]], kill: Kill, timeout: float
) -> tuple[list[int], list[str]]:
    """One launch; once any rank has died, the rest are killed a moment later, as torchrun would.
    The output is read as it comes: a process writing more than a pipe holds would wait on it."""
    procs = launch({"KILL": kill.env()})
    logs = [b""] * len(procs)

    def read(i: int) -> None:
        if procs[i].stdout is not None:
            with procs[i].stdout as out:
                logs[i] = out.read()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(procs))]
    for reader in readers:
        reader.start()
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(0.5)  # a collective may still carry the failure to the others
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p, reader in zip(procs, readers):
        p.wait()
        reader.join()
    return [p.returncode for p in procs], [log.decode(errors="replace") for log in logs]


def killed_ranks(codes: list[int], logs: list[str]) -> list[int]:
    """The launch's processes that exited by SIGKILL, each process one rank."""
    return [r for r, c in enumerate(codes) if c == -signal.SIGKILL]


def train_with_kills(
    launch: Callable[[dict], list[subprocess.Popen]],
    *,
    fresh: Callable[[], None],
    check: Callable[[], None],
    kills: int,
    seed: int,
    world: int,
    forwards: int,
    saves: int,
    planners: bool = False,
    timeout: float = 240,
    died: Callable[[list[int], list[str]], list[int]] | None = None,
) -> int:
    """Train to the end again and again (``fresh()`` wipes the last round's checkpoints, ``check()``
    judges a finished round) until ``kills`` launches were killed; returns how many were.

    Within a round ``launch(env)`` (the ranks' processes, output captured) is run with a kill point
    drawn from ``seed`` until a launch finishes: one whose point lay beyond the work left finishes
    its round early, as does one whose planners were killed (counted: the ranks planned around
    them). ``forwards``/``saves``: how many of each one launch makes at most; ``planners``: the
    workers run planner processes, so ``planner`` kills are drawn too. ``died(codes,
    logs)``: the ranks a failed launch lost to SIGKILL; by default those of its processes that
    exited by it (one process a rank); where one launcher process (torchrun) runs the ranks, the
    test reads them from its output."""
    died = died or killed_ranks
    rng = np.random.default_rng(seed)
    print(f"kill points drawn with seed {seed}")
    killed, rounds = 0, 0
    while killed < kills:
        fresh()
        while True:
            kill = draw(rng, world, forwards=forwards, saves=saves, planners=planners) if killed < kills else NONE
            codes, logs = _launch(launch, kill, timeout)
            print(f"round {rounds}, kill at {kill.env()}: exit codes {codes}")
            if all(c == 0 for c in codes):
                killed += kill.point == "planner" and "planners killed" in logs[0]
                break
            assert kill is not NONE, "\n".join(log[-3000:] for log in logs)
            dead = died(codes, logs)
            assert dead, "\n".join(log[-3000:] for log in logs)  # a failure, not a kill
            assert kill.victim is None or kill.victim in dead, "\n".join(log[-3000:] for log in logs)
            killed += 1
        check()
        rounds += 1
    return killed


class KillSwitch:
    """The worker's half: ``KILL`` parsed, and the hooks that kill this rank where it says."""

    def __init__(self, rank: int) -> None:
        spec = os.environ.get("KILL", "none")
        self.point, self.at, self.mine = "none", 0, False
        if spec != "none":
            where, who = spec.split("@")
            self.point, _, at = where.partition(":")
            self.at = int(at or 0)
            self.mine = who == "all" or int(who) == rank
        self.counts = {p: 0 for p in POINTS}
        self._before_forward: Callable[[], None] = lambda: None
        self.pid = os.getpid()

    def _die(self) -> None:
        # the rank dies even where a process it forked hits the point (Megatron's checkpoint writers)
        os.kill(self.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def hit(self, point: str) -> None:
        """Count one event of ``point``; die if it is the one."""
        if point in self.counts:
            self.counts[point] += 1
            if self.mine and point == self.point and self.counts[point] == self.at:
                self._die()
        elif self.mine and point == self.point:
            self._die()

    def arm_planners(self, loader) -> None:
        """``planner:N``: this rank's planner processes killed as its N-th forward starts."""

        def kill_planners() -> None:
            pool = loader._pool
            if pool is not None and self.point == "planner" and self.counts["pre-forward"] == self.at:
                for proc in pool.procs:
                    os.kill(proc.pid, signal.SIGKILL)
                print(f"planners killed at forward {self.at}", flush=True)

        self._before_forward = kill_planners

    def arm_model(self, model) -> None:
        """Forward hooks: the model's own (between micro-batches) and its middle block's (during one)."""
        import torch

        blocks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
        middle = blocks[0][len(blocks[0]) // 2] if blocks else model

        def before(*_) -> None:
            self.hit("pre-forward")
            self._before_forward()

        model.register_forward_pre_hook(before)
        middle.register_forward_hook(lambda *_: self.hit("forward"))

    def arm_saves(self) -> None:
        """Inside a save: ``torch.save`` writes half a file and dies on the armed save's first file;
        the protocol's commit dies before its marker. Every rank counts saves the same way."""
        import torch

        from dyn_plugin.host import checkpoint

        original_save, original_commit, switch = torch.save, checkpoint.commit, self
        state = {"in_save": False, "first": False}

        def save(obj, f, *args, **kwargs):
            if state["in_save"] and state["first"] and switch.mine and switch.point == "save":
                state["first"] = False
                if isinstance(f, (str, os.PathLike)):
                    import io

                    buf = io.BytesIO()
                    original_save(obj, buf, *args, **kwargs)
                    with open(f, "wb") as out:
                        out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                        out.flush()
                switch._die()
            return original_save(obj, f, *args, **kwargs)

        def commit(directory, doc):
            switch.hit("commit")
            return original_commit(directory, doc)

        torch.save, checkpoint.commit = save, commit
        self._saving = state

    def saving(self):
        """Wrap one checkpoint save: counts it, arms ``save`` kills inside it, and ``after-save`` after."""
        import contextlib

        switch = self

        @contextlib.contextmanager
        def block():
            switch.counts["save"] += 1
            armed = switch.point == "save" and switch.counts["save"] == switch.at
            switch._saving.update(in_save=armed, first=armed)
            yield
            if armed and switch.mine:
                switch._die()  # a rank that wrote no file of its own dies as its part of the save ends
            switch._saving.update(in_save=False, first=False)
            switch.hit("after-save")

        return block()


def check_exactly_once(consumed: list[list], samples: int, epochs: int = 1) -> None:
    """``consumed``: (position, sample ids) per step trained, in order: positions 0, 1, 2, ... each
    once, and every sample ``epochs`` times."""
    positions = [p for p, _ in consumed]
    assert positions == list(range(len(positions))), f"steps lost or repeated: {positions}"
    ids = sorted(i for _, step in consumed for i in step)
    assert ids == sorted(list(range(samples)) * epochs), "samples lost or repeated"
