"""Several hosts: learner hosts (one JAX program) and engine hosts (a Ray cluster), one entry point, three roles.

    python -m portable_rl.cluster --role head    --head HOST [--ray_port 6379] [-- <ray start flags>]
    python -m portable_rl.cluster --role engines --head HOST [--ray_port 6379] [-- <ray start flags>]
    python -m portable_rl.cluster --role learner --head HOST [--ray_port 6379] [--coordinator_port 8476]
                                  [--num_processes N --process_id I] [--cpu_devices D] -- <train flags>

scripts/slurm/portable_rl.sbatch runs one `head` and one `learner` per learner host (the head on learner host 0)
and one `engines` per engine host:

  head     learner host 0: `ray start --head --block`, the cluster's GCS on HOST:ray_port, offering no CPU or GPU
           to actors (the engines go to the engine hosts; the learner keeps this host's accelerators).
  engines  each engine host: waits for the head, then `ray start --address HOST:ray_port --block` (add
           `--num-gpus 8` etc. after --); the fleet's engine actors (engines/ray_fleet.py) land here.
  learner  each learner host, one process: JAX process `process_id` of `num_processes` (default: SLURM_PROCID
           and SLURM_NTASKS), its coordinator on HOST:coordinator_port, joined by `jax.distributed` as
           launch.py's processes are (`train.cli`, docs/scaling.md "Several hosts"). Process 0, the driver, must
           run on the head's host (Ray drivers attach to a local Ray node): it gets RAY_ADDRESS=HOST:ray_port,
           waits for the head, and its `ray_fleet` engine (gin/engines/ray_vllm.gin) joins the cluster and
           waits for its actors to be placed. Then `portable_rl.train` runs in this process with the flags
           after --.

`--cpu_devices D` gives each learner process D host CPU devices with gloo collectives (what launch.py sets up):
a CPU cluster, or the one-box rehearsal of tests/test_cluster.py; by default JAX takes the host's accelerators.

Stopping: SIGTERM / SIGINT to a head or engines role reaches `ray start --block`, which stops the Ray processes
it started and exits; the role then exits 0. A `ray start` that fails on its own is started again, 5 tries in all
(a new node must come up within Ray's fixed waits, ~15 s for its agents and 30 s to register, which a loaded host
or a slow shared filesystem misses; a second try finds the imports cached), and `ray start` dies with the role
even on a kill -9. A learner exits as `train` does: one process failing ends it at once (`launch.fail_fast`), and the scheduler
(`srun --kill-on-bad-exit`) or JAX's heartbeat ends the others.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from portable_rl.launch import COORDINATOR, NUM_PROCESSES, PROCESS_ID, cpu_devices_env, die_with_parent

ROLES = ("head", "engines", "learner")
LOOPBACK = ("127.0.0.1", "localhost")


def wait_for_port(host: str, port: int, timeout_s: float, what: str) -> None:
    """Returns once `host:port` accepts a TCP connection; SystemExit naming the fix after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: {what} at {host}:{port} did not answer within {timeout_s:.0f} s; start "
                                 "`--role head` on learner host 0 first (with the same --head / --ray_port), or "
                                 "raise --wait_s") from None
            time.sleep(1)


