"""One rank of the two-node checkpoint test: each rank plays its own node, with its own checkpoint
directory, and resumes the loader from its own copy (run as a script). ``stale``: rank 1's copy of
the tag is then replaced by another save under the same name (a node that missed the last sync)."""

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


class Files:
    """DeepSpeed's checkpoint engine, as far as save_checkpoint uses it: one file per save."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)


class NodeLocalEngine:
    """What save/load_checkpoint ask of a DeepSpeed engine, writing to this node's disk only."""

    global_steps = 2

    def __init__(self, weights: float = 1.0) -> None:
        self.checkpoint_engine = Files()
        self.weights = weights

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        self.checkpoint_engine.save({"w": torch.full((4,), self.weights)}, os.path.join(save_dir, tag, "model.pt"))

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
    if sys.argv[2] == "stale":  # rank 1's node holds another save under the same name
        other = loader()
        deepspeed_ext.save_checkpoint(
            NodeLocalEngine(2.0), other, node_dir if rank == 1 else os.path.join(out, "x"), tag="t"
        )
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
