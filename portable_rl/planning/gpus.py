"""Accelerators by name → memory per device, as `nvidia-smi --query-gpu=memory.total` reports it (MiB), in
GB = 10^9 bytes: H100 80 GB 81 559 MiB = 85.5 GB, H200 143 771 MiB = 150.8 GB, A100 80 GB 81 920 MiB = 85.9 GB.
The run-time memory plan reads the same number (`rl.colocation.detect_device_memory`).
"""

from __future__ import annotations

from portable_rl.errors import ConfigError

MIB = 2**20
GPU_MEMORY_GB = {name: mib * MIB / 1e9 for name, mib in {
    "h100": 81559, "h200": 143771, "a100-80g": 81920, "a100-40g": 40960, "l40s": 46068, "a10g": 22731,
    "b200": 182638,
}.items()}


def gpu_memory_gb(name: str) -> float:
    """Memory of one `name` device in GB; a one-line error listing the known names otherwise."""
    try:
        return GPU_MEMORY_GB[name.lower()]
    except KeyError:
        raise ConfigError(f"--gpu={name!r} is not a GPU the planner knows; use one of {', '.join(GPU_MEMORY_GB)} "
                          "or give --device_memory_gb") from None
