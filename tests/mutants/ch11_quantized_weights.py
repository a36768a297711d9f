"""Wrong answers to exercises/ch11_quantized_weights.py, each a mistake the contract rules out."""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from mutants import mutant

# ---------------------------------------------------------------- quantize_groups


def _check_quant_args(weight, bits, group_size):
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if group_size < 1 or weight.shape[1] % group_size:
        raise ValueError(f"K = {weight.shape[1]} is not a multiple of group_size = {group_size}")


def _grid(weight, bits, group_size, top_levels=None, per_row=False):
    """Asymmetric groups; ``top_levels`` replaces 2**bits - 1 as the number of steps of the grid,
    ``per_row`` takes min and max over the whole row instead of the group."""
    N, K = weight.shape
    top = 2 ** bits - 1
    g = weight.float().reshape(N, K // group_size, group_size)
    if per_row:
        lo = g.amin(dim=(1, 2))[:, None].expand(N, K // group_size)
        hi = g.amax(dim=(1, 2))[:, None].expand(N, K // group_size)
    else:
        lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / (top if top_levels is None else top_levels)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, top)
    return codes.reshape(N, K).to(torch.uint8), scale.contiguous(), lo.contiguous()


@mutant("quantize_groups", "codes are truncated (torch.floor), not rounded to the nearest grid point")
def _floor_codes(weight, bits, group_size=32):
    _check_quant_args(weight, bits, group_size)
    N, K = weight.shape
    top = 2 ** bits - 1
    g = weight.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = torch.where(hi > lo, (hi - lo) / top, torch.ones_like(hi))
    codes = torch.floor((g - lo[..., None]) / scale[..., None]).clamp(0, top)
    return codes.reshape(N, K).to(torch.uint8), scale, lo


@mutant("quantize_groups", "the scale divides the range by 2**bits levels, not 2**bits - 1 steps")
def _levels_not_steps(weight, bits, group_size=32):
    _check_quant_args(weight, bits, group_size)
    return _grid(weight, bits, group_size, top_levels=2 ** bits)


@mutant("quantize_groups", "min and max are taken over the whole row, not over each group")
def _range_of_the_row(weight, bits, group_size=32):
    _check_quant_args(weight, bits, group_size)
    return _grid(weight, bits, group_size, per_row=True)


@mutant("quantize_groups", "bits is ignored: every layer gets the 8-bit grid (codes up to 255 at 4 bits)")
def _always_8_bits(weight, bits, group_size=32):
    _check_quant_args(weight, bits, group_size)
    return _grid(weight, 8, group_size)


@mutant("quantize_groups", "a constant group keeps scale 0 (max - min) instead of 1.0")
def _constant_group_scale_zero(weight, bits, group_size=32):
    _check_quant_args(weight, bits, group_size)
    N, K = weight.shape
    top = 2 ** bits - 1
    g = weight.float().reshape(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / top
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # the codes are right; the scale kept is 0
    codes = torch.round((g - lo[..., None]) / safe[..., None]).clamp(0, top)
    return codes.reshape(N, K).to(torch.uint8), scale, lo


# ---------------------------------------------------------------- dequantize_groups


def _check_dequant_args(codes, scales, mins):
    if scales.shape != mins.shape or codes.dim() != 2 or scales.dim() != 2 or codes.shape[0] != scales.shape[0] \
            or scales.shape[1] == 0 or codes.shape[1] % scales.shape[1]:
        raise ValueError(f"shapes do not fit: {list(codes.shape)}, {list(scales.shape)}, {list(mins.shape)}")


@mutant("dequantize_groups", "scales and mins are tiled (repeat), so column k reads group k % groups, not k // G")
def _groups_tiled(codes, scales, mins):
    _check_dequant_args(codes, scales, mins)
    G = codes.shape[1] // scales.shape[1]
    return codes.float() * scales.repeat(1, G) + mins.repeat(1, G)


@mutant("dequantize_groups", "the minimum is added before the scale multiplies: (code + min) * scale")
def _min_inside(codes, scales, mins):
    _check_dequant_args(codes, scales, mins)
    G = codes.shape[1] // scales.shape[1]
    return (codes.float() + mins.repeat_interleave(G, dim=1)) * scales.repeat_interleave(G, dim=1)


@mutant("dequantize_groups", "codes are read as signed (code - 128), as the symmetric head's grid")
def _signed_codes(codes, scales, mins):
    _check_dequant_args(codes, scales, mins)
    G = codes.shape[1] // scales.shape[1]
    return (codes.float() - 128) * scales.repeat_interleave(G, dim=1) + mins.repeat_interleave(G, dim=1)


@mutant("dequantize_groups", "the weight comes back in float64, not float32")
def _float64(codes, scales, mins):
    _check_dequant_args(codes, scales, mins)
    G = codes.shape[1] // scales.shape[1]
    return codes.double() * scales.double().repeat_interleave(G, dim=1) + mins.double().repeat_interleave(G, dim=1)


# ---------------------------------------------------------------- decode_floor_ms


def _check_floor_args(num_weights, bits, group_size, bandwidth_gbps):
    if num_weights < 1 or bits not in (4, 8, 16, 32) or (group_size is not None and group_size < 1) \
            or not bandwidth_gbps > 0:
        raise ValueError("bad arguments")


@mutant("decode_floor_ms", "a last, partial group stores no scale and minimum (floor, not ceil, of the groups)")
def _groups_floored(num_weights, bits, group_size, bandwidth_gbps):
    _check_floor_args(num_weights, bits, group_size, bandwidth_gbps)
    nbytes = num_weights * bits / 8 + (0 if group_size is None else num_weights // group_size * 8)
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


@mutant("decode_floor_ms", "a group stores its scale only (4 bytes), the minimum is forgotten")
def _scale_only(num_weights, bits, group_size, bandwidth_gbps):
    _check_floor_args(num_weights, bits, group_size, bandwidth_gbps)
    nbytes = num_weights * bits / 8 + (0 if group_size is None else math.ceil(num_weights / group_size) * 4)
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


@mutant("decode_floor_ms", "bits are taken for bytes (no / 8)")
def _bits_as_bytes(num_weights, bits, group_size, bandwidth_gbps):
    _check_floor_args(num_weights, bits, group_size, bandwidth_gbps)
    nbytes = num_weights * bits + (0 if group_size is None else math.ceil(num_weights / group_size) * 8)
    return nbytes / (bandwidth_gbps * 1e9) * 1e3


@mutant("decode_floor_ms", "a GB is taken as 2**30 bytes, not 10**9")
def _gibibytes(num_weights, bits, group_size, bandwidth_gbps):
    _check_floor_args(num_weights, bits, group_size, bandwidth_gbps)
    nbytes = num_weights * bits / 8 + (0 if group_size is None else math.ceil(num_weights / group_size) * 8)
    return nbytes / (bandwidth_gbps * 2 ** 30) * 1e3


@mutant("decode_floor_ms", "the time comes back in seconds, not milliseconds")
def _seconds(num_weights, bits, group_size, bandwidth_gbps):
    _check_floor_args(num_weights, bits, group_size, bandwidth_gbps)
    nbytes = num_weights * bits / 8 + (0 if group_size is None else math.ceil(num_weights / group_size) * 8)
    return nbytes / (bandwidth_gbps * 1e9)


# ---------------------------------------------------------------- int8_gemv_triton

BLOCK_N, BLOCK_K = 64, 64
RIGHT, GROUP_ZERO_ONLY, LAST_K_BLOCK_SKIPPED, NO_MINS = 0, 1, 2, 3


@lru_cache(maxsize=None)
def _kernel():
    """The kernel, defined on first use: @triton.jit reads TRITON_INTERPRET when it runs, and the
    grader sets it before the first test."""
    import triton
    import triton.language as tl

    @triton.jit
    def gemv(x_ptr, c_ptr, s_ptr, m_ptr, y_ptr, N, K, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             MISTAKE: tl.constexpr):
        row = tl.program_id(0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        mask_n = offs_n < N
        groups = K // G
        acc = tl.zeros([BN], dtype=tl.float32)
        k_end = K - BK if MISTAKE == 2 else K
        for k0 in range(0, k_end, BK):
            offs_k = k0 + tl.arange(0, BK)
            mask_k = offs_k < K
            both = mask_n[:, None] & mask_k[None, :]
            x = tl.load(x_ptr + row * K + offs_k, mask=mask_k, other=0.0)
            codes = tl.load(c_ptr + offs_n[:, None] * K + offs_k[None, :], mask=both, other=0)
            g = offs_k * 0 if MISTAKE == 1 else offs_k // G
            s = tl.load(s_ptr + offs_n[:, None] * groups + g[None, :], mask=both, other=0.0)
            w = codes.to(tl.float32) * s
            if MISTAKE != 3:
                w += tl.load(m_ptr + offs_n[:, None] * groups + g[None, :], mask=both, other=0.0)
            acc += tl.sum(w * x[None, :], axis=1)
        tl.store(y_ptr + row * N + offs_n, acc, mask=mask_n)

    return gemv


def _gemv(x, codes, scales, mins, group_size, mistake=RIGHT, grid_floor=False):
    M, K = x.shape
    N = codes.shape[0]
    y = torch.zeros(M, N, dtype=torch.float32, device=x.device)
    blocks = N // BLOCK_N if grid_floor else -(-N // BLOCK_N)
    if blocks:
        _kernel()[(M, blocks)](x.contiguous(), codes.contiguous(), scales.contiguous(), mins.contiguous(), y, N, K,
                               G=group_size, BN=BLOCK_N, BK=BLOCK_K, MISTAKE=mistake)
    return y


@mutant("int8_gemv_triton", "the grid is N // BLOCK_N: the last, partial block of outputs is never computed")
def _grid_floor(x, codes, scales, mins, group_size=32):
    return _gemv(x, codes, scales, mins, group_size, grid_floor=True)


@mutant("int8_gemv_triton", "every column reads its row's first scale and minimum (the group index is left out)")
def _group_zero_only(x, codes, scales, mins, group_size=32):
    return _gemv(x, codes, scales, mins, group_size, mistake=GROUP_ZERO_ONLY)


@mutant("int8_gemv_triton", "the loop over K stops one block early (range(0, K - BLOCK_K, BLOCK_K))")
def _last_k_block_skipped(x, codes, scales, mins, group_size=32):
    return _gemv(x, codes, scales, mins, group_size, mistake=LAST_K_BLOCK_SKIPPED)


@mutant("int8_gemv_triton", "the minimum is left out: w = code * scale")
def _no_mins(x, codes, scales, mins, group_size=32):
    return _gemv(x, codes, scales, mins, group_size, mistake=NO_MINS)
