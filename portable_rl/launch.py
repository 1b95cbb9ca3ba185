"""Several JAX processes on one box, one program: a multi-host learner without the hosts.

    python -m portable_rl.launch --num_processes 2 --devices_per_process 4 -- \\
        --gin_file=gin/dapo_fp8.gin --gin_file=gin/learner/mesh.gin --gin.MESH_DATA=2 --gin.MESH_FSDP=4

starts `python -m portable_rl.train <the flags after -->` N times, process i with

    PORTABLE_RL_COORDINATOR=127.0.0.1:<free port>     process 0 runs JAX's coordination service there
    PORTABLE_RL_NUM_PROCESSES=N  PORTABLE_RL_PROCESS_ID=i
    JAX_PLATFORMS=cpu  XLA_FLAGS=--xla_force_host_platform_device_count=D  JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo

and `train.cli` calls `initialize_from_environment()` (→ `jax.distributed.initialize`) before JAX starts.
The mesh then spans N × D devices; process 0 is the driver (rl/multihost.py, rl/roles.py).

One dies, all stop: a process that exits non-zero or is killed takes the others with it (SIGKILL to each
process group: the survivors would otherwise wait in a collective for the dead peer until JAX's heartbeat
timeout), and the launcher exits non-zero naming it; nothing half-written is ever restored (the
checkpoint's COMMITTED marker is written last), so rerunning the same command resumes. SIGTERM / SIGINT
to the launcher goes to every process: each finishes its step, they agree on the step, checkpoint it
and exit 0. The processes die with the launcher (PR_SET_PDEATHSIG), so even a kill -9 of it orphans none.

On a cluster the cluster starts one process per host and the environment says who is who:

    TPU VM slice   gcloud compute tpus tpu-vm ssh NAME --worker=all \\
                       --command="PORTABLE_RL_MULTIHOST=1 python -m portable_rl.train ..."
    SLURM          srun --nodes=4 --ntasks-per-node=1 env PORTABLE_RL_MULTIHOST=1 python -m portable_rl.train ...
    elsewhere      PORTABLE_RL_COORDINATOR=host0:8476 PORTABLE_RL_NUM_PROCESSES=4 PORTABLE_RL_PROCESS_ID=i \\
                       python -m portable_rl.train ...

`PORTABLE_RL_MULTIHOST=1` calls `jax.distributed.initialize()` without arguments: JAX reads the TPU
metadata server, or SLURM's / Open MPI's variables (docs/scaling.md, "Several hosts").
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

COORDINATOR, NUM_PROCESSES, PROCESS_ID, MULTIHOST = (
    "PORTABLE_RL_COORDINATOR", "PORTABLE_RL_NUM_PROCESSES", "PORTABLE_RL_PROCESS_ID", "PORTABLE_RL_MULTIHOST")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# ------------------------------------------------------------------------------- inside each process
def initialize_from_environment(environ=None) -> bool:
    """`jax.distributed.initialize` as the environment says (module doc); False when it names no cluster."""
    environ = os.environ if environ is None else environ
    if environ.get(COORDINATOR):
        try:
            num_processes, process_id = int(environ[NUM_PROCESSES]), int(environ[PROCESS_ID])
        except (KeyError, ValueError):
            raise SystemExit(f"error: {COORDINATOR} is set, so {NUM_PROCESSES} and {PROCESS_ID} must be integers "
                             f"(got {environ.get(NUM_PROCESSES)!r}, {environ.get(PROCESS_ID)!r}); set both, or "
                             f"start the processes with python -m portable_rl.launch") from None
        import jax

        jax.distributed.initialize(coordinator_address=environ[COORDINATOR], num_processes=num_processes,
                                   process_id=process_id)
        return True
    if environ.get(MULTIHOST, "").lower() in ("1", "true", "yes"):
        import jax

        jax.distributed.initialize()  # TPU metadata / SLURM / Open MPI auto-detection
        return True
    return False


def fail_fast(fn):
    """Runs `fn()`; if it fails, prints the error and ends this process at once (`os._exit`).

    Why: at a normal interpreter exit JAX shuts its distributed client down, which waits (up to 5 min) for
    every other process at a shutdown barrier, while they wait for this one inside the step's next
    collective; exiting at once lets the launcher (or the cluster's heartbeat) stop them instead."""
    import traceback

    try:
        return fn()
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        if not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001  (KeyboardInterrupt too: the same hang otherwise)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------ the launcher
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_devices_env(base: dict, devices: int) -> dict:
    """The variables that give a JAX process `devices` host CPU devices and gloo collectives between processes."""
    flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    return {"JAX_PLATFORMS": "cpu", "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            "XLA_FLAGS": " ".join(flags + [f"{_DEVICE_COUNT_FLAG}={devices}"])}


def process_env(base: dict, *, port: int, num_processes: int, process_id: int, devices: int) -> dict:
    """Process `process_id`'s environment: the cluster variables and `devices` host CPU devices."""
    return {**base, COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(num_processes),
            PROCESS_ID: str(process_id),
            "JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{port}",  # loopback only, not every interface
            **cpu_devices_env(base, devices), "PYTHONUNBUFFERED": "1"}


def die_with_parent():  # runs in the child before exec: SIGKILL it when its parent dies
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def _prefix_lines(stream, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        sys.stdout.buffer.write(prefix.encode() + line)
        sys.stdout.buffer.flush()


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class Launch:
    """N local processes of `python -m module args...`; `wait()` → the launcher's exit code."""

    def __init__(self, module: str, args: list[str], *, num_processes: int, devices_per_process: int,
                 port: int = 0, grace_s: float = 120.0):
        if num_processes < 1 or devices_per_process < 1:
            raise SystemExit(f"error: --num_processes ({num_processes}) and --devices_per_process "
                             f"({devices_per_process}) must be >= 1")
        self.port = port or free_port()
        self.grace_s = grace_s
        self.children: list[subprocess.Popen] = []
        for i in range(num_processes):
            env = process_env(dict(os.environ), port=self.port, num_processes=num_processes, process_id=i,
                              devices=devices_per_process)
            piped = i > 0  # process 0 keeps the console (progress bar); the others' lines get a prefix
            self.children.append(subprocess.Popen(
                [sys.executable, "-m", module, *args], env=env, start_new_session=True, preexec_fn=die_with_parent,
                stdout=subprocess.PIPE if piped else None, stderr=subprocess.STDOUT if piped else None))
        for i, child in enumerate(self.children[1:], 1):  # threads only after the last fork (preexec_fn)
            threading.Thread(target=_prefix_lines, args=(child.stdout, f"[process {i}] "), daemon=True).start()
        pids = ", ".join(f"process {i} pid {c.pid}" for i, c in enumerate(self.children))
        print(f"[launch] {num_processes} processes x {devices_per_process} host devices, coordinator "
              f"127.0.0.1:{self.port}: {pids}", flush=True)

    def forward(self, signum, frame=None) -> None:
        """SIGTERM / SIGINT to the launcher → the same signal to every process still running."""
        for child in self.children:
            if child.poll() is None:
                try:
                    os.kill(child.pid, signum)
                except ProcessLookupError:
                    pass

    def kill_all(self) -> None:
        """SIGKILL to every process group (the processes and anything they started), then reap."""
        for child in self.children:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for child in self.children:
            child.wait()

    def wait(self) -> int:
        exits: queue.Queue = queue.Queue()  # (process index, return code) in the order they exit
        for i, child in enumerate(self.children):
            threading.Thread(target=lambda i=i, c=child: exits.put((i, c.wait())), daemon=True).start()
        finished, first_clean = {}, None
        try:
            while len(finished) < len(self.children):
                try:
                    i, code = exits.get(timeout=0.5)
                except queue.Empty:
                    if first_clean is not None and time.monotonic() - first_clean[1] > self.grace_s:
                        running = [j for j in range(len(self.children)) if j not in finished]
                        print(f"[launch] error: process {first_clean[0]} finished but process(es) {running} are "
                              f"still running {self.grace_s:.0f} s later; stopped them", file=sys.stderr, flush=True)
                        return 1
                    continue
                finished[i] = code
                if code != 0:
                    others = len(self.children) - 1
                    print(f"[launch] error: process {i} (pid {self.children[i].pid}) {describe_exit(code)}; "
                          f"stopped the other {others} process{'es' if others != 1 else ''} (one JAX program "
                          "cannot go on without one of its processes). Rerun the same command to resume from the "
                          "last committed checkpoint.", file=sys.stderr, flush=True)
                    return code if code > 0 else 128 - code
                first_clean = first_clean or (i, time.monotonic())
            return 0
        finally:
            self.kill_all()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="python -m portable_rl.launch [options] -- <train flags>")
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--devices_per_process", type=int, default=1, help="host CPU devices per process")
    parser.add_argument("--module", default="portable_rl.train", help="the program every process runs")
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--grace_s", type=float, default=120.0,
                        help="how long the others may run on after one process finished cleanly")
    args = parser.parse_args(own)
    launch = Launch(args.module, rest, num_processes=args.num_processes,
                    devices_per_process=args.devices_per_process, port=args.port, grace_s=args.grace_s)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, launch.forward)
    return launch.wait()


if __name__ == "__main__":
    sys.exit(main())
