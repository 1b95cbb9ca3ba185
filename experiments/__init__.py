"""Experiment drivers: scripts that run training arms or studies and aggregate what they measure.

Run from the repository root as modules, e.g. `python -m experiments.fp8_tis_experiment --help`; results live
in docs/experiments/ and docs/benchmarks.md, not here."""
