"""The CPU side of the engines: what the CPU can do fast (read once from /proc/cpuinfo, shared by the vLLM
adapter's engine dtype and the CPU FP8 GEMM path's compute dtype), how OpenMP's idle threads wait, and the
process's permission to use AMX tiles."""

from __future__ import annotations

import os
import sys

FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 dot products in hardware (AMX tiles / VDPBF16PS)
# x86-64 Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) grants the AMX tile state to the process
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18
OMP_WAIT_POLICY = "OMP_WAIT_POLICY"
_omp_policy_set_too_late = False  # prefer_passive_omp_waits set it after torch had loaded OpenMP


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags of the first core (empty when /proc/cpuinfo is unreadable: not Linux)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86 / ARM spelling
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_fast_bf16(flags: set[str] | None = None) -> bool:
    """True when the CPU has bf16 dot products in hardware (`FAST_BF16_CPU_FLAGS`)."""
    return bool(set(FAST_BF16_CPU_FLAGS) & (cpu_flags() if flags is None else flags))


def prefer_passive_omp_waits() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless it is set: idle OpenMP threads sleep instead of spin-waiting, which on
    a CPU shared with other processes starves the working ones (vLLM-CPU decode >10x slower:
    docs/benchmarks.md); ACTIVE restores the spinning. OpenMP reads it once, when torch loads its runtime, so
    the entry points call this before anything imports torch, and the vLLM adapter before it starts vLLM."""
    global _omp_policy_set_too_late
    if OMP_WAIT_POLICY not in os.environ:
        _omp_policy_set_too_late = "torch" in sys.modules
        os.environ[OMP_WAIT_POLICY] = "PASSIVE"


def omp_threads_spin() -> bool:
    """Whether idle OpenMP threads spin: the policy is not PASSIVE, or it was set after torch loaded."""
    return _omp_policy_set_too_late or os.environ.get(OMP_WAIT_POLICY, "").upper() != "PASSIVE"


def allow_amx_tiles(flags: set[str] | None = None) -> bool:
    """Asks Linux for this process's permission to use AMX tiles, which a process must hold before its first
    AMX instruction (Linux 5.16+; forgotten at exec). vLLM-CPU's bf16 attention kernel runs AMX on a CPU that
    has it without asking, so a process where nothing asked first (torch's oneDNN asks when one of its own bf16
    GEMMs picks AMX) dies with SIGILL, "Illegal instruction", at its first generate: e.g. a bf16 engine on a
    model too small for oneDNN's AMX GEMMs. Returns True when granted, False without AMX tiles or elsewhere
    than x86-64 Linux. Idempotent."""
    import platform

    if "amx_tile" not in (cpu_flags() if flags is None else flags) or sys.platform != "linux" \
            or platform.machine() != "x86_64":
        return False
    import ctypes

    libc = ctypes.CDLL(None)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
