"""Test-session settings.

One persistent XLA compilation cache for the whole session: this process and every CLI subprocess the tests
start (they inherit the environment) share it, so a program several tests compile (the default run's learner
step and old-logprob pass, the SmolLM2 forward) is compiled once. Numerics are unchanged: a cache hit is the
same executable. A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as is and kept; the session's
own is removed at the end.
"""

import os
import shutil
import tempfile

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="portable_rl_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # Programs under 0.2 s to compile cost more to write and read back than to compile again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
