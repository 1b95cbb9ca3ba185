"""Test-session settings.

Two workers (pytest-xdist, the README's `-n 2 --dist loadgroup`): each test file is one group, run whole on
one worker, so a module-scoped fixture (an engine, a warm start, the multi-process launches) is built once;
the files that start a local Ray cluster share one group; files named in `FIRST` go first (none now), so the
session does not end on one of them running alone. Without xdist only that order applies.

One persistent XLA compilation cache for the whole session: this process and every CLI subprocess the tests
start (they inherit the environment) share it, so a program several tests compile (the default run's learner
step and old-logprob pass, the SmolLM2 forward) is compiled once. Numerics are unchanged: a cache hit is the
same executable. A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as is and kept; the session's
own is removed at the end.
"""

import os
import shutil
import tempfile

import pytest

# Files to start first, in this order (empty: the measured 26-min run used pytest's order); the rest keep it.
FIRST = ()
# Files that call ray.init: one Ray cluster at a time.
RAY_FILES = ("test_engines_ray.py", "test_engines_contract.py")

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="portable_rl_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # Programs under 0.2 s to compile cost more to write and read back than to compile again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: pytest's order otherwise
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("ray" if name in RAY_FILES else name))
