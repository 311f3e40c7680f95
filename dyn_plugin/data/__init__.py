"""Data: real sequence-length distributions and their analysis."""