def is_local_address(host: str) -> bool:
    """True when `host` names this machine (binding a socket to it succeeds only for a local address)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((socket.gethostbyname(host), 0))
        return True
    except OSError:
        return False


def ray_start_command(role: str, head: str, ray_port: int, extra: list[str]) -> list[str]:
    """`ray start --block` for the head or an engine host (`extra`: more `ray start` flags, last wins)."""
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    if role == "head":
        return command + ["--head", f"--port={ray_port}", "--num-cpus=0", "--num-gpus=0", *extra]
    return command + [f"--address={head}:{ray_port}", *extra]


def run_ray_node(command: list[str], attempts: int = 5) -> int:
    """Runs `ray start --block` until it exits, starting it again (up to `attempts` times in all) when it fails on
    its own: a new node must come up within Ray's fixed waits (module doc), and an engine host fails too when
    the head it joins is not up yet. SIGTERM / SIGINT to this process are passed
    on. → 0 after a stop asked for that way (Ray exits 1 from its SIGTERM handler), else the last exit code."""
    stop_asked, child = [], None

    def forward(signum, frame=None):
        stop_asked.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    code = 0
    for attempt in range(1, attempts + 1):
        child = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent)
        try:
            code = child.wait()
        finally:
            if child.poll() is None:  # this process is ending some other way: take Ray's processes with it
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        if stop_asked:
            return 0
        if attempt < attempts:
            print(f"[cluster] ray start exited with code {code} (attempt {attempt} of {attempts}); starting it "
                  "again", file=sys.stderr, flush=True)
    return code


def learner_env(base: dict, *, head: str, ray_port: int, coordinator_port: int, num_processes: int,
                process_id: int, cpu_devices: int) -> dict:
    """Learner process `process_id`'s environment (module doc)."""
    env = dict(base)
    if num_processes > 1:
        env.update({COORDINATOR: f"{head}:{coordinator_port}", NUM_PROCESSES: str(num_processes),
                    PROCESS_ID: str(process_id)})
        if head in LOOPBACK:  # a one-box cluster: the coordinator listens on loopback only
            env["JAX_COORDINATOR_BIND_ADDRESS"] = f"{head}:{coordinator_port}"
    if process_id == 0:
        env["RAY_ADDRESS"] = f"{head}:{ray_port}"  # the fleet's ray.init(address=None) joins this cluster
    if cpu_devices:
        env.update(cpu_devices_env(base, cpu_devices))
    return env


def _process_count_and_id(args) -> tuple[int, int]:
    count = args.num_processes if args.num_processes is not None else os.environ.get("SLURM_NTASKS")
    index = args.process_id if args.process_id is not None else os.environ.get("SLURM_PROCID")
    if count is None or index is None:
        raise SystemExit("error: --role learner needs --num_processes and --process_id (or SLURM_NTASKS and "
                         "SLURM_PROCID: start it with srun, one task per learner host)")
    count, index = int(count), int(index)
    if not 0 <= index < count:
        raise SystemExit(f"error: process id {index} is not in 0..{count - 1}; give each learner host its own id")
    return count, index


def run_learner(args, train_argv: list[str]) -> None:
    count, index = _process_count_and_id(args)
    if index == 0:
        if not is_local_address(args.head):
            raise SystemExit(f"error: learner process 0 (the driver) runs on {socket.gethostname()}, but the Ray head "
                             f"--head {args.head} is another host; start learner process 0 on the head's host "
                             "(the sbatch script puts both on the allocation's first node)")
        wait_for_port(args.head, args.ray_port, args.wait_s, "the Ray head")
    os.environ.update(learner_env(dict(os.environ), head=args.head, ray_port=args.ray_port,
                                  coordinator_port=args.coordinator_port, num_processes=count, process_id=index,
                                  cpu_devices=args.cpu_devices))
    from portable_rl.train import cli  # after the environment: train.cli joins the JAX processes first

    cli(train_argv)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="python -m portable_rl.cluster --role ROLE --head HOST [options] -- ...")
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--head", required=True, help="the head host (learner host 0): its name or address")
    parser.add_argument("--ray_port", type=int, default=6379, help="the Ray head's GCS port")
    parser.add_argument("--coordinator_port", type=int, default=8476, help="JAX's coordinator port on the head")
    parser.add_argument("--num_processes", type=int, default=None, help="learner hosts (default SLURM_NTASKS)")
    parser.add_argument("--process_id", type=int, default=None, help="this learner's index (default SLURM_PROCID)")
    parser.add_argument("--cpu_devices", type=int, default=0, help="learner: D host CPU devices instead of GPUs")
    parser.add_argument("--wait_s", type=float, default=600.0, help="how long to wait for the Ray head")
    return parser.parse_args(own), rest


def main(argv=None) -> int:
    args, rest = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.role == "learner":
        run_learner(args, rest)
        return 0
    if args.role == "engines":
        wait_for_port(args.head, args.ray_port, args.wait_s, "the Ray head")
    return run_ray_node(ray_start_command(args.role, args.head, args.ray_port, rest))


if __name__ == "__main__":
    sys.exit(main())
