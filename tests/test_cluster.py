"""`python -m portable_rl.cluster` and scripts/slurm/portable_rl.sbatch: bad input is one line, and (slow) the
script's three role lines, run as they are on one box (head 127.0.0.1, CPUs), train two steps: a Ray head, an
engine node holding the fleet's vLLM engine, and two JAX learner processes numbered by SLURM_PROCID."""

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from portable_rl import cluster
from portable_rl.launch import COORDINATOR, NUM_PROCESSES, PROCESS_ID, free_port
from processes import alive

REPO = Path(__file__).resolve().parent.parent
SBATCH = REPO / "scripts/slurm/portable_rl.sbatch"


# ------------------------------------------------------------------------------------------ fast checks
def test_learner_environment_and_ray_commands():
    env = cluster.learner_env({"XLA_FLAGS": "--xla_foo"}, head="node0", ray_port=6379, coordinator_port=8476,
                              num_processes=2, process_id=0, cpu_devices=0)
    assert (env[COORDINATOR], env[NUM_PROCESSES], env[PROCESS_ID]) == ("node0:8476", "2", "0")
    assert env["RAY_ADDRESS"] == "node0:6379" and "JAX_PLATFORMS" not in env  # GPUs: JAX picks them itself
    assert "JAX_COORDINATOR_BIND_ADDRESS" not in env  # other hosts must reach it
    follower = cluster.learner_env({}, head="127.0.0.1", ray_port=1, coordinator_port=2, num_processes=2,
                                   process_id=1, cpu_devices=3)
    assert "RAY_ADDRESS" not in follower and follower["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:2"
    assert follower["JAX_PLATFORMS"] == "cpu" and follower["XLA_FLAGS"].endswith("device_count=3")
    alone = cluster.learner_env({}, head="node0", ray_port=1, coordinator_port=2, num_processes=1, process_id=0,
                                cpu_devices=0)
    assert COORDINATOR not in alone and alone["RAY_ADDRESS"] == "node0:1"  # one learner: no jax.distributed
    head = cluster.ray_start_command("head", "node0", 6379, ["--temp-dir=/x"])
    assert head[-5:] == ["--head", "--port=6379", "--num-cpus=0", "--num-gpus=0", "--temp-dir=/x"]
    assert "--block" in head
    assert cluster.ray_start_command("engines", "node0", 6379, ["--num-gpus=8"])[-2:] == [
        "--address=node0:6379", "--num-gpus=8"]


@pytest.mark.parametrize("argv, env, message", [
    (["--role", "learner", "--head", "127.0.0.1"], {}, "needs --num_processes and --process_id (or SLURM_NTASKS"),
    (["--role", "learner", "--head", "127.0.0.1"], {"SLURM_NTASKS": "2", "SLURM_PROCID": "2"},
     "process id 2 is not in 0..1"),
    (["--role", "learner", "--head", "192.0.2.1", "--num_processes", "2", "--process_id", "0"], {},
     "but the Ray head --head 192.0.2.1 is another host; start learner process 0 on the head's host"),
    (["--role", "engines", "--head", "127.0.0.1", "--ray_port", "{port}", "--wait_s", "1"], {},
     "the Ray head at 127.0.0.1:{port} did not answer within 1 s; start `--role head` on learner host 0 first"),
])
def test_bad_input_is_one_line(argv, env, message, monkeypatch):
    for key in ("SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    port = str(free_port())  # nothing listens there
    with pytest.raises(SystemExit) as e:
        cluster.main([a.replace("{port}", port) for a in argv])
    text = str(e.value.code)
    assert text.startswith("error: ") and message.replace("{port}", port) in text and "\n" not in text, text


NODE = """import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # as `ray start --block` does, after stopping its node
open(sys.argv[1], "w").write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_a_ray_node_role_passes_a_stop_on_and_takes_its_node_along(tmp_path, stop):
    """`run_ray_node` with a stand-in for `ray start --block`: SIGTERM to the role reaches it and the role exits 0;
    a kill -9 of the role takes it along (PR_SET_PDEATHSIG)."""
    pid_file = tmp_path / "node.pid"
    role = subprocess.Popen([sys.executable, "-c", "import sys; from portable_rl.cluster import run_ray_node; "
                             f"sys.exit(run_ray_node([sys.executable, '-c', {NODE!r}, {str(pid_file)!r}]))"],
                            cwd=REPO)
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    node = int(pid_file.read_text())
    role.send_signal(stop)
    assert role.wait(timeout=60) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    deadline = time.time() + 10
    while alive(node) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(node)


def test_a_ray_node_that_fails_on_its_own_is_started_again_five_times(tmp_path):
    starts = tmp_path / "starts"
    fails = f"import sys; open({str(starts)!r}, 'a').write('x'); sys.exit(3)"
    role = subprocess.run([sys.executable, "-c", "import sys; from portable_rl.cluster import run_ray_node; "
                           f"sys.exit(run_ray_node([sys.executable, '-c', {fails!r}]))"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert role.returncode == 3 and starts.read_text() == "xxxxx"
    assert "ray start exited with code 3 (attempt 4 of 5); starting it again" in role.stderr


# ------------------------------------------------------------------------------------------ the rehearsal
def role_lines(script: Path) -> dict[str, list[str]]:
    """{role: argv} of the script's `"$PYTHON" -m portable_rl.cluster --role ...` lines (continuations joined)."""
    logical = re.sub(r"\\\n", " ", script.read_text())
    lines = {}
    for line in logical.splitlines():
        match = re.search(r'"\$PYTHON" -m portable_rl\.cluster --role (\w+).*', line)
        if match:
            words = shlex.split(match.group(0))
            lines[match.group(1)] = words[:-1] if words[-1] == "&" else words
    return lines


def expand(words: list[str], values: dict[str, object]) -> list[str]:
    """The shell's expansion of `words` with `values`: a list value replaces a whole word ($RAY_ARGS, $@)."""
    out = []
    for word in words:
        name = word[1:] if word.startswith("$") else None
        if name in values and isinstance(values[name], list):
            out += values[name]
            continue
        expanded = re.sub(r"\$(\w+)", lambda m: str(values[m.group(1)]), word)
        out.append(expanded)
    return out


def descendants(roots: list[int]) -> set[int]:
    """The processes below `roots` now (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
            children.setdefault(int(rest.rsplit(") ", 1)[1].split()[1]), []).append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in found:
                found.add(child)
                frontier.append(child)
    return found


def _stop(procs: dict[str, subprocess.Popen], timeout_s: float = 60) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.time() + timeout_s
    for proc in procs.values():
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
@pytest.mark.vllm
def test_the_sbatch_roles_train_two_steps_on_a_local_ray_cluster(tmp_path):
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from portable_rl.convert.tiny_checkpoint import make_tiny_checkpoint

    lines = role_lines(SBATCH)
    assert sorted(lines) == ["engines", "head", "learner"]
    model, run = make_tiny_checkpoint(tmp_path / "tiny", "qwen2"), tmp_path / "run"
    # Ray's session dirs hold Unix sockets (107-byte paths): short temp dirs, one per node
    head_tmp, engines_tmp = (tempfile.mkdtemp(prefix="prl_ray_", dir="/tmp") for _ in range(2))
    def node():  # every agent port given: the raylet then does not wait ~20 s for agents to report theirs (which
        # fails when a loaded box starts them slowly), and the two nodes on this box take different ones
        ports = ("dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent")
        return ["--node-ip-address=127.0.0.1", "--object-store-memory=200000000",
                *(f"--{name}-port={free_port()}" for name in ports)]
    values = {
        "PYTHON": sys.executable, "HEAD": "127.0.0.1", "RAY_PORT": free_port(), "COORDINATOR_PORT": free_port(),
        "GPUS_PER_NODE": 0, "LEARNER_ARGS": ["--cpu_devices", "2"],
        "@": ["--gin_file=gin/dapo_fp8.gin", "--gin_file=gin/engines/ray_vllm.gin", "--gin_file=gin/learner/mesh.gin",
              "--gin.MESH_DATA=2", "--gin.MESH_FSDP=2", "--gin.NUM_ENGINES=1", f"--gin.MODEL_PATH='{model}'",
              f"--gin.RUN_DIR='{run}'",
              "--gin.TRAIN_STEPS=2", "--gin.rl.RunConfig.eval_size=16",
              # a random policy earns no reward: without dynamic sampling its all-zero groups still make an update
              "--gin.rl.DataConfig.dynamic_sampling=False"],
    }
    ray_args = {  # one box, two Ray nodes: each its own temp dir and ports that the other does not take
        "head": [f"--temp-dir={head_tmp}", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                 *node()],
        "engines": [f"--temp-dir={engines_tmp}", "--num-cpus=2", *node()],
    }
    env = {k: v for k, v in os.environ.items()
           if k not in (COORDINATOR, NUM_PROCESSES, PROCESS_ID, "RAY_ADDRESS", "PORTABLE_RL_MULTIHOST")}
    # a loaded, shared box: agents start slowly, and Ray's memory monitor would kill the engine for memory that the
    # other users of the box hold (the kernel's OOM killer still applies)
    env.update(PYTHONUNBUFFERED="1", RAY_agent_register_timeout_ms="300000", RAY_memory_monitor_refresh_ms="0",
               RAY_AUTH_MODE="disabled")  # not a token that another user of the box writes to ~/.ray meanwhile
    procs: dict[str, subprocess.Popen] = {}
    logs, passed = {}, False

    def start(name, role, **extra_env):
        logs[name] = open(tmp_path / f"{name}.log", "w")
        argv = expand(lines[role], {**values, "RAY_ARGS": ray_args.get(role, [])})
        procs[name] = subprocess.Popen(argv, cwd=REPO, env={**env, **extra_env}, stdout=logs[name],
                                       stderr=subprocess.STDOUT, start_new_session=True)

    def log(name):
        return (tmp_path / f"{name}.log").read_text()

    try:
        start("head", "head")
        start("engines", "engines")
        for i in range(2):  # srun's numbering
            start(f"learner{i}", "learner", SLURM_NTASKS="2", SLURM_PROCID=str(i))
        deadline = time.time() + 1200
        while any(procs[f"learner{i}"].poll() is None for i in range(2)) and time.time() < deadline:
            assert procs["head"].poll() is None, log("head")[-3000:]
            time.sleep(1)
        codes = [procs[f"learner{i}"].poll() for i in range(2)]
        assert codes == [0, 0], (f"learners exited {codes} (Ray logs: {head_tmp}, {engines_tmp}):\n"
                                 f"{log('head')[-1500:]}\n{log('learner0')[-4000:]}\n{log('learner1')[-2000:]}")

        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
        assert [r["step"] for r in rows] == [0, 1, 2], rows  # written once, by the driver
        assert all(r.get("train/loss") is not None for r in rows[1:])  # the learner really stepped
        assert (run / "checkpoints" / "2" / "COMMITTED").exists()  # both processes wrote their shards
        assert "ray_fleet" in (run / "config.gin").read_text()
        # The engine ran on the engine node (the head offers no CPU to actors), in its own Ray worker process.
        engine_logs = [p.read_text(errors="replace") for p in Path(engines_tmp).glob("session_*/logs/worker-*.out")]
        assert any("EngineHost" in text for text in engine_logs), sorted(Path(engines_tmp).rglob("worker-*"))[:5]
        assert not any("EngineHost" in p.read_text(errors="replace")
                       for p in Path(head_tmp).glob("session_*/logs/worker-*.out"))

        started = descendants([p.pid for p in procs.values()])
        _stop(procs)
        time.sleep(2)
        left = sorted(pid for pid in started if alive(pid))
        assert not left, f"processes left after SIGTERM to the roles: {left}"
        assert [procs[name].returncode for name in ("head", "engines")] == [0, 0], (log("head")[-2000:],
                                                                                    log("engines")[-2000:])
        passed = True
    finally:
        stragglers = descendants([p.pid for p in procs.values()])
        _stop(procs, timeout_s=20)
        for pid in stragglers:  # ours by construction: below the role processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for f in logs.values():
            f.close()
        if passed:  # else the Ray logs stay for a look (the paths are in the failure's message)
            for tmp in (head_tmp, engines_tmp):
                shutil.rmtree(tmp, ignore_errors=True)
