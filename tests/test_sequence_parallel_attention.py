"""Sequence-parallel attention (Ulysses and ring) and its process groups on gloo ranks: forward
and backward equal single-process per-document attention; groups exist only for aligned
power-of-two blocks; a group's ranks draw the same random numbers (tests/sp_attention_worker.py)."""

import pytest

from ranks import run


@pytest.mark.parametrize(
    "world, checks",
    [
        (2, "attention,rng,llama,memory"),
        (4, "attention,groups"),
        (3, "groups"),
    ],
)
def test_sequence_parallel_ranks(world, checks):
    codes, logs = run("sp_attention_worker.py", checks, world=world, timeout=120)
    assert codes == [0] * world, "\n".join(logs)
