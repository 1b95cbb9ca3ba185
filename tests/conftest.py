"""Test-session settings.

Two workers (pytest-xdist, the README's `-n 2 --dist loadfile`): each test file is one work unit, run whole
on one worker, so a module-scoped fixture (an engine, a warm start, the multi-process launches) is built
once; the files that start a local Ray cluster share one unit (tests/xdist_files.py says why
this is not xdist's `loadgroup`). Units go out slowest first (`SLOWEST_FIRST`), so the session does not end
with one long file running alone; without xdist that order applies too.

OpenMP's idle threads sleep (OMP_WAIT_POLICY=PASSIVE, set here before any test module loads torch), as in the
CLI: spinning ones starve the other worker's work and their own engine's.

One persistent XLA compilation cache for the whole session: this process and every CLI subprocess the tests
start (they inherit the environment) share it, so a program several tests compile (the default run's learner
step and old-logprob pass, the SmolLM2 forward) is compiled once. Numerics are unchanged: a cache hit is the
same executable. A cache the caller set (JAX_COMPILATION_CACHE_DIR) is used as is and kept; the session's
own is removed at the end.

In-process compiles skip LLVM's optimizations (`jax_disable_most_optimizations`): the tests' programs are tiny
models compiled once and run a few times, so compiling dominates; the files it touches took 12 % less time
(docs/experiments/test_suite_time.md). Same arithmetic, less optimized machine code: every numeric assertion
holds as before. The CLI subprocesses the tests start keep the default (they run real training steps), and so
does a file marked `xla_optimized` (real-model forwards in process, where running dominates).
"""

import json
import os
import shutil
import tempfile

import pytest

# Files by their time under the README's command on a fresh 2-core Intel AMX clone, 2026-12-08 (196 s down to 44 s;
# docs/data/test_suite_time/2026-12-08_intel_amx_dfd46f6_files.json); every other file takes under 45 s and keeps
# pytest's order after these.
SLOWEST_FIRST = ("test_sql_recipe.py", "test_train_async_faults.py", "test_train_e2e.py", "test_smollm2_recipe.py",
                 "test_multihost.py", "test_benchmarks_smoke.py", "test_plan.py", "test_benchmarks_gpu_check.py",
                 "test_engines_ray.py", "test_bad_input.py", "test_multihost_launch.py", "test_gradient_fidelity.py",
                 "test_cluster.py", "test_engines_vllm_int8.py", "test_engines_vllm.py", "test_moe.py",
                 "test_engines_vllm_multiprocess.py", "test_smollm2.py")
# Files that call ray.init: one Ray cluster at a time, so one work unit.
RAY_FILES = ("test_engines_ray.py", "test_engines_contract.py")

# Idle OpenMP threads sleep instead of spinning, as the CLI entry points arrange before torch loads
# (engines/cpu_features.prefer_passive_omp_waits): OpenMP reads this once, when torch loads it, and the test
# modules import torch long before an engine starts. With spinning threads an in-process vLLM engine beside the
# other worker ran 3-10x slower (the INT8 engine file beside one busy core: 320 s spinning, 85 s passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_OWN_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="portable_rl_test_xla_cache_")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
    # Programs under 0.2 s to compile cost more to write and read back than to compile again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before the item's fixtures, so a module fixture's compiles follow its file's marker; imported here, after
    # the cache's environment variables above are set (JAX reads them when imported)
    import jax

    jax.config.update("jax_disable_most_optimizations", item.get_closest_marker("xla_optimized") is None)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# Seconds per test file (setup + call + teardown of its tests, module fixtures included), summed on the
# controller from every worker's reports: under `--dist loadfile` a file's sum is its wall time on its worker,
# so the longest one bounds a two-worker run.
_FILE_SECONDS: dict[str, float] = {}
SLOWEST_FILES_SHOWN = 10


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest test files of this run, so a slow addition is seen the day it lands."""
    if not _FILE_SECONDS or hasattr(terminalreporter.config, "workerinput"):  # workers report to the controller
        return
    ranked = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])
    terminalreporter.write_sep("=", f"{min(len(ranked), SLOWEST_FILES_SHOWN)} slowest test files (seconds, setup + "
                                    "call + teardown)")
    for path, seconds in ranked[:SLOWEST_FILES_SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    out = os.environ.get("PORTABLE_RL_TEST_FILE_SECONDS")
    if out:  # every file's seconds, for docs/data/test_suite_time/
        with open(out, "w") as f:
            json.dump({path: round(seconds, 1) for path, seconds in ranked}, f, indent=1)
        terminalreporter.write_line(f"every file's seconds: {out}")


def pytest_collection_modifyitems(config, items):
    # Stable: pytest's order after SLOWEST_FIRST. The Ray files need not sit together: the scheduler makes
    # them one unit, placed where the first of them is.
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None  # any other --dist: xdist's own scheduler
    from xdist_files import file_scheduler
    return file_scheduler({name: "ray" for name in RAY_FILES})(config, log)


def built_once(tmp_path_factory, name, build):
    """`build(path)` run once per test session, whichever worker asks first; every worker gets the same `path`.

    xdist workers' base temp directories share a parent, so the directory and its lock live there; the
    others wait on the lock and read what the first one built. A build that raised leaves no marker, so the
    next caller builds again (and fails with its own error)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / name
    with FileLock(str(path) + ".lock"):
        done = path.parent / f"{name}.built"
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real SmolLM2-135M-Instruct as an HF bf16 checkpoint: the repository's converted copy when a complete
    one is there (`python -m portable_rl.convert.gguf checkpoints/smollm2-135m-instruct`), else one conversion
    of the GGUF that scripts/setup.sh installs (~30 s), shared by the workers."""
    from pathlib import Path

    from portable_rl.convert import gguf

    repo_checkpoint = Path(__file__).resolve().parent.parent / "checkpoints" / "smollm2-135m-instruct"
    if gguf.is_complete(repo_checkpoint):
        return repo_checkpoint
    return built_once(tmp_path_factory, "smollm2-135m-instruct", gguf.convert_gguf)


@pytest.fixture(scope="session")
def arith_warmstart(tmp_path_factory):
    """The default run's warm start (gin/warmstart.gin) cut to 40 steps: the tiny Qwen2 answering 2-digit sums
    often enough for RL to have signal, built once for the files that train from it."""
    from processes import run_warmstart

    def build(path):
        run_warmstart(path, "--gin.WARMSTART_STEPS=40", timeout=600)

    return built_once(tmp_path_factory, "arith_warmstart_40", build)
