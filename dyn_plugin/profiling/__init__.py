"""Measurement with torch: times and memory of a real model per micro-batch, the optimizer step
and the gradient all-reduce, fitted into the pure cost models of ``dyn_plugin.cost``."""
