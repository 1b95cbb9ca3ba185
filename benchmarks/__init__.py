"""Benchmarks: scripts that time or size one thing (throughput, step time, memory, cost ratios).

Run from the repository root as modules, e.g. `python -m benchmarks.rollout --help`; measured numbers live in
docs/benchmarks.md, not here. Shared helpers: benchmarks/bench_common.py."""
