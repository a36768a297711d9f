"""Quantized GEMV: y = x @ w.T with w stored as 8-bit or 4-bit codes in groups, dequantized
inside the kernel and never written out.

What it computes
----------------
The weight formats of ``minillm.quantization`` (a weight w [N, K], groups of G = 32
consecutive columns, each group with a float32 scale and minimum):

    int8_group   codes  uint8 [N, K]       one code 0..255 a weight
    q4_group     packed uint8 [N, K // 2]  two codes 0..15 a byte: element 2j in the low
                                           nibble of byte j, element 2j + 1 in the high one
    both         scales, mins float32 [N, K // G]

    w[n, k] = code[n, k] * scales[n, k // G] + mins[n, k // G]
    y[m, n] = sum_k x[m, k] * w[n, k]            x [M, K] fp32/fp16/bf16, y [M, N] in x.dtype

``u8_gemv`` and ``q4_gemv`` are the kernel for the two formats; ``u8_gemv_ref`` and
``q4_gemv_ref`` the oracles (the weight dequantized in float64, x @ w.T in float64,
rounded to x.dtype once).

The trick: scale and minimum come out of the group's sum
-------------------------------------------------------
Within a group the scale s and the minimum mn are constants, so

    sum_{k in g} x[k] * (code[k] * s + mn)  =  s * sum_{k in g} x[k] * code[k]  +  mn * sum_{k in g} x[k]

The kernel never forms a dequantized weight. Per group it takes one dot product of x
with the raw codes (small integers, exact in fp16 and bf16 too: 0..255 needs 8
significant bits, bf16 has 8), then applies the group's scale and minimum to the
result in fp32. The codes reach the tensor cores only converted to x.dtype, every
product x * code is exact in the fp32 accumulator, and the weight is never rounded to
bf16/fp16 (as dequantizing it before the dot would). The price: two multiply-adds per
output element and group, about what dequantizing the codes tile would cost at 16 rows.

Napkin math
-----------
Decode (M = 1 .. a few dozen rows) reads every weight once and does 2 * M flops per
weight: memory bound, like every decode matmul (chapter 0). Bytes of weight per
weight: 1 + 8 / G = 1.25 (int8_group) or 0.5 + 8 / G = 0.75 (q4_group), against 2 for
bf16. SmolLM2-135M's projections (106 M weights) and head (28 M) are ~170 MB as
int8_group, ~115 MB as q4 (its head stays 8-bit): ~35 us and ~24 us per decode step at
an H200's 4.8 TB/s, where bf16 needs ~56 us. Long prompts (M in the thousands) reuse
each weight tile for BLOCK_M rows and become compute bound; correctness matters more
than speed there.

Design
------
* Grid (N / BLOCK_N, M / BLOCK_M): a program owns BLOCK_N rows of w and BLOCK_M rows of
  x, and loops over K one group at a time. Per group it loads the x tile (transposed,
  [G, BLOCK_M]), the codes tile [BLOCK_N, G] (4-bit: the packed [BLOCK_N, G/2] bytes, split into low
  and high nibbles and interleaved back into element order, ``tl.interleave``), and the
  group's BLOCK_N scales and minimums, then

      acc += tl.dot(codes, x.T) * scale[:, None] + min[:, None] * rowsum(x)[None, :]

  acc is y's tile transposed, [BLOCK_N, BLOCK_M] ("swap AB"): the weight tile is the
  dot's first operand, the side tensor-core instructions want many rows of (64 for
  Hopper's wgmma), and the few rows of x the second, narrow one. x is loaded already
  transposed (no tl.trans: the interpreter would pay a strided matmul for it).

* tl.dot needs tiles of at least 16 rows on the GPU, so a decode step's few rows are
  padded to BLOCK_M = 16 (zeros, masked), as the decode attention pads its query heads:
  the padding's math is free in a kernel that waits on memory. Up to 64 rows of x share
  one tile (BLOCK_M = 64), so a batch of 64 decode rows still reads each weight once.
* input_precision="ieee": fp32 activations get true fp32 products (no TF32); fp16/bf16
  use tensor cores either way.
* Bounds: rows of x past M and rows of w past N are masked (loaded as 0, never stored).
  K needs no mask: it is a whole number of groups.
* Row offsets are int64: N * K passes 2**31 for a large vocabulary times a wide model.
* What it does not do: split K. A layer with few output rows (SmolLM2's o_proj and
  down_proj: N = 576, 9 programs of 64 rows at M = 1) cannot fill a GPU of 132 SMs; a
  split-K variant (partial sums per chunk of K, then a reduction) would.

Compiled variants
-----------------
Constexprs: the group size G, the format (BITS = 8 or 4) and the tiles. The tiles
depend only on the dtype and on whether M <= 16 (decode tile) or not (prefill tile).
M and N are runtime integers Triton never specialises on (do_not_specialize: M == 1
and "N divisible by 16" would each be another binary); K is a multiple of G >= 16, so
its one specialised fact (divisible by 16) is always the same. One model and dtype
therefore reach at most 2 binaries per format: decode and prefill tiles
(tools/aot_audit.py counts them; minillm.kernels.warmup compiles them when asked for a
quantized model).
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    GpuSpec,
    check,
    check_device,
    cuda_or_skip,
    next_pow2,
    planning_gpu,
    report,
    require_triton,
    tl,
    triton,
)

GROUP_SIZES = (16, 32, 64, 128)  # powers of two: tl.arange over a group; >= 16: tl.dot's minimum K
DECODE_MAX_M = 16  # up to this many rows of x: the decode tile

if HAS_TRITON:

    # M (rows of x: the step's tokens) and N change from layer to layer and step to
    # step: runtime integers, never specialised on (see "Compiled variants" above).
    @triton.jit(do_not_specialize=["M", "N"])
    def _quant_gemv_kernel(
        x_ptr,  # [M, K] activations, contiguous
        codes_ptr,  # [N, K] uint8 (BITS == 8) or [N, K // 2] packed nibbles (BITS == 4)
        scales_ptr,  # [N, K // GROUP] fp32
        mins_ptr,  # [N, K // GROUP] fp32
        y_ptr,  # [M, N] output, x.dtype
        M,
        N,
        K,
        GROUP: tl.constexpr,  # G: columns per scale and minimum
        BITS: tl.constexpr,  # 8: a code a byte; 4: two codes a byte, low nibble first
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        # int64 row indices: row * K overflows int32 for large weights.
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M] rows of x and y
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # [BLOCK_N] rows of w, columns of y
        m_ok = rm < M
        n_ok = rn < N
        num_groups = K // GROUP

        kk = tl.arange(0, GROUP)  # [G] columns of one group
        # Pointers to group 0; each iteration moves them on by one group. x is read
        # transposed, [G, BLOCK_M]: the dot's second operand as it is.
        xt_ptrs = x_ptr + rm[None, :] * K + kk[:, None]  # [G, BLOCK_M]
        if BITS == 8:
            c_ptrs = codes_ptr + rn[:, None] * K + kk[None, :]  # [BLOCK_N, G]
        else:
            half = tl.arange(0, GROUP // 2)  # [G/2] bytes of one group
            c_ptrs = codes_ptr + rn[:, None] * (K // 2) + half[None, :]  # [BLOCK_N, G/2]
        s_ptrs = scales_ptr + rn * num_groups  # [BLOCK_N]
        mn_ptrs = mins_ptr + rn * num_groups  # [BLOCK_N]

        # Transposed: y.T = w @ x.T, so the weight tile is the dot's first operand, whose
        # rows the tensor cores have plenty of, and the few rows of x the narrow second.
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # [BLOCK_N, BLOCK_M] of y.T
        for _ in range(0, num_groups):
            xt = tl.load(xt_ptrs, mask=m_ok[None, :], other=0.0)  # [G, BLOCK_M]
            if BITS == 8:
                codes = tl.load(c_ptrs, mask=n_ok[:, None], other=0)  # [BLOCK_N, G] uint8
            else:
                packed = tl.load(c_ptrs, mask=n_ok[:, None], other=0)  # [BLOCK_N, G/2]
                # Byte j holds element 2j (low nibble) and 2j + 1 (high): interleaving the
                # two halves along the last axis puts them back in element order.
                codes = tl.interleave(packed & 0xF, packed >> 4)  # [BLOCK_N, G] uint8, 0..15
            s = tl.load(s_ptrs, mask=n_ok, other=0.0)  # [BLOCK_N]
            mn = tl.load(mn_ptrs, mask=n_ok, other=0.0)  # [BLOCK_N]
            # sum_k code * x, exact products in fp32; then the group's scale and minimum.
            dots = tl.dot(codes.to(xt.dtype), xt, input_precision="ieee")  # [BLOCK_N, BLOCK_M]
            xsum = tl.sum(xt.to(tl.float32), axis=0)  # [BLOCK_M]
            acc += dots * s[:, None] + mn[:, None] * xsum[None, :]
            xt_ptrs += GROUP
            c_ptrs += GROUP * BITS // 8
            s_ptrs += 1
            mn_ptrs += 1

        y_ptrs = y_ptr + rm[None, :] * N + rn[:, None]  # [BLOCK_N, BLOCK_M]: y[m, n] <- acc[n, m]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def _pick_config(M: int, N: int, dtype: torch.dtype, gpu: GpuSpec | None) -> dict:
    """Tile sizes for a GPU (None: the CPU interpreter). Tests may monkeypatch this."""
    if gpu is None:
        # Interpreter: it pays per program and per op more than per element, so a program
        # takes up to 256 rows of x and 4096 rows of w (its acc: Triton's most, 2**20 elements).
        return dict(BLOCK_M=min(next_pow2(M), 256), BLOCK_N=min(next_pow2(N), 4096), num_warps=4, num_stages=1)
    if M <= DECODE_MAX_M:
        # Decode: tl.dot's minimum of 16 rows; 64 rows of w a program (2 KB of 8-bit codes
        # a group), four groups in flight (num_stages) to keep the loads streaming.
        return dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=4)
    if dtype == torch.float32:
        # fp32 has no tensor cores here (input_precision="ieee"): the dot is an FMA loop
        # with its operands in registers; 8 warps share them (python tools/aot_audit.py).
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3)
    # Prefill and batches of 17..64 rows: each codes tile serves 64 rows of x.
    return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)


def _check_inputs(name: str, x, codes, scales, mins, group_size, bits: int) -> None:
    """Readable ValueErrors for anything that would make the kernel read out of bounds
    or compute something else than the format says."""
    what = "codes" if bits == 8 else "packed"
    check(isinstance(x, torch.Tensor) and x.dim() == 2, f"{name}: x must be [M, K], got shape "
          f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"{name}: x must be fp16/bf16/fp32, got {x.dtype}")
    check(x.is_contiguous(), f"{name}: x must be contiguous (call .contiguous() on it)")
    M, K = x.shape
    check(isinstance(group_size, int) and group_size in GROUP_SIZES,
          f"{name}: group_size must be a power of two from 16 to 128 ({', '.join(map(str, GROUP_SIZES))}), "
          f"got {group_size!r}")
    check(K >= 1, f"{name}: x must have at least one column, got shape {tuple(x.shape)}")
    if bits == 4:
        check(K % 2 == 0, f"{name}: K = {K} (x's columns) must be even: q4_group packs two codes a byte")
    check(K % group_size == 0, f"{name}: K = {K} (x's columns) must be a multiple of group_size = {group_size}")
    check(codes.dim() == 2, f"{name}: {what} must be 2-D, got shape {tuple(codes.shape)}")
    check(codes.dtype == torch.uint8, f"{name}: {what} must be torch.uint8, got {codes.dtype}")
    N = codes.shape[0]
    if bits == 8:
        check(codes.shape[1] == K, f"{name}: codes must be [N, K] = [N, {K}] (one code a byte) for x "
              f"{tuple(x.shape)}, got {tuple(codes.shape)}")
    else:
        check(codes.shape[1] == K // 2, f"{name}: packed must be [N, K // 2] = [N, {K // 2}] (two codes a byte, "
              f"as kernels.cpu.quant.q4_pack makes them) for x {tuple(x.shape)}, got {tuple(codes.shape)}")
    check(codes.is_contiguous(), f"{name}: {what} must be contiguous")
    groups = K // group_size
    for label, t in (("scales", scales), ("mins", mins)):
        check(t.dtype == torch.float32, f"{name}: {label} must be torch.float32, got {t.dtype}")
        check(tuple(t.shape) == (N, groups),
              f"{name}: {label} must be [N, K // group_size] = [{N}, {groups}], got {tuple(t.shape)}")
        check(t.is_contiguous(), f"{name}: {label} must be contiguous")
    check_device(name, x, codes, scales, mins)


def _gemv(name: str, bits: int, x, codes, scales, mins, group_size) -> torch.Tensor:
    require_triton(name)
    _check_inputs(name, x, codes, scales, mins, group_size, bits)
    gpu = planning_gpu(x.device)  # None under the interpreter
    if gpu is None and x.dtype == torch.bfloat16:
        # The interpreter keeps bf16 as raw uint16 bits, and its tl.dot multiplies those.
        # The fp32 kernel on the same values computes the same sums (each x * code is
        # exact in fp32 either way), rounded to bf16 once.
        return _gemv(name, bits, x.float(), codes, scales, mins, group_size).to(torch.bfloat16)
    M, K = x.shape
    N = codes.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)  # [M, N]
    if M == 0 or N == 0:
        return y
    cfg = _pick_config(M, N, x.dtype, gpu)
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))
    _quant_gemv_kernel[grid](
        x, codes, scales, mins, y,
        M, N, K,
        GROUP=group_size,
        BITS=bits,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return y


def u8_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            group_size: int = 32) -> torch.Tensor:
    """y [M, N] = x @ w.T in x.dtype, w[n, k] = codes[n, k] * scales[n, k // G] + mins[n, k // G].

    x: fp32/fp16/bf16 [M, K], contiguous. codes: uint8 [N, K] (0..255, ``int8_group``);
    scales, mins: fp32 [N, K // G]; G = group_size, one of 16, 32, 64, 128, dividing K.
    All contiguous, on one device. Sums in fp32; rounds to x.dtype once.
    """
    return _gemv("u8_gemv", 8, x, codes, scales, mins, group_size)


def q4_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
            group_size: int = 32) -> torch.Tensor:
    """y [M, N] = x @ w.T in x.dtype for the 4-bit weight of ``q4_group``.

    x: fp32/fp16/bf16 [M, K], contiguous, K even. packed: uint8 [N, K // 2], byte j of a row
    holding code 2j in its low nibble and code 2j + 1 in its high one (kernels.cpu.quant.q4_pack);
    scales, mins: fp32 [N, K // G]; G = group_size, one of 16, 32, 64, 128, dividing K.
    All contiguous, on one device. Sums in fp32; rounds to x.dtype once.
    """
    return _gemv("q4_gemv", 4, x, packed, scales, mins, group_size)


# ----------------------------------------------------------------------------
# Oracles: dequantize, then a plain matmul in float64.
# ----------------------------------------------------------------------------


def dequantize_ref(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """The float64 weight [N, K] of unpacked codes [N, K] with their group scales and minimums."""
    N, K = codes.shape
    w = codes.double().view(N, K // group_size, group_size) * scales.double()[..., None] + mins.double()[..., None]
    return w.view(N, K)


def q4_unpack_ref(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8 0..15) of packed nibbles [N, K // 2]: low nibble first."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def u8_gemv_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int = 32) -> torch.Tensor:
    """``u8_gemv``'s oracle: the weight dequantized in float64, x @ w.T in float64, rounded to x.dtype."""
    return (x.double() @ dequantize_ref(codes, scales, mins, group_size).T).to(x.dtype)


def q4_gemv_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group_size: int = 32) -> torch.Tensor:
    """``q4_gemv``'s oracle: the nibbles unpacked, then ``u8_gemv_ref`` (float64, rounded to x.dtype)."""
    return u8_gemv_ref(x, q4_unpack_ref(packed), scales, mins, group_size)


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cuda_or_skip("quant_gemv"):
        return
    from triton.testing import do_bench

    G = 32
    e = torch.tensor([], dtype=dtype).element_size()
    # SmolLM2-135M's gate_up projection and head, and a 7B-class MLP.
    for M, N, K in [(1, 3072, 576), (1, 49152, 576), (1, 28672, 4096), (16, 28672, 4096), (64, 28672, 4096)]:
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        codes = torch.randint(0, 256, (N, K), device="cuda", dtype=torch.uint8)
        scales = torch.rand(N, K // G, device="cuda") * 0.01
        mins = -128 * scales
        ms = do_bench(lambda: u8_gemv(x, codes, scales, mins, G))
        report(f"u8_gemv M={M} N={N} K={K} {dtype}", ms, N * K + 8 * N * K // G + (M * K + M * N) * e)
        packed = codes[:, : K // 2].contiguous()
        ms = do_bench(lambda: q4_gemv(x, packed, scales, mins, G))
        report(f"q4_gemv M={M} N={N} K={K} {dtype}", ms, N * K // 2 + 8 * N * K // G + (M * K + M * N) * e)


if __name__ == "__main__":
    bench()
