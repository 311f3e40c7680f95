"""One rank of the checkpoint fault tests (tests/test_checkpoint_faults.py), run as a script:
``HOST OUT HARNESS_PORT [SCENARIO ...]`` on 2 gloo ranks.

HOST: ``files`` (``deepspeed_ext``'s save and load around a stand-in engine that writes one torch
file per rank, and the loader's plan checks), ``deepspeed`` (a real ZeRO-1 engine) or ``fsdp``
(FSDP2 through ``torch.distributed.checkpoint``). Each scenario acts (a fault injected on one rank,
``faults.inject``), then every rank records what it raised and how long it took, and meets the other
at a barrier of the harness's own TCPStore, with a timeout: a rank still inside a collective then
(waiting for one that raised alone) is reported as hung, while the rank that raised stays alive, so
nothing outside rescues it. Then the scenario's check reads the outcome (the latest whole checkpoint,
DeepSpeed's ``latest``...), and the ranks meet again. Results: ``OUT/result-RANK.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepspeed_ext  # noqa: E402
from dyn_plugin.host import checkpoint  # noqa: E402
from dyn_plugin.host.checkpoint_files import DirectoryLock  # noqa: E402
from faults import inject  # noqa: E402

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
BARRIER_S = 30  # a scenario's errors reach every rank well within this, or a rank is hung


def steps_of(loader):
    """The loader's steps, epoch after epoch."""
    while True:
        yield from loader


class Harness:
    def __init__(self, out: str, port: int) -> None:
        self.out, self.results = out, {}
        self.store = dist.TCPStore("127.0.0.1", port, WORLD, RANK == 0, timeout=timedelta(seconds=60))

    def _meet(self, key: str) -> None:
        self.store.set(f"{key}/{RANK}", "1")
        try:
            self.store.wait([f"{key}/{r}" for r in range(WORLD)], timedelta(seconds=BARRIER_S))
        except Exception:
            self.results.setdefault(key.split("#")[0], {})["peer_hung"] = key
            self.flush()
            os._exit(3)

    def scenario(self, name: str, act: Callable[[], Any], check: Callable[[], Any] | None = None) -> None:
        start = time.monotonic()
        try:
            value, error = act(), None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # torch's CheckpointException is a BaseException
            value, error = None, f"{type(exc).__name__}: {exc}"
        self.results[name] = {"error": error, "value": value, "s": round(time.monotonic() - start, 3)}
        self.flush()
        self._meet(f"{name}#acted")
        if check is not None:
            try:
                self.results[name]["check"] = check()
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:
                self.results[name]["check_error"] = f"{type(exc).__name__}: {exc}"
            self.flush()
            self._meet(f"{name}#checked")

    def close(self) -> None:
        """The last meeting; rank 0, whose process serves the harness's store, leaves last."""
        self._meet("end")
        self.store.set(f"left/{RANK}", "1")
        if RANK == 0:
            self.store.wait([f"left/{r}" for r in range(WORLD)], timedelta(seconds=BARRIER_S))

    def flush(self) -> None:
        with open(os.path.join(self.out, f"result-{RANK}.json"), "w") as f:
            json.dump(self.results, f, indent=1)


# --- the stand-in engine: DeepSpeed's save and load calls, one torch file per rank ----------------


class Files:
    def save(self, state_dict, path):
        torch.save(state_dict, path)


class FileEngine:
    """What deepspeed_ext's save and load ask of a DeepSpeed engine."""

    global_steps = 1

    def __init__(self) -> None:
        self.checkpoint_engine = Files()

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        directory = os.path.join(save_dir, tag)
        self.checkpoint_engine.save({"w": torch.full((256,), float(RANK))}, os.path.join(directory, f"rank{RANK}.pt"))
        if RANK == 0:
            self.checkpoint_engine.save({"model": torch.arange(64.0)}, os.path.join(directory, "model.pt"))
        dist.barrier()  # DeepSpeed's own save ends in one

    def load_checkpoint(self, load_dir, tag):
        return os.path.join(load_dir, tag), {}


