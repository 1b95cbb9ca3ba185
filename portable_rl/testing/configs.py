"""Compact config construction for tests and benchmarks: `dapo_config(n_samples=4, mini_batch_size=2)`.

`rl.DapoConfig` is built from its parts (`DapoConfig(generation=GenerationConfig(n_samples=4), ...)`); tests set a
handful of fields across several parts, so this sorts flat field names into the part that owns each.
"""

from __future__ import annotations

import dataclasses

from portable_rl.rl.dapo import DapoConfig


def dapo_config(**fields) -> DapoConfig:
    """A `DapoConfig` whose parts take the given fields (each name belongs to exactly one part); the rest default."""
    parts = {f.name: f.default_factory for f in dataclasses.fields(DapoConfig)}
    owner = {name: part for part, cls in parts.items() for name in (f.name for f in dataclasses.fields(cls))}
    unknown = sorted(set(fields) - set(owner))
    if unknown:
        raise TypeError(f"dapo_config: no part of DapoConfig has the fields {unknown}")
    kwargs = {part: cls(**{k: v for k, v in fields.items() if owner[k] == part}) for part, cls in parts.items()}
    return DapoConfig(**kwargs)
