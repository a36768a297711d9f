"""Placement: the one place that decides device, dtype and attention backend.

Rules: CUDA when present (bf16, Triton kernels); otherwise the CPU in fp32 with the
readable torch attention. The Triton backend also runs on the CPU under the Triton
interpreter (TRITON_INTERPRET=1), which is slow and meant for checking, not speed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Placement:
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # "torch" | "triton"


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
        attention_backend = "triton" if dev.type == "cuda" else "torch"
    if attention_backend == "triton" and dev.type == "cpu":
        if not triton_interpreter():
            raise ValueError(
                "attention_backend='triton' on the CPU needs the Triton interpreter: "
                "set TRITON_INTERPRET=1 before starting Python (or use attention_backend='torch')"
            )
        if dtype == "bfloat16":
            raise ValueError("the Triton interpreter is only correct in float32/float16, not bfloat16")
    return Placement(dev, _DTYPES[dtype], attention_backend)


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so wall-clock timings measure the work itself."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
