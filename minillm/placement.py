"""Placement: the one place that decides device, dtype and attention backend.

Rules: CUDA when present (Triton kernels; bf16 where the GPU computes it, sm_80 and newer,
else fp16: a T4 or any Turing card); otherwise the CPU in fp32, with the
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
    if attention_backend is None:
        attention_backend = "triton" if dev.type == "cuda" else default_cpu_backend()
    if attention_backend == "cpu" and dev.type != "cpu":
        raise ValueError(f"attention_backend='cpu' runs on the CPU; on {dev} use attention_backend='triton' "
                         "(or 'torch')")
    if dev.type == "cuda":
        check_cuda_capability(dev)
    if dtype is None:
        dtype = cuda_default_dtype(dev) if dev.type == "cuda" else "float32"
    if dev.type == "cuda" and dtype == "bfloat16" and not cuda_has_bf16(dev):
        major, minor = torch.cuda.get_device_capability(dev)
        raise ValueError(f"dtype='bfloat16' on {torch.cuda.get_device_name(dev)} (sm_{major}{minor}), which has no "
                         "bfloat16 arithmetic (it needs sm_80 or newer): use dtype='float16', the default on this "
                         "GPU, or 'float32'")
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


MIN_CUDA_CAPABILITY = (7, 5)  # Turing (T4, RTX 20xx): the oldest target the Triton kernels are compiled for


def check_cuda_capability(dev: torch.device) -> None:
    """A clear error on a GPU older than the kernels' oldest target, before any kernel fails to compile."""
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < MIN_CUDA_CAPABILITY:
        raise ValueError(f"{torch.cuda.get_device_name(dev)} is sm_{major}{minor}; the engine's Triton kernels run on "
                         f"sm_{MIN_CUDA_CAPABILITY[0]}{MIN_CUDA_CAPABILITY[1]} (Turing: T4, RTX 20xx) and newer. "
                         "Use device='cpu'")


def cuda_has_bf16(dev: torch.device) -> bool:
    """Whether the GPU computes in bfloat16 (sm_80, Ampere, and newer). ``torch.cuda.is_bf16_supported()``
    also says yes where bf16 is only emulated (a T4), which is slow, and Triton does not compile it there."""
    return torch.cuda.get_device_capability(dev)[0] >= 8


def cuda_default_dtype(dev: torch.device) -> str:
    """bfloat16 where the GPU has it, else float16. float16 keeps 10 bits of mantissa (bf16 7) but
    its largest value is 65,504, and SmolLM2's residual stream carries one value of about 23,700
    (written by layer 11's MLP): 36% of the range, finite, and the greedy tokens float32's
    (tests/test_placement.py runs the real model in float16 and checks both)."""
    return "bfloat16" if cuda_has_bf16(dev) else "float16"


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
