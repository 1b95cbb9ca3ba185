"""`python -m portable_rl.launch` with real processes, without JAX (this file is also the child program):
one process dying stops the others at once and the launcher names it; SIGTERM to the launcher reaches every
process; every process gets its cluster environment (`pytest -k multihost` selects these)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHILD = "tests.test_multihost_launch"  # run by the launcher as `python -m tests.test_multihost_launch`


def _launch(tmp_path, mode, **kw):
    env = dict(os.environ, CHILD_MODE=mode, CHILD_DIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-m", "portable_rl.launch", "--num_processes", "3",
                             "--devices_per_process", "2", "--module", CHILD, "--", "--flag=x"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_multihost_launcher_stops_all_when_one_dies(tmp_path):
    start = time.time()
    proc = _launch(tmp_path, "die")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "[launch] error: process 2 (pid" in out and "exited with code 3; stopped the other 2 processes" in out
    assert time.time() - start < 30  # not the 120 s the others would sleep
    pids = [json.loads((tmp_path / f"{i}.json").read_text())["pid"] for i in range(3)]
    assert not any(_alive(p) for p in pids)  # no orphan
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


def _child():
    """One launched process: records its environment, then dies (process 2, mode die) or waits."""
    rank, where, mode = int(os.environ["PORTABLE_RL_PROCESS_ID"]), Path(os.environ["CHILD_DIR"]), os.environ["CHILD_MODE"]
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
