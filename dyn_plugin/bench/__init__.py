"""Benchmarks behind ``dynplugin bench``: planner, loader and store. Each returns records that
the command prints as a table or as JSON; none is a timed test."""
