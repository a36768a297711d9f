"""Chapter 11 solutions: same names and signatures as ``exercises/ch11_quantized_weights.py``.

The group formats are ``minillm/quantization.py``'s; the Triton GEMV is
``minillm/kernels/quant_gemv.py``'s ``u8_gemv``.
"""
from __future__ import annotations

import math

import torch

from minillm import quantization
from minillm.course import quiz


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int = 32
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantization.quantize_groups``, asymmetric: min and max of each group are the grid's ends."""
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size!r}")
    return quantization.quantize_groups(weight, bits, group_size)


def dequantize_groups(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """``quantization.dequantize_groups``: codes * scale + min, group by group."""
    if scales.shape != mins.shape or scales.dim() != 2 or codes.dim() != 2 or codes.shape[0] != scales.shape[0] \
            or scales.shape[1] == 0 or codes.shape[1] % scales.shape[1]:
        raise ValueError(f"codes [N, K] need scales and mins [N, groups] with K a multiple of groups; got codes "
                         f"{list(codes.shape)}, scales {list(scales.shape)}, mins {list(mins.shape)}")
    return quantization.dequantize_groups(codes, scales, mins)


def decode_floor_ms(num_weights: int, bits: int, group_size: int | None, bandwidth_gbps: float) -> float:
    """Bytes of codes plus 8 bytes (float32 scale and minimum) a group, over the bandwidth."""
    if num_weights < 1 or bits not in (4, 8, 16, 32) or (group_size is not None and group_size < 1) \
            or not bandwidth_gbps > 0:
        raise ValueError(f"need num_weights >= 1, bits in 4/8/16/32, group_size None or >= 1 and a bandwidth "
                         f"> 0; got {num_weights!r}, {bits!r}, {group_size!r}, {bandwidth_gbps!r}")
    nbytes = num_weights * bits / 8 + (0 if group_size is None else math.ceil(num_weights / group_size) * 8)
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


def int8_gemv_triton(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     group_size: int = 32) -> torch.Tensor:
    """Read ``minillm/kernels/quant_gemv.py``: the 8-bit kernel and its launch in ``u8_gemv``."""
    from minillm.kernels.quant_gemv import u8_gemv

    return u8_gemv(x, codes, scales, mins, group_size)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: the bits of the weights plus their group's scale and minimum, per
    weight; q2: the bytes of a decode step over the bandwidth."""
    return quiz.sealed("ch11")
