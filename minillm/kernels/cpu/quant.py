"""Weight-only quantized linear layers on the CPU (``quant_matmul.cpp``): float32 or bfloat16
activations times int8, 8-bit grouped or 4-bit weights, decoded to float32 in registers.

A decode step reads every weight of the model for a few rows of activations, so its time is
mostly the time to stream the weights from memory: 1 byte a weight (int8), 1.25 (8-bit codes
with a scale and a minimum per group of 32) or about 0.75 (4-bit codes, the same per group)
instead of float32's 4 moves that floor down by as much. The kernels read each weight once per call for up to 8 rows of x. On a
2-core AVX-512 machine, against the packed float32 layer (``model.PackedLinear``): at one row
1.7-4.5x faster (int8) and 1.5-4x (4-bit), the larger the layer the larger the gain; at 8 rows
still 1.1-2x; at 32 rows about even, where the arithmetic, the same in every format, is the
floor.

    int8_linear(x, qweight, scale)                   y = x @ (scale[:, None] * qweight).T
    u8_linear(x, qweight, scales, mins, group_size)  y = x @ (q * scales + mins, per group).T, q 0..255
    q4_linear(x, qweight, scales, mins, group_size)  the same with q 0..15, two codes a byte

``u8_linear`` is ``q4_linear``'s arithmetic with a byte per code: groups of 32 with a scale
and a minimum hold GGUF's Q4_1 and Q8_0 weights exactly (a Q8_0 code c in -127..127 is
c + 128 with the minimum -128 * scale).

The oracles are ``int8_linear_ref``, ``u8_linear_ref`` and ``q4_linear_ref``: the weight
dequantized in float64, then ``x @ w.T``. The kernels sum in their own fixed order (float32, vector lanes), so they
equal the oracles within float32 rounding; a row's result does not depend on the other rows
of the call or on the thread count (tests/test_cpu_quant_kernels.py).

The grouped formats' scales and minimums are float32 or float16 (both the same): float16 holds
the GGUF's own (its Q4_1 and Q8_0 blocks store them so) exactly, and reading 2 bytes of each
instead of 4 streams 0.625 bytes a 4-bit weight instead of 0.75, for the same results bit for
bit (each is widened to float32 where it is read). ``BoundLinear`` uses them where they are exact.

bfloat16 activations: y is bfloat16 too, the float32 result for x widened to float32 (exact),
rounded once to bfloat16 -- ``kernel(x)`` equals ``kernel(x.float()).bfloat16()`` bit for bit.
The arithmetic stays float32: bfloat16 halves what x and y take, not the weights' bytes.

The wrappers check what would make the C++ read or write out of bounds (dtype, device,
contiguity, shapes, group size) and raise ValueError; the kernels are built into the CPU
kernels' one library (``build.library``).
"""
from __future__ import annotations

import torch

from .build import DTYPE_CODES, library, named_call

# profiler names of the calls (a ctypes call is no torch op: profiles see these names)
INT8, U8, Q4 = "minillm::cpu_int8_linear", "minillm::cpu_u8_linear", "minillm::cpu_q4_linear"
GROUP_SIZES = (32, 64, 128)
_F32, _F16, _I8, _U8 = torch.float32, torch.float16, torch.int8, torch.uint8
_SCALE_CODES = {_F32: 0, _F16: 1}  # the grouped kernels' scale_dtype argument
_CODES = DTYPE_CODES  # the activations' dtypes (float32, bfloat16): the C functions' first argument


def _need(t: torch.Tensor, name: str, dtype: torch.dtype, dims: int) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got one on {t.device}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() on it)")


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if x.dtype not in _CODES:
        raise ValueError(f"x must be torch.float32 or torch.bfloat16, got {x.dtype}")
    _need(x, "x", x.dtype, 2)
    M, K = x.shape
    if K < 1:
        raise ValueError(f"x must be [M, K] with K >= 1, got {tuple(x.shape)}")
    return M, K


