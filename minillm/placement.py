"""Placement: the one place that decides device, dtype and attention backend.

Rules: CUDA when present (bf16, Triton kernels); otherwise the CPU in fp32, with the
``cpu`` attention backend (the readable torch attention's numbers, a step's queries in one
call of a small C++ kernel, and the model's layers with their elementwise work in C++
calls; built on first use) where a C++ compiler is installed, else ``torch``.
bf16 on the CPU is an option (``dtype="bfloat16"``): faster than fp32 where the CPU has
bf16 matrix instructions (AVX512-BF16, AMX), several times slower where it has not (a
warning says so); greedy tokens agree with fp32 only up to a point. The Triton backend
also runs on the CPU under the Triton interpreter (TRITON_INTERPRET=1), which is slow and
meant for checking, not speed.
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "torch" | "cpu" | "triton"


def cuda_available() -> bool:
    return torch.cuda.is_available()


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve(device: str | None = None, dtype: str | None = None,
            attention_backend: str | None = None) -> Placement:
    """Fill in the defaults and reject combinations that cannot run."""
    if device is None:
        device = "cuda" if cuda_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not cuda_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is visible; use device='cpu'")
    if dtype is None:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if attention_backend is None:
        attention_backend = "triton" if dev.type == "cuda" else default_cpu_backend()
    if attention_backend == "cpu" and dev.type != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU; on {dev} use attention_backend='triton' "
                         "(or 'torch')")
    if attention_backend == "triton" and dev.type == "cpu":
        if not triton_interpreter():
            raise ValueError(
                "attention_backend='triton' on the CPU needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before starting Python (or use attention_backend='torch')"
            )
        if dtype == "bfloat16":
            raise ValueError("the Triton interpreter is only correct in float32/float16, not bfloat16")
    if dev.type == "cpu" and dtype == "bfloat16" and not cpu_has_bf16_matmul():
        warnings.warn(
            "dtype='bfloat16' on a CPU without bf16 matrix instructions (AVX512-BF16 or AMX): the matmuls "
            "convert every weight to float32 on the fly and run several times slower than float32 "
            "(python -m minillm.bench.profile_step --dtype bfloat16 shows by how much). Use dtype='float32' here.",
            stacklevel=3)
    return Placement(dev, _DTYPES[dtype], attention_backend)


def default_cpu_backend() -> str:
    """``cpu`` where its kernels build and load (a C++ compiler is installed; the first call
    builds them, about 2 s, into the cache), else ``torch``, with a warning if a compiler is
    there but the build failed."""
    from minillm.kernels.cpu import build

    if build.compiler() is None:
        return "torch"
    try:
        build.library()
    except RuntimeError as e:
        warnings.warn(f"the CPU kernels did not build, so attention runs in the torch backend "
                      f"(slower decode steps): {e}", stacklevel=3)
        return "torch"
    return "cpu"


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX), where bf16 halves the
    bytes a decode step reads and runs faster than float32; elsewhere bf16 is emulated."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
