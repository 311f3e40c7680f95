"""Heterogeneous strategies from the length distribution (Hydraulis): the candidate schemes
(``schemes``) and the proposal and per-step assignment of sequences to them (``strategy``)."""