def rel(path: str | None, root: str) -> str | None:
    return None if path is None else os.path.relpath(path, root)


def latest(root: str) -> str | None:
    try:
        with open(os.path.join(root, deepspeed_ext.checkpoint.LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def on_rank0(fn: Callable[[], None]) -> None:
    """Damage done once, by rank 0, between two agreed points."""
    dist.barrier()
    if RANK == 0:
        fn()
    dist.barrier()


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def files_scenarios(h: Harness, out: str, only: set[str]) -> None:
    from dyn_plugin.layout import RankLayout
    from dyn_plugin.runtime.loader import DynLoader
    from test_loader import make

    cfg, cm, lens, data = make()

    def loader(verify: str = "hashes") -> DynLoader:
        config = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"verify": verify})})
        return DynLoader(
            data, lengths=lens, config=config, cost_model=cm, layout=RankLayout(WORLD), column=RANK, seed=11
        )

    def save(root: str, tag: str, trained: DynLoader | None = None) -> str:
        return deepspeed_ext.save_checkpoint(FileEngine(), trained or loader(), root, tag=tag)

    def load(root: str, tag: str | None = None, verify: str = "hashes") -> str:
        path, _ = deepspeed_ext.load_checkpoint(FileEngine(), loader(verify), root, tag=tag)
        return rel(path, root)

    def root_of(name: str) -> str:
        root = os.path.join(out, name)
        os.makedirs(root, exist_ok=True)
        return root

    def outcome(root: str, tag: str) -> Callable[[], dict]:
        def check() -> dict:
            newest = checkpoint.agreed_newest(root)
            return {
                "newest": rel(newest.path if newest else None, root),
                "latest": latest(root),
                "marker": os.path.exists(checkpoint.marker_path(os.path.join(root, tag))),
            }

        return check

    # 1. an I/O error on one rank, in the protocol's own writes or in the host's
    for fault in (
        "fsync-file:EIO@1",
        "fsync-file:ENOSPC@0",
        "fsync-dir:EDQUOT@0",
        "write:ENOSPC@1",
        "replace-marker:EIO@0",
    ):
        name = f"io-{fault}"
        if only and name not in only:
            continue
        root = root_of(name.replace(":", "-").replace("@", "-"))

        def act(root=root, fault=fault) -> list[str]:
            save(root, "step1")
            with inject(fault, RANK) as struck:
                save(root, "step2")
            return struck

        h.scenario(name, act, outcome(root, "step2"))

    # 2. a marker one node cannot read: skipped by the resume, refused when named, on both ranks
    root = root_of("unreadable")
    if not only or "unreadable-auto" in only:
        h.scenario("unreadable-setup", lambda: [save(root, "step1"), save(root, "step2")])

        def auto() -> str:
            with inject("read-marker:EACCES@1", RANK, where="step2"):
                return rel(checkpoint.agreed_newest(root).path, root)

        def named() -> str:
            with inject("read-marker:EACCES@1", RANK, where="step2"):
                return load(root, "step2")

        h.scenario("unreadable-auto", auto)
        h.scenario("unreadable-named", named)

    # 3. damage after the commit: truncated, a flipped byte (same size), a file added
    for damage in ("truncated", "flipped", "added"):
        name = f"damaged-{damage}"
        if only and name not in only:
            continue
        root = root_of(name)

        def act(root=root, damage=damage) -> str:
            save(root, "step1")
            save(root, "step2")
            victim = os.path.join(root, "step2", "rank1.pt")
            if damage == "added":
                on_rank0(
                    lambda: shutil.copy(
                        victim, os.path.join(root, "step2", "zero_pp_rank_5_mp_rank_00_optim_states.pt")
                    )
                )
            else:
                on_rank0(lambda: (truncate if damage == "truncated" else flip)(victim))
            return load(root, "step2")

        def check(root=root) -> dict:
            auto = load(root)
            try:
                sizes_only = load(root, "step2", verify="sizes")
            except Exception as exc:
                sizes_only = f"{type(exc).__name__}: {exc}"
            return {"auto": auto, "sizes_only": sizes_only}

        h.scenario(name, act, check)

    # 4. a re-save into a used directory: what the old save left (a larger world's shard) is gone
    if not only or "resave" in only:
        root = root_of("resave")

        def resave() -> dict:
            save(root, "step1")
            stray = os.path.join(root, "step1", "zero_pp_rank_5_mp_rank_00_optim_states.pt")
            on_rank0(lambda: shutil.copy(os.path.join(root, "step1", "rank1.pt"), stray))
            save(root, "step1")
            return {"files": sorted(os.listdir(os.path.join(root, "step1"))), "loaded": load(root, "step1")}

        h.scenario("resave", resave)

    # 5. a re-save that fails: DeepSpeed's latest no longer names it
    if not only or "resave-fails" in only:
        root = root_of("resave-fails")

        def act() -> None:
            save(root, "step1")
            save(root, "step2")
            with inject("write:ENOSPC@1", RANK):
                save(root, "step2")

        h.scenario("resave-fails", act, outcome(root, "step2"))

    # 6. nested tags: saved, named, found by the resume, named by latest
    if not only or "nested" in only:
        root = root_of("nested")

        def nested() -> dict:
            save(root, "step1")
            save(root, "run1/step2")
            return {"named": load(root, "run1/step2"), "auto": load(root), "latest": latest(root)}

        h.scenario("nested", nested)
        h.scenario("bad-tag", lambda: save(root, "run1/../../x"))

    # 7. a resume from an older tag on purpose, then a save: that save is the latest, whatever its position
    if not only or "branch" in only:
        root = root_of("branch")

        def branch() -> dict:
            trained = loader()
            steps = iter(trained)
            for tag in ("a", "b", "c"):
                next(steps)
                save(root, tag, trained)
            again = loader()
            deepspeed_ext.load_checkpoint(FileEngine(), again, root, tag="a")
            save(root, "d", again)
            found = checkpoint.agreed_newest(root)
            return {
                "auto": rel(found.path, root),
                "positions": {t: checkpoint.read(os.path.join(root, t)).position for t in "abcd"},
                "sequences": {t: checkpoint.read(os.path.join(root, t)).sequence for t in "abcd"},
                "parent": rel(found.parent["path"], root),
            }

        h.scenario("branch", branch)

    # 8. a second writer of the same directory (another process holds its lock)
    if not only or "two-writers" in only:
        root = root_of("two-writers")

        def act() -> None:
            save(root, "step1")
            os.makedirs(os.path.join(root, "step2"), exist_ok=True)
            held = DirectoryLock(os.path.join(root, "step2")) if RANK == 0 else None
            try:
                save(root, "step2")
            finally:
                if held is not None:
                    held.release()

        h.scenario("two-writers", act, outcome(root, "step2"))

    # 9. a plan from the store that fails its check on one rank: every rank stops at the same step
    if not only or "plan-rejected" in only:
        from dyn_plugin.store import PayloadError

        store = {"backend": "tcp", "port": int(os.environ["STORE_PORT"]), "namespace": "faults"}
        scfg, scm, slens, sdata = make(store=store, loader={"planners": 1, "prefetch": 2, "plan_timeout_s": 30})

        def rejected() -> int:
            planned = DynLoader(
                sdata, lengths=slens, config=scfg, cost_model=scm, layout=RankLayout(WORLD), column=RANK, seed=11
            )
            wait = planned._store.wait
            calls = {"n": 0}

            def forged(key, timeout_s):
                calls["n"] += 1
                if RANK == 1 and calls["n"] == 2:
                    raise PayloadError(f"HMAC check failed for '{key}': forged (injected)")
                return wait(key, timeout_s)

            planned._store.wait = forged
            done = 0
            try:
                for _ in planned:
                    dist.barrier()  # the step's collectives: a rank that raised alone leaves the other here
                    done += 1
            finally:
                h.results.setdefault("plan-rejected-steps", {})[RANK] = done
                planned.close()
            return done

        h.scenario("plan-rejected", rejected)

    # 10. ranks running different planning code: refused by name before they share a plan
    if not only or "other-build" in only:
        import dyn_plugin.runtime.plan_agreement as agreement_module

        def other_build(store: dict | None) -> None:
            real = agreement_module.build
            if RANK == 1:
                agreement_module.build = lambda: "dyn-plugin 9.9.9 without its C++ extension"
            try:
                over = {"store": store} if store else {}
                bcfg, bcm, blens, bdata = make(**over)
                planned = DynLoader(
                    bdata, lengths=blens, config=bcfg, cost_model=bcm, layout=RankLayout(WORLD), column=RANK, seed=11
                )
                try:
                    next(iter(planned))
                finally:
                    planned.close()
            finally:
                agreement_module.build = real

        h.scenario("other-build", lambda: other_build(None))
        port = int(os.environ["STORE_PORT"]) + 1
        h.scenario("other-build-store", lambda: other_build({"backend": "tcp", "port": port, "namespace": "b"}))


