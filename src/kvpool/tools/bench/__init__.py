"""Benchmarks, run as ``kvpool bench <name>``; each prints a table with ratios to a baseline."""
