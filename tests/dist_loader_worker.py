"""One training rank for the multi-process loader tests (run as a script, env-based rendezvous).

Writes, per step it consumed, the step's digest and its samples to OUT/rank{r}.jsonl; checks
with gloo that every rank holds the same plan digest at every step.
"""

import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from dyn_plugin.layout import RankLayout  # noqa: E402
from dyn_plugin.runtime.loader import DynLoader  # noqa: E402
from test_loader import make  # noqa: E402


def main() -> None:
    # the loader's collectives (the run-id gather, the plan check) call nothing deprecated: torch
    # attributes its warnings to its own wrappers, so every one fails this rank
    warnings.simplefilter("error", FutureWarning)
    warnings.simplefilter("error", DeprecationWarning)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, mode = sys.argv[1], sys.argv[2]  # mode: full | stop-after:K | resume | skew:lengths | skew:config
    store = json.loads(os.environ.get("TEST_STORE", '{"backend": "none"}'))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    skew = mode.split(":")[1] if mode.startswith("skew") and rank == 1 else None
    over = {"microbatching": {"global_tokens": 2500, "max_seq_len": 600}} if skew == "config" else {}
    cfg, cm, lens, data = make(store=store, loader={"planners": 2, "prefetch": 3, "plan_timeout_s": 30}, **over)
    if skew == "lengths":
        lens = lens.copy()
        lens[5] += 1
    loader = DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(world), column=rank, seed=11)
    if loader._store is not None:
        with open(os.path.join(out, f"namespace{rank}.txt"), "w") as f:
            f.write(loader._store.namespace)
    if mode.startswith("skew"):
        from dyn_plugin.runtime.plan_agreement import PlanMismatch

        try:
            next(iter(loader))
        except PlanMismatch as exc:
            with open(os.path.join(out, f"mismatch{rank}.txt"), "w") as f:
                f.write(str(exc))
        dist.destroy_process_group()
        return
    state_path = os.path.join(out, f"state{rank}.json")
    if mode == "resume":
        with open(state_path) as f:
            loader.load_state_dict(json.load(f))
    if loader._pool is None and loader.is_host and store["backend"] != "none":
        loader._source.start_planners(loader.position)
    with open(os.path.join(out, f"pids{rank}.json"), "w") as f:
        json.dump([p.pid for p in loader._pool.procs] if loader._pool else [], f)
    stop_after = int(mode.split(":")[1]) if mode.startswith("stop-after") else None
    with open(os.path.join(out, f"rank{rank}.jsonl"), "a") as log:
        for n, step in enumerate(loader):
            digest = torch.tensor([int(step.digest, 16) % (1 << 62)])
            gathered = [torch.zeros_like(digest) for _ in range(world)]
            dist.all_gather(gathered, digest)
            assert all(int(g) == int(digest) for g in gathered), f"ranks disagree on step {step.index}"
            log.write(
                json.dumps(
                    {"step": step.index, "digest": step.digest, "samples": [i for mb in step.sample_ids for i in mb]}
                )
                + "\n"
            )
            log.flush()
            if stop_after is not None and n + 1 == stop_after:
                with open(state_path, "w") as f:
                    json.dump(loader.state_dict(), f)
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)  # a crash: nothing is cleaned up by us
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
