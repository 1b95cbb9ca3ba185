"""What the CPU can do fast: read once from /proc/cpuinfo, shared by the vLLM adapter (engine dtype) and the
CPU FP8 GEMM path (its compute dtype)."""

from __future__ import annotations

FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")  # bf16 dot products in hardware (AMX tiles / VDPBF16PS)


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
