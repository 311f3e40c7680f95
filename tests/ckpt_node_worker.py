"""One rank of the two-node checkpoint test: each rank plays its own node (LOCAL_RANK=0 on both),
with its own checkpoint directory, and resumes the loader from its own copy (run as a script)."""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import deepspeed_ext  # noqa: E402
from dyn_plugin.host.checkpoint import MARKER  # noqa: E402
from dyn_plugin.layout import RankLayout  # noqa: E402
from dyn_plugin.runtime.loader import DynLoader  # noqa: E402
from test_loader import make  # noqa: E402


class NodeLocalEngine:
    """What save/load_checkpoint ask of a DeepSpeed engine, writing to this node's disk only."""

    global_steps = 2

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        os.makedirs(os.path.join(save_dir, tag), exist_ok=True)

    def load_checkpoint(self, load_dir, tag):
        path = os.path.join(load_dir, tag)
        return (path, {}) if os.path.isdir(path) else (None, None)


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = sys.argv[1]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg, cm, lens, data = make()
    node_dir = os.path.join(out, f"node{rank}")

    def loader() -> DynLoader:
        return DynLoader(data, lengths=lens, config=cfg, cost_model=cm, layout=RankLayout(world), column=rank, seed=11)

    first = loader()
    it = iter(first)
    for _ in range(2):
        next(it)
    deepspeed_ext.save_checkpoint(NodeLocalEngine(), first, node_dir, tag="t")
    resumed = loader()
    result = {"written": os.path.exists(os.path.join(node_dir, "t", MARKER))}
    try:
        deepspeed_ext.load_checkpoint(NodeLocalEngine(), resumed, node_dir, tag="t")
        result["resumed_step"] = resumed.step
        result["next_digest_equal"] = next(iter(resumed)).digest == next(it).digest
    except RuntimeError as exc:  # raised on every rank when one node has no whole copy
        result["error"] = str(exc)
    with open(os.path.join(out, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
