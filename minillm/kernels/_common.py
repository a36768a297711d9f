"""Small helpers shared by the kernel files: the optional Triton import, input
checks with readable messages, and the benchmark printout.

Kept deliberately tiny so that each kernel file still reads on its own.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Triton is an optional dependency: the PyTorch oracles must import without it.
try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None
    HAS_TRITON = False


def require_triton(name: str) -> None:
    """Raise a helpful error when a Triton wrapper is called without Triton."""
    if not HAS_TRITON:
        raise RuntimeError(
            f"{name} needs the 'triton' package; use {name}_ref for a pure-PyTorch fallback"
        )


def check(cond: bool, msg: str) -> None:
    """Like assert, but survives `python -O` and always raises ValueError."""
    if not cond:
        raise ValueError(msg)


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """All tensors must live on one device; on CPU that only works in the interpreter
    (or while tools/aot_capture.py records launches for a GPU target: nothing runs then)."""
    devices = {t.device for t in tensors}
    check(len(devices) == 1, f"{name}: all tensors must be on the same device, got {sorted(map(str, devices))}")
    dev = tensors[0].device
    if dev.type != "cuda" and _aot_target is None:
        check(
            os.environ.get("TRITON_INTERPRET", "0") == "1",
            f"{name}: tensors are on {dev}; Triton kernels need CUDA tensors "
            "(or TRITON_INTERPRET=1 set before the kernels are imported)",
        )


# ----------------------------------------------------------------------------
# Launch planning: which GPU do the wrappers pick tile sizes and split counts for?
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """The few facts about a GPU that the host wrappers plan a launch with."""

    name: str
    capability: int  # 80 = A100 (sm_80), 90 = H100/H200 (sm_90)
    num_sms: int  # streaming multiprocessors: how many programs run at once
    smem_per_block: int  # opt-in maximum shared memory of one program (block), bytes

    @property
    def arch(self) -> str:
        return f"sm_{self.capability}"


# The GPUs this project targets (numbers from the CUDA programming guide's
# per-architecture table: opt-in shared memory per block 163 KiB / 227 KiB).
A100 = GpuSpec("A100-SXM4", 80, 108, 163 * 1024)
H100 = GpuSpec("H100/H200-SXM", 90, 132, 227 * 1024)

# Set only by tools/aot_capture.py while it records the launches the wrappers would make on
# this GPU (CPU tensors, fake driver, nothing runs). None otherwise.
_aot_target: GpuSpec | None = None


def planning_gpu(device: torch.device) -> GpuSpec | None:
    """The GPU a wrapper plans its launch for; None means the CPU interpreter.

    A CUDA tensor's own device, or the target tools/aot_audit.py is compiling for.
    """
    if _aot_target is not None:
        return _aot_target
    if device.type != "cuda":
        return None
    return _cuda_spec(torch.cuda.current_device() if device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def _cuda_spec(index: int) -> GpuSpec:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    return GpuSpec(props.name, 10 * props.major + props.minor, props.multi_processor_count, int(smem))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# Published peak DRAM bandwidths (GB/s), used when the driver does not report
# clock and bus width. Matching is by substring of the device name.
_KNOWN_BW_GBPS = {
    "H200": 4800.0,
    "H100 PCIe": 2000.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "T4": 320.0,
}


def peak_bandwidth_gbps(device: torch.device | int | None = None) -> float | None:
    """Best-effort theoretical DRAM bandwidth of a CUDA device in GB/s."""
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", 0) or 0
    bus_bits = getattr(props, "memory_bus_width", 0) or 0
    if clock_khz and bus_bits:
        # Double data rate: two transfers per clock, bus_bits/8 bytes each.
        return 2.0 * clock_khz * 1e3 * (bus_bits / 8) / 1e9
    for key, bw in _KNOWN_BW_GBPS.items():
        if key in props.name:
            return bw
    return None


def report(label: str, ms: float, nbytes: int) -> None:
    """Print achieved bandwidth next to the device's theoretical bound."""
    gbps = nbytes / (ms * 1e-3) / 1e9
    peak = peak_bandwidth_gbps()
    bound = f"{peak:7.0f} GB/s peak ({100 * gbps / peak:5.1f}%)" if peak else "peak unknown"
    print(f"{label:<48s} {ms * 1e3:9.1f} us  {gbps:7.0f} GB/s  vs {bound}")


def cuda_or_skip(name: str) -> bool:
    """bench() helpers call this first; benchmarks only make sense on a GPU."""
    if not torch.cuda.is_available():
        print(f"{name}.bench: CUDA is not available, skipping benchmark")
        return False
    if not HAS_TRITON:
        print(f"{name}.bench: triton is not installed, skipping benchmark")
        return False
    return True