def _int8_refusal(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Raises the ValueError that says what is wrong with int8_linear's arguments."""
    M, K = _check_x(x)
    _need(qweight, "qweight", _I8, 2)
    _need(scale, "scale", _F32, 1)
    N = qweight.shape[0]
    if qweight.shape[1] != K or N < 1:
        raise ValueError(f"qweight must be [N, K] = [N, {K}] for x {tuple(x.shape)}, got {tuple(qweight.shape)}")
    if scale.shape != (N,):
        raise ValueError(f"scale must be [N] = [{N}] (one per row of qweight), got {tuple(scale.shape)}")
    raise ValueError("int8_linear: bad arguments")  # unreachable: the fast check agrees with these


def _grouped_refusal(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     group_size: int, per_byte: int) -> None:
    """Raises the ValueError that says what is wrong with q4_linear's (``per_byte`` 2) or
    u8_linear's (1) arguments."""
    M, K = _check_x(x)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if K % group_size:
        raise ValueError(f"K = {K} (x's columns) must be a multiple of group_size = {group_size}")
    _need(qweight, "qweight", _U8, 2)
    if scales.dtype not in _SCALE_CODES:
        raise ValueError(f"scales must be torch.float32 or torch.float16, got {scales.dtype}")
    _need(scales, "scales", scales.dtype, 2)
    _need(mins, "mins", scales.dtype, 2)  # mins in the scales' dtype
    N = qweight.shape[0]
    if qweight.shape[1] != K // per_byte or N < 1:
        shape, codes = ("[N, K // 2]", "two codes a byte") if per_byte == 2 else ("[N, K]", "one code a byte")
        raise ValueError(f"qweight must be {shape} = [N, {K // per_byte}] ({codes}) for x "
                         f"{tuple(x.shape)}, got {tuple(qweight.shape)}")
    groups = K // group_size
    for name, t in (("scales", scales), ("mins", mins)):
        if t.shape != (N, groups):
            raise ValueError(f"{name} must be [N, K // group_size] = [{N}, {groups}], got {tuple(t.shape)}")
    raise ValueError("grouped linear: bad arguments")  # unreachable


# The checks below are one expression, a microsecond (a decode step makes some 200 of these
# calls); where it fails, the *_refusal functions find what to say.

def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y [M, N] in x's dtype, y[m, n] = scale[n] * sum_k x[m, k] * qweight[n, k].

    x: float32 or bfloat16 [M, K]; qweight: int8 [N, K]; scale: float32 [N]; all contiguous,
    on the CPU. (M = 0, a step without rows, gives an empty [0, N].)
    """
    if not (x.dim() == 2 and qweight.dim() == 2 and x.dtype in _CODES and qweight.dtype is _I8
            and scale.dtype is _F32 and x.is_cpu and qweight.is_cpu and scale.is_cpu and x.is_contiguous()
            and qweight.is_contiguous() and scale.is_contiguous() and x.shape[1] >= 1
            and qweight.shape[0] >= 1 and qweight.shape[1] == x.shape[1] and scale.shape == qweight.shape[:1]):
        _int8_refusal(x, qweight, scale)
    M, K = x.shape
    N = qweight.shape[0]
    y = x.new_empty((M, N))
    if M == 0:
        return y
    rc = named_call(INT8, library().minillm_int8_linear, _CODES[x.dtype], x.data_ptr(), qweight.data_ptr(),
                    scale.data_ptr(),
                    y.data_ptr(), M, N, K, torch.get_num_threads())
    if rc != 0:
        _raise_for(rc)
    return y


def _grouped_linear(name: str, fn: str, per_byte: int, x: torch.Tensor, qweight: torch.Tensor,
                    scales: torch.Tensor, mins: torch.Tensor, group_size: int) -> torch.Tensor:
    """q4_linear (``per_byte`` 2 codes a byte) and u8_linear (1): checks, then the C call ``fn``."""
    if not (x.dim() == 2 and qweight.dim() == 2 and x.dtype in _CODES and qweight.dtype is _U8
            and scales.dtype in _SCALE_CODES and mins.dtype is scales.dtype and x.is_cpu and qweight.is_cpu
            and scales.is_cpu
            and mins.is_cpu and x.is_contiguous() and qweight.is_contiguous() and scales.is_contiguous()
            and mins.is_contiguous() and group_size in GROUP_SIZES and x.shape[1] >= 1
            and x.shape[1] % group_size == 0 and qweight.shape[0] >= 1
            and per_byte * qweight.shape[1] == x.shape[1]
            and scales.shape == (qweight.shape[0], x.shape[1] // group_size) and mins.shape == scales.shape):
        _grouped_refusal(x, qweight, scales, mins, group_size, per_byte)
    M, K = x.shape
    N = qweight.shape[0]
    y = x.new_empty((M, N))
    if M == 0:
        return y
    rc = named_call(name, getattr(library(), fn), _CODES[x.dtype], x.data_ptr(), qweight.data_ptr(),
                    scales.data_ptr(), mins.data_ptr(), _SCALE_CODES[scales.dtype], y.data_ptr(), M, N, K,
                    group_size, torch.get_num_threads())
    if rc != 0:
        _raise_for(rc)
    return y


def q4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """y [M, N] in x's dtype for the 4-bit weight w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G].

    x: float32 or bfloat16 [M, K]; qweight: uint8 [N, K // 2], byte j of a row holding code 2j in its low
    nibble and code 2j + 1 in its high nibble; scales, mins: float32 [N, K // G]; G =
    group_size, one of 32, 64, 128, dividing K. All contiguous, on the CPU. (M = 0 gives an
    empty [0, N].)
    """
    return _grouped_linear(Q4, "minillm_q4_linear", 2, x, qweight, scales, mins, group_size)


def u8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
              group_size: int) -> torch.Tensor:
    """y [M, N] in x's dtype for the 8-bit weight w[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G].

    x: float32 or bfloat16 [M, K]; qweight: uint8 [N, K], one code 0..255 a weight; scales, mins: float32
    or float16 (both the same) [N, K // G]; G = group_size, one of 32, 64, 128, dividing K. All contiguous, on the CPU.
    (M = 0 gives an empty [0, N].)
    """
    return _grouped_linear(U8, "minillm_u8_linear", 1, x, qweight, scales, mins, group_size)


class BoundLinear:
    """One layer's weights checked once and bound to their C function: ``bound(x)`` is
    ``q4_linear(x, qweight, scales, mins, group_size)`` (or u8 / int8), checking only x.

    A decode step makes some 120 of these calls with a single row of x, each a few
    microseconds of C; the full checks of the functions above, the dictionary lookups and the
    conversion of a dozen arguments cost as much again. Binding keeps the weights' pointers
    (and the tensors, so that they stay alive); ``holds`` says whether it still binds the
    tensors a layer has now (a layer moved or given new buffers binds again).

    A grouped layer whose float32 scales and minimums are all float16 values (the GGUF's own)
    is bound to float16 copies of them: the same results, bit for bit, from fewer bytes
    (``half_scales`` says which it is bound to).
    """

    __slots__ = ("fmt", "tensors", "K", "N", "half_scales", "_halves", "_name", "_fn", "_args", "_tail")

    def __init__(self, fmt: str, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 group_size: int | None):
        if fmt not in ("int8", "u8", "q4"):
            raise ValueError(f"fmt must be 'int8', 'u8' or 'q4', got {fmt!r}")
        self.N = qweight.shape[0] if qweight.dim() == 2 else 0
        self.K = (qweight.shape[1] * (2 if fmt == "q4" else 1)) if qweight.dim() == 2 else 0
        probe = torch.zeros(1, max(self.K, 1))  # the full checks, once, on a row of the layer's width
        self.fmt, self.tensors, self.half_scales, self._halves = fmt, (qweight, scales, mins), False, ()
        self._name = {"int8": INT8, "u8": U8, "q4": Q4}[fmt]
        self._fn = getattr(library(), f"minillm_{fmt}_linear")
        if fmt == "int8":
            int8_linear(probe, qweight, scales)
            self._args, self._tail = (qweight.data_ptr(), scales.data_ptr()), ()
            return
        (q4_linear if fmt == "q4" else u8_linear)(probe, qweight, scales, mins, group_size)
        if scales.dtype == _F32 and half_holds(scales) and half_holds(mins):
            scales, mins = self._halves = scales.half(), mins.half()  # kept alive: the call reads them
            self.half_scales = True
        self._args = (qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), _SCALE_CODES[scales.dtype])
        self._tail = (group_size,)

    def holds(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> bool:
        """Whether these are the tensors it was bound to, still where they were."""
        q, s, m = self.tensors
        return q is qweight and s is scales and m is mins and q.data_ptr() == self._args[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """y [M, N] in x's dtype for x [M, K] (float32 or bfloat16, contiguous, on the CPU)."""
        code = _CODES.get(x.dtype)
        if code is None or not x.is_cpu or x.dim() != 2 or x.shape[1] != self.K or not x.is_contiguous():
            return self._checked(x)  # raises the ValueError that says what is wrong with x
        M = x.shape[0]
        y = x.new_empty((M, self.N))
        if M == 0:
            return y
        rc = named_call(self._name, self._fn, code, x.data_ptr(), *self._args, y.data_ptr(), M, self.N, self.K,
                        *self._tail, torch.get_num_threads())
        if rc != 0:
            _raise_for(rc)
        return y

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        q, s, m = self.tensors
        if self.fmt == "int8":
            return int8_linear(x, q, s)
        return (q4_linear if self.fmt == "q4" else u8_linear)(x, q, s, m, self._tail[0])


def half_holds(t: torch.Tensor) -> bool:
    """Whether every value of the float32 tensor ``t`` is a float16 value (float16 stores it exactly)."""
    return bool(torch.equal(t.half().float(), t))


def _raise_for(rc: int) -> None:
    if rc == 7:
        raise MemoryError("the quantized linear could not allocate its copy of x")
    raise ValueError(f"the quantized linear refused its arguments (code {rc})")


def _rounded_like(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """An oracle's float64 result in the kernel's output dtype: float32 for float32 x; for
    bfloat16 x, float32 first, then bfloat16 (the kernel's two roundings)."""
    y = y.float()
    return y if x.dtype == _F32 else y.to(x.dtype)


# ---------------------------------------------------------------- the oracles

def int8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``int8_linear``'s oracle: the weight dequantized in float64, x @ w.T, rounded to float32
    (then to bfloat16 for bfloat16 x)."""
    w = qweight.double() * scale.double()[:, None]
    return _rounded_like(x.double() @ w.T, x)


def u8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """``u8_linear``'s oracle: the weight dequantized in float64, x @ w.T, rounded to float32
    (then to bfloat16 for bfloat16 x)."""
    N, K = qweight.shape
    q = qweight.double().view(N, K // group_size, group_size)
    w = q * scales.double()[..., None] + mins.double()[..., None]
    return _rounded_like(x.double() @ w.view(N, K).T, x)


def q4_unpack(qweight: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) of a packed 4-bit weight [N, K // 2]: low nibble first."""
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)


def q4_pack(codes: torch.Tensor) -> torch.Tensor:
    """The packed weight [N, K // 2] of codes [N, K] (integers 0..15): code 2j in the low nibble of
    byte j, code 2j + 1 in the high one (``q4_unpack``'s inverse)."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def q4_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """``q4_linear``'s oracle: the weight dequantized in float64, x @ w.T, rounded to float32
    (then to bfloat16 for bfloat16 x)."""
    q = q4_unpack(qweight).double()
    N, K = q.shape
    w = (q.view(N, K // group_size, group_size) * scales.double()[..., None] + mins.double()[..., None])
    return _rounded_like(x.double() @ w.view(N, K).T, x)
