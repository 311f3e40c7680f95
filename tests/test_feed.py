"""The device feed every host's micro-batches go through (one batch ahead, the chosen keys moved,
host ints left on the host), and the loader's pinned tensors for a GPU (the CUDA side, side-stream
copies with no host sync, is to be checked on a GPU: BENCHMARKS.md, issue 26)."""

import torch

from dyn_plugin.host.feed import DeviceFeed


def test_the_feed_moves_the_next_batch_while_this_one_is_in_use():
    pulled = []

    def batches():
        for i in range(3):
            pulled.append(i)
            yield {"x": torch.full((2,), i), "n": 5, "dropped": torch.zeros(1), "longest": torch.tensor([7 + i])}

    feed = DeviceFeed(batches(), torch.device("cpu"), keys=("x", "n", "longest"), host_keys=("longest",))
    assert pulled == [0]  # the first batch starts moving at once
    got = []
    for batch in feed:
        got.append(batch)
        assert pulled == list(range(min(len(got) + 1, 3)))  # handing one out starts the next
    assert [b["x"].tolist() for b in got] == [[0, 0], [1, 1], [2, 2]]
    assert all(set(b) == {"x", "n", "longest"} and b["n"] == 5 for b in got)
    assert [int(b["longest"][0]) for b in got] == [7, 8, 9]
    assert next(feed, None) is None


def test_an_empty_step_feeds_nothing():
    assert list(DeviceFeed([], torch.device("cpu"))) == []


def test_the_loader_hands_a_gpu_pinned_tensors(monkeypatch):
    from dyn_plugin.runtime.loader import DynLoader
    from test_loader import make

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned.append(self) or self)  # no CUDA here
    cfg, cm, lens, data = make()
    step = next(iter(DynLoader(data, lengths=lens, config=cfg, cost_model=cm, device="cuda")))
    handed = [v for mb in step.micro_batches for v in mb.values() if torch.is_tensor(v)]
    assert handed and len(pinned) == len(handed) and all(any(p is v for p in pinned) for v in handed)
    pinned.clear()
    next(iter(DynLoader(data, lengths=lens, config=cfg, cost_model=cm, device="cpu")))
    assert pinned == []  # a CPU run copies nothing


def test_a_copy_to_a_gpu_is_pinned_and_non_blocking(monkeypatch):
    """What the pipeline's positions and input masks take to the device (they were blocking copies
    from pageable memory: a wait for the stream per micro-batch); on CPU a plain move."""
    from dyn_plugin.host.feed import copy_to

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: calls.append((a, k)) or self)
    t = torch.arange(3)
    copy_to(t, torch.device("cuda"))
    assert calls == ["pin", ((torch.device("cuda"),), {"non_blocking": True})]
    calls.clear()
    copy_to(t, torch.device("cpu"))
    assert calls == [((torch.device("cpu"),), {})]
