"""Benchmarks: `python -m longt5_jax.bench <name> ...` prints a table and writes JSON."""
