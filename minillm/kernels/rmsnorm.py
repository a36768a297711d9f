"""RMSNorm, plus a fused "residual add + RMSNorm".

What it computes
----------------
For every row x of a [T, D] activation matrix (T tokens, D = hidden size):

    y = x * rsqrt(mean(x ** 2) + eps) * weight          weight: [D]

The kernel does the statistics and the scaling in fp32 and rounds to x.dtype once,
at the end. The oracle, ``rms_norm_ref``, is the model's own norm (``model.rms_norm``
is this function), rounded where transformers rounds: the normalised row goes to
x.dtype *before* it is multiplied by the weight. The difference is that one extra
rounding, below bf16/fp16 resolution (the tests' tolerances).

The fused variant serves the pre-norm transformer pattern
``residual = residual + x; h = norm(residual)``:

    new_residual = (x + residual)  rounded to x.dtype
    y            = rms_norm(new_residual)

Doing both in one pass reads x and residual once instead of twice.

Napkin math
-----------
A row needs one reduction over D values, so the work is ~3 flops per byte read:
the kernel is purely memory bound. Bytes moved, element size e:

    rms_norm:            read T*D*e (x) + D*e (weight), write T*D*e (y)
    fused_add_rms_norm:  read 2*T*D*e + D*e,             write 2*T*D*e

On a GPU with ~3 TB/s, T=4096, D=4096 in bf16 moves 64 MiB -> ~22 us at best.

Design: one program per row; the whole row sits in registers (BLOCK_D is the
next power of two >= D), so there is no loop and the row is read exactly once.
That is fine up to D of a few tens of thousands, far above any hidden size here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, check, check_device, cuda_or_skip, next_pow2, report, require_triton, tl, triton

# Largest row we keep fully in registers. Beyond this a looped kernel would be needed.
_MAX_BLOCK_D = 65536

if HAS_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,  # [T, D] input rows
        res_ptr,  # [T, D] residual (read only when HAS_RESIDUAL)
        w_ptr,  # [D] weight
        y_ptr,  # [T, D] normalised output
        res_out_ptr,  # [T, D] new residual output (written only when HAS_RESIDUAL)
        D,
        stride_x,
        stride_res,
        stride_y,
        stride_res_out,
        eps,
        BLOCK_D: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
    ):
        # int64 row index: T * stride can exceed 2**31 for long prompts with a large D.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask = cols < D  # BLOCK_D is padded to a power of two

        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK_D]
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)  # [BLOCK_D]
            # Round the sum to the storage dtype first, so the norm sees exactly
            # the residual stream the next layer will read back.
            s = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
            tl.store(res_out_ptr + row * stride_res_out + cols, s, mask=mask)
            xf = s.to(tl.float32)
        else:
            xf = x.to(tl.float32)

        # Padded lanes hold 0, so they do not disturb the sum; divide by the true D.
        mean_sq = tl.sum(xf * xf, axis=0) / D
        rstd = 1.0 / tl.sqrt(mean_sq + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK_D]
        y = xf * rstd * w
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _check_inputs(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    check(x.dim() == 2, f"{name}: x must be [T, D], got shape {tuple(x.shape)}")
    check(weight.dim() == 1 and weight.shape[0] == x.shape[1],
          f"{name}: weight must be [D]={x.shape[1]}, got shape {tuple(weight.shape)}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"{name}: x must be fp16/bf16/fp32, got {x.dtype}")
    check(x.stride(1) == 1, f"{name}: x must be contiguous along D (stride(1)==1), got strides {x.stride()}")
    check(weight.is_contiguous(), f"{name}: weight must be contiguous")
    check(next_pow2(x.shape[1]) <= _MAX_BLOCK_D, f"{name}: D={x.shape[1]} is too large for the one-pass kernel")
    tensors = [x, weight]
    if residual is not None:
        check(residual.shape == x.shape, f"{name}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        check(residual.dtype == x.dtype, f"{name}: residual dtype {residual.dtype} != x dtype {x.dtype}")
        check(residual.stride(1) == 1, f"{name}: residual must be contiguous along D")
        tensors.append(residual)
    check_device(name, *tensors)


def _launch(x, residual, weight, y, res_out, eps):
    T, D = x.shape
    if T == 0:
        return
    block_d = next_pow2(D)
    # Wider rows get more warps so each thread keeps a modest number of registers.
    num_warps = 4 if block_d <= 2048 else (8 if block_d <= 8192 else 16)
    has_res = residual is not None
    _rms_norm_kernel[(T,)](
        x, residual if has_res else x, weight, y, res_out if has_res else y,
        D,
        x.stride(0),
        residual.stride(0) if has_res else 0,
        y.stride(0),
        res_out.stride(0) if has_res else 0,
        float(eps),
        BLOCK_D=block_d,
        HAS_RESIDUAL=has_res,
        num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y[T, D] = x * rsqrt(mean(x^2, -1) + eps) * weight, computed in fp32, returned in x.dtype."""
    require_triton("rms_norm")
    _check_inputs("rms_norm", x, weight)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, D]
    _launch(x, None, weight, y, None, eps)
    return y


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual); the inputs are not modified."""
    require_triton("fused_add_rms_norm")
    _check_inputs("fused_add_rms_norm", x, weight, residual)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, D]
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)  # [T, D]
    _launch(x, residual, weight, y, new_residual, eps)
    return y, new_residual


# ----------------------------------------------------------------------------
# Oracles: the same math in plain PyTorch.
# ----------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) * weight, computed in float32 (as transformers does), returned in x.dtype.

    Spelled out: ``xf = x.float(); xf * rsqrt(mean(xf**2) + eps)``, then ``weight * xf.to(x.dtype)``.
    ``F.rms_norm`` computes the same float32 numbers (bit for bit: tests/test_step_cost.py) in
    one op instead of five; a decode step runs 61 of these norms. The model's norm
    (``model.rms_norm``) on every backend but Triton's, so its rounding points are the
    engine's: the cpu backend's C++ norm rounds where this does (tests/test_cpu_layer_ops.py).
    """
    # x: [..., D], weight: [D]
    xf = F.rms_norm(x if x.dtype == torch.float32 else x.float(), (x.shape[-1],), eps=eps)
    return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = (x.float() + residual.float()).to(x.dtype)  # [T, D], rounded like the kernel
    return rms_norm_ref(new_residual, weight, eps), new_residual


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cuda_or_skip("rmsnorm"):
        return
    from triton.testing import do_bench

    e = torch.tensor([], dtype=dtype).element_size()
    for T, D in [(1, 2048), (256, 2048), (4096, 2048), (4096, 8192)]:
        x = torch.randn(T, D, device="cuda", dtype=dtype)
        r = torch.randn_like(x)
        w = torch.randn(D, device="cuda", dtype=dtype)
        ms = do_bench(lambda: rms_norm(x, w))
        report(f"rms_norm T={T} D={D} {dtype}", ms, 2 * T * D * e + D * e)
        ms = do_bench(lambda: fused_add_rms_norm(x, r, w))
        report(f"fused_add_rms_norm T={T} D={D} {dtype}", ms, 4 * T * D * e + D * e)


if __name__ == "__main__":
    bench()