def deepspeed_scenarios(h: Harness, out: str, only: set[str]) -> None:
    from dyn_plugin.models.hf import build_causal_lm
    from token_mean import MODEL, random_dataset

    lengths, data = random_dataset(0)
    torch.manual_seed(0)
    config = {
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
        "dyn_plugin": {
            "microbatching": {"global_tokens": 1200, "max_seq_len": 256},
            "cost_model": {"kind": "analytic", "dtype": "fp32"},
            "calibration": {"enabled": False},  # bit for bit across faults: plans from the profile alone
        },
    }
    engine, _, loader, _ = deepspeed_ext.initialize(
        model=build_causal_lm(MODEL),
        config=config,
        dataset=data,
        lengths=lengths,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        seed=5,
    )
    steps = steps_of(loader)

    def train() -> None:
        deepspeed_ext.train_step(engine, next(steps))

    def weights() -> float:
        return float(sum(p.detach().double().sum() for p in engine.module.parameters()))

    def root_of(name: str) -> str:
        root = os.path.join(out, name)
        os.makedirs(root, exist_ok=True)
        return root

    def shard(root: str, tag: str, rank: int) -> str:
        return os.path.join(root, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")

    if not only or "ds-write" in only:
        root = root_of("ds-write")

        def act() -> list[str]:
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step1")
            with inject("write:ENOSPC@1", RANK) as struck:
                deepspeed_ext.save_checkpoint(engine, loader, root, tag="step2")
            return struck

        def check() -> dict:
            return {
                "latest": latest(root),
                "marker": os.path.exists(checkpoint.marker_path(os.path.join(root, "step2"))),
            }

        h.scenario("ds-write", act, check)

    if not only or "ds-resave-fails" in only:
        root = root_of("ds-resave-fails")

        def act() -> None:
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step1")
            h.results["ds-step1-weights"] = weights()
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step2")
            with inject("write:ENOSPC@0", RANK):
                deepspeed_ext.save_checkpoint(engine, loader, root, tag="step2")

        def check() -> dict:
            train()  # moved off step1's weights: the load must bring them back
            path, _ = engine.load_checkpoint(root)  # DeepSpeed's own load, tag=None: it reads `latest`
            return {"latest": latest(root), "loaded": rel(path, root), "weights": weights()}

        h.scenario("ds-resave-fails", act, check)

    if not only or "ds-nested" in only:
        root = root_of("ds-nested")

        def nested() -> dict:
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="run1/step1")
            saved = weights()
            train()
            path, _ = deepspeed_ext.load_checkpoint(engine, loader, root)
            return {"loaded": rel(path, root), "latest": latest(root), "same": weights() == saved}

        h.scenario("ds-nested", nested)

    if not only or "ds-damaged" in only:
        root = root_of("ds-damaged")

        def act() -> str:
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step1")
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step2")
            on_rank0(lambda: flip(shard(root, "step2", 1)))
            path, _ = deepspeed_ext.load_checkpoint(engine, loader, root, tag="step2")
            return rel(path, root)

        def check() -> str:
            path, _ = deepspeed_ext.load_checkpoint(engine, loader, root)
            return rel(path, root)

        h.scenario("ds-damaged", act, check)

    if not only or "ds-resave" in only:
        root = root_of("ds-resave")

        def resave() -> list[str]:
            train()
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step1")
            on_rank0(lambda: shutil.copy(shard(root, "step1", 1), shard(root, "step1", 3)))  # a larger world's
            deepspeed_ext.save_checkpoint(engine, loader, root, tag="step1")
            deepspeed_ext.load_checkpoint(engine, loader, root, tag="step1")
            return sorted(os.listdir(os.path.join(root, "step1")))

        h.scenario("ds-resave", resave)


