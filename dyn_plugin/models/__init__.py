"""Model-side helpers: building small HF models offline and the per-document attention kernel."""
