"""Sequence lengths, offline: real corpora tokenized into length distributions, bundled copies
and what padding and packing waste on them. The planners consume lengths; nothing here plans."""