def fsdp_scenarios(h: Harness, out: str, only: set[str]) -> None:
    from dyn_plugin import fsdp
    from fsdp_kill_worker import planned_run

    model, optimizer, loader, _ = planned_run("fsdp2", WORLD)
    steps = steps_of(loader)

    def train() -> None:
        fsdp.train_step(model, optimizer, next(steps))

    def root_of(name: str) -> str:
        root = os.path.join(out, name)
        os.makedirs(root, exist_ok=True)
        return root

    if not only or "fsdp-fsync" in only:
        root = root_of("fsdp-fsync")

        def act() -> list[str]:
            train()
            fsdp.save_checkpoint(model, optimizer, loader, root, "step1")
            with inject("fsync-file:EIO@1", RANK) as struck:
                fsdp.save_checkpoint(model, optimizer, loader, root, "step2")
            return struck

        def check() -> dict:
            found = checkpoint.agreed_newest(root)
            marker = os.path.exists(checkpoint.marker_path(os.path.join(root, "step2")))
            return {"newest": rel(found.path, root), "marker": marker}

        h.scenario("fsdp-fsync", act, check)

    if not only or "fsdp-damaged" in only:
        root = root_of("fsdp-damaged")

        def act() -> str:
            train()
            fsdp.save_checkpoint(model, optimizer, loader, root, "step1")
            train()
            fsdp.save_checkpoint(model, optimizer, loader, root, "step2")
            on_rank0(lambda: flip(os.path.join(root, "step2", "__1_0.distcp")))
            path, _ = fsdp.load_checkpoint(model, optimizer, loader, root, "step2")
            return rel(path, root)

        def check() -> str:
            path, _ = fsdp.load_checkpoint(model, optimizer, loader, root)
            return rel(path, root)

        h.scenario("fsdp-damaged", act, check)

    if not only or "fsdp-resave" in only:
        root = root_of("fsdp-resave")

        def resave() -> list[str]:
            train()
            fsdp.save_checkpoint(model, optimizer, loader, root, "step1")
            on_rank0(
                lambda: shutil.copy(
                    os.path.join(root, "step1", "__1_0.distcp"), os.path.join(root, "step1", "__3_0.distcp")
                )
            )
            fsdp.save_checkpoint(model, optimizer, loader, root, "step1")
            fsdp.load_checkpoint(model, optimizer, loader, root, "step1")
            return sorted(os.listdir(os.path.join(root, "step1")))

        h.scenario("fsdp-resave", resave)


def main() -> None:
    host, out, port, only = sys.argv[1], sys.argv[2], int(sys.argv[3]), set(sys.argv[4:])
    torch.set_num_threads(1)
    # a collective that waits for a rank that raised alone must outlast the harness's barrier: only
    # the exchange of errors may end it, never the process group's timeout
    if host == "deepspeed":
        deepspeed_ext.skip_cpu_shm_build()
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=600))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    h = Harness(out, port)
    {"files": files_scenarios, "deepspeed": deepspeed_scenarios, "fsdp": fsdp_scenarios}[host](h, out, only)
    h.close()
    os._exit(0)  # torch's native teardown takes seconds on CPU


if __name__ == "__main__":
    main()
