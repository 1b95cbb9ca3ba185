"""`python -m portable_rl.launch` with real processes (this file is also the child program), JAX-free but one:
one process dying stops the others at once and the launcher names it; SIGTERM to the launcher reaches every
process; every process gets its cluster environment (`pytest -k multihost` selects these)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHILD = "tests.test_multihost_launch"  # run by the launcher as `python -m tests.test_multihost_launch`


def _launch(tmp_path, mode, **kw):
    env = dict(os.environ, CHILD_MODE=mode, CHILD_DIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-m", "portable_rl.launch", "--num_processes", "3",
                             "--devices_per_process", "2", "--module", CHILD, "--", "--flag=x"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def test_multihost_launcher_stops_all_when_one_dies(tmp_path):
    start = time.time()
    proc = _launch(tmp_path, "die")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "[launch] error: process 2 (pid" in out and "exited with code 3; stopped the other 2 processes" in out
    assert time.time() - start < 30  # not the 120 s the others would sleep
    pids = [json.loads((tmp_path / f"{i}.json").read_text())["pid"] for i in range(3)]
    from processes import alive  # tests/ (not importable by the child program, which needs none of it)

    assert not any(alive(p) for p in pids)  # no orphan
    env = [json.loads((tmp_path / f"{i}.json").read_text()) for i in range(3)]
    assert [e["PORTABLE_RL_PROCESS_ID"] for e in env] == ["0", "1", "2"]
    assert {e["PORTABLE_RL_COORDINATOR"] for e in env} == {env[0]["PORTABLE_RL_COORDINATOR"]}
    assert env[0]["PORTABLE_RL_COORDINATOR"].startswith("127.0.0.1:") and env[1]["argv"] == ["--flag=x"]
    assert all(e["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2") for e in env)
    assert "[process 1] child 1 started" in out  # the others' output, prefixed


def test_multihost_launcher_forwards_sigterm_to_every_process(tmp_path):
    proc = _launch(tmp_path, "sigterm")
    deadline = time.time() + 60
    while len(list(tmp_path.glob("*.json"))) < 3 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert sorted(p.name for p in tmp_path.glob("*.stopped")) == ["0.stopped", "1.stopped", "2.stopped"]


@pytest.mark.slow
def test_multihost_followers_outwait_a_late_driver(tmp_path):
    """The driver reaches the step's broadcast and the stop vote 35 s after the other processes (as after
    an engine start, a long generation or eval): a bare gloo collective gives up after 30 s
    (DEADLINE_EXCEEDED); `Processes.broadcast` / `any` wait at a coordination-service barrier first."""
    proc = _launch(tmp_path, "late_driver")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.done")) == ["0.done", "1.done", "2.done"]


@pytest.mark.slow
def test_multihost_an_error_on_one_process_ends_the_run_at_once(tmp_path):
    """Process 1 raises while the others wait in a collective: `launch.fail_fast` (train.cli uses it) ends
    it at once instead of JAX's exit-time shutdown barrier (which waits minutes for the blocked others)."""
    start = time.time()
    proc = _launch(tmp_path, "raise")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1 and "ValueError: bad input on process 1" in out, out[-3000:]
    assert "[launch] error: process 1 (pid" in out and "exited with code 1" in out
    assert time.time() - start < 120, time.time() - start


def _raise_on_one(rank):
    from portable_rl.launch import fail_fast, initialize_from_environment

    initialize_from_environment()
    from portable_rl.rl.multihost import Processes

    def work():
        procs = Processes.current()
        if procs.index == 1:
            raise ValueError("bad input on process 1")
        procs.broadcast({"x": 1} if procs.is_driver else None)  # waits for process 1, which never comes

    fail_fast(work)


def _late_driver(rank, where):
    from portable_rl.launch import initialize_from_environment

    initialize_from_environment()
    import numpy as np

    from portable_rl.rl.multihost import Processes

    procs = Processes.current()
    if procs.is_driver:
        time.sleep(35)
    got = procs.broadcast({"x": np.arange(5)} if procs.is_driver else None)
    if procs.is_driver:
        time.sleep(35)
    stop = procs.any(rank == 2)
    assert got["x"].tolist() == [0, 1, 2, 3, 4] and stop
    (where / f"{rank}.done").write_text("")


def _child():
    """One launched process: records its environment, then dies (process 2, mode die) or waits."""
    rank, where, mode = int(os.environ["PORTABLE_RL_PROCESS_ID"]), Path(os.environ["CHILD_DIR"]), os.environ["CHILD_MODE"]
    if mode == "late_driver":
        return _late_driver(rank, where)
    if mode == "raise":
        return _raise_on_one(rank)
    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
    keys = ("PORTABLE_RL_PROCESS_ID", "PORTABLE_RL_NUM_PROCESSES", "PORTABLE_RL_COORDINATOR", "XLA_FLAGS")
    (where / f"{rank}.json").write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:],
                                                    **{k: os.environ[k] for k in keys}}))
    print(f"child {rank} started", flush=True)
    if mode == "die" and rank == 2:
        while len(list(where.glob("*.json"))) < 3:
            time.sleep(0.05)
        sys.exit(3)
    deadline = time.time() + 120
    while not stopped and time.time() < deadline:
        time.sleep(0.05)
    if stopped:
        (where / f"{rank}.stopped").write_text("")


if __name__ == "__main__":
    _child()
