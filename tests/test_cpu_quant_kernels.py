"""The CPU quantized linear kernels (minillm/kernels/cpu/quant.py, quant_matmul.cpp) against their oracles.

* ``int8_linear``, ``u8_linear`` and ``q4_linear`` equal ``int8_linear_ref`` /
  ``u8_linear_ref`` / ``q4_linear_ref`` (the weight dequantized in float64, x @ w.T) within
  float32 rounding: for every output, |y - ref| <= 1e-5 * (the sum of the absolute values of
  the terms the kernel adds) -- for int8 sum_k |x[m, k] w[n, k]|, for the grouped formats
  sum_k |x[m, k]| (|q s| + |min|) -- over shapes with K not a multiple of the vector width
  (int8), M of 1, 3, 8 and 33, N odd, every group size;
* 8-bit codes with a minimum hold GGUF's symmetric Q8_0 weights exactly;
* a row's result does not depend on the other rows of the call (alone vs in a batch of 8 or
  33) nor on the thread count (1, 2, 3): bit for bit;
* float16 scales and minimums give the float32 ones' results bit for bit where they hold the
  same values (the GGUF's own are float16), and the oracle's where they do not;
* bfloat16 activations give the float32 result for x widened, rounded once to bfloat16: bit for
  bit, in every format, alone and in a batch (and within a bfloat16 rounding of the oracle);
* bad arguments (dtype, device, contiguity, shapes, group size) are a ValueError that names
  what to change;
* the generic builds (AVX2 only; no vector extension at all) compile and compute the same
  numbers, within rounding.

The kernels are built on first use; without a compiler, or where the build fails, the tests
skip.
"""
from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from minillm.kernels.cpu import build, quant
from minillm.kernels.cpu.quant import (int8_linear, int8_linear_ref, q4_linear, q4_linear_ref, u8_linear,
                                       u8_linear_ref)

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler to build the CPU kernels")

RTOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _library():
    try:
        build.library()
    except RuntimeError as e:
        pytest.skip(f"the CPU kernels could not be built: {e}")


def _int8_case(M: int, N: int, K: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    qweight = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.02 + 1e-3
    return x, qweight, scale


def _q4_case(M: int, N: int, K: int, G: int, seed: int = 0):
    """Codes 0..15 with a positive scale and a minimum around -8 scales, as an asymmetric
    quantizer of a weight centred on zero makes them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    codes = torch.randint(0, 16, (N, K), generator=g)
    scales = torch.rand(N, K // G, generator=g) * 0.01 + 1e-3
    mins = -scales * (8 + torch.randn(N, K // G, generator=g))
    return x, quant.q4_pack(codes), scales, mins


def _u8_case(M: int, N: int, K: int, G: int, seed: int = 0):
    """Codes 0..255 with a positive scale and a minimum around -128 scales (a weight centred on zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    qweight = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // G, generator=g) * 0.001 + 1e-4
    mins = -scales * (128 + 8 * torch.randn(N, K // G, generator=g))
    return x, qweight, scales, mins


def _int8_magnitude(x, qweight, scale):
    return (x.double().abs() @ (qweight.double().abs() * scale.double()[:, None]).T).float()


def _q4_magnitude(x, qweight, scales, mins, G):
    q = quant.q4_unpack(qweight).double()
    N, K = q.shape
    terms = (q.view(N, -1, G) * scales.double()[..., None]).abs() + mins.double().abs()[..., None]
    return (x.double().abs() @ terms.view(N, K).T).float()


def _u8_magnitude(x, qweight, scales, mins, G):
    N, K = qweight.shape
    terms = (qweight.double().view(N, -1, G) * scales.double()[..., None]).abs() + mins.double().abs()[..., None]
    return (x.double().abs() @ terms.view(N, K).T).float()


def _assert_within(got, want, magnitude):
    assert got.shape == want.shape and got.dtype == torch.float32
    err = (got - want).abs()
    bound = RTOL * magnitude + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {err.max().item():.3g} is {worst:.2f}x the bound"


# ---------------------------------------------------------------- against the oracles

INT8_SHAPES = [(1, 1, 1), (1, 7, 40), (3, 31, 7), (8, 97, 576), (33, 13, 1000), (3, 301, 576), (8, 301, 1536),
               (1, 577, 576), (33, 75, 40)]


@pytest.mark.parametrize("M,N,K", INT8_SHAPES)
def test_int8_linear_equals_the_oracle(M, N, K):
    x, qweight, scale = _int8_case(M, N, K, seed=M * 1000 + N + K)
    got = int8_linear(x, qweight, scale)
    _assert_within(got, int8_linear_ref(x, qweight, scale), _int8_magnitude(x, qweight, scale))


Q4_SHAPES = [(1, 1, 32, 32), (1, 7, 96, 32), (3, 31, 576, 32), (8, 97, 192, 64), (33, 13, 1536, 64),
             (3, 301, 640, 128), (8, 301, 576, 32), (1, 577, 1536, 128), (33, 75, 128, 128)]


@pytest.mark.parametrize("M,N,K,G", Q4_SHAPES)
def test_q4_linear_equals_the_oracle(M, N, K, G):
    x, qweight, scales, mins = _q4_case(M, N, K, G, seed=M * 1000 + N + K)
    got = q4_linear(x, qweight, scales, mins, G)
    _assert_within(got, q4_linear_ref(x, qweight, scales, mins, G), _q4_magnitude(x, qweight, scales, mins, G))


@pytest.mark.parametrize("M,N,K,G", Q4_SHAPES)
def test_u8_linear_equals_the_oracle(M, N, K, G):
    x, qweight, scales, mins = _u8_case(M, N, K, G, seed=M * 1000 + N + K)
    got = u8_linear(x, qweight, scales, mins, G)
    _assert_within(got, u8_linear_ref(x, qweight, scales, mins, G), _u8_magnitude(x, qweight, scales, mins, G))


def test_the_8bit_layout_is_one_code_a_byte_in_order():
    """One weight at a time: y picks w[0, k] = q * scale + min, each group its own scale and min."""
    codes = torch.tensor([[0, 1, 254, 255] + list(range(28)) + [7, 200] + [0] * 30], dtype=torch.uint8)
    scales, mins = torch.tensor([[0.5, 0.25]]), torch.tensor([[-1.0, 2.0]])
    for k in (0, 1, 2, 3, 31, 32, 33):
        x = torch.zeros(1, 64)
        x[0, k] = 1.0
        g = k // 32
        want = codes[0, k].item() * scales[0, g].item() + mins[0, g].item()
        assert u8_linear(x, codes, scales, mins, 32).item() == want


def test_8bit_groups_hold_q8_0_weights_exactly():
    """A Q8_0 block (codes c in -127..127, one scale a group of 32) is the 8-bit code c + 128 with
    the minimum -128 * scale: the same weights, exactly (in the oracle's float64), and the kernel
    agrees with the float layer c * scale within rounding."""
    g = torch.Generator().manual_seed(5)
    N, K = 37, 576
    c = torch.randint(-127, 128, (N, K), generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.01 + 1e-4).float()
    qweight, mins = (c + 128).to(torch.uint8), -128 * d
    w = (c.double().view(N, -1, 32) * d.double()[..., None]).view(N, K)
    dequantized = qweight.double().view(N, -1, 32) * d.double()[..., None] + mins.double()[..., None]
    assert torch.equal(dequantized.view(N, K), w)
    x = torch.randn(5, K, generator=g)
    _assert_within(u8_linear(x, qweight, d, mins, 32), (x.double() @ w.T).float(),
                   _u8_magnitude(x, qweight, d, mins, 32))


def test_the_4bit_layout_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0] + [0] * 28])
    packed = quant.q4_pack(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    assert packed[0, :2].tolist() == [0x21, 0x0F]
    assert torch.equal(quant.q4_unpack(packed), codes.to(torch.uint8))
    # one weight at a time: y picks w[0, k] = q * scale + min
    scales, mins = torch.tensor([[0.5]]), torch.tensor([[-1.0]])
    for k, q in enumerate([1, 2, 15, 0]):
        x = torch.zeros(1, 32)
        x[0, k] = 1.0
        assert q4_linear(x, packed, scales, mins, 32).item() == q * 0.5 - 1.0


def test_a_quantized_weight_matches_its_float_layer():
    """The two formats as a quantizer makes them from a float weight: the kernels compute
    x @ dequantized(w).T, which is close to the float layer (the quantization error)."""
    torch.manual_seed(0)
    w, x = torch.randn(65, 256) * 0.05, torch.randn(4, 256)
    scale = w.abs().amax(dim=1) / 127
    qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    groups = w.view(65, -1, 32)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (hi - lo) / 15
    codes = torch.round((groups - lo[..., None]) / scales[..., None]).clamp(0, 15).view(65, 256)
    exact = x @ w.T

    def relative_error(y):
        return ((y - exact).norm() / exact.norm()).item()

    assert relative_error(int8_linear(x, qweight, scale)) < 0.02  # measured 0.007
    assert relative_error(q4_linear(x, quant.q4_pack(codes), scales, lo, 32)) < 0.15  # measured 0.08


# ---------------------------------------------------------------- invariance

def _cases():
    yield "int8", int8_linear, _int8_case(33, 301, 576, seed=1)
    yield "int8 K=40", int8_linear, _int8_case(33, 301, 40, seed=2)
    yield "int8 K=1000", int8_linear, _int8_case(33, 129, 1000, seed=3)
    for G in quant.GROUP_SIZES:
        x, qw, s, m = _q4_case(33, 301, 1536 if G == 64 else 576 if G == 32 else 640, G, seed=G)
        yield f"q4 G={G}", (lambda x, qw, s, m, G=G: q4_linear(x, qw, s, m, G)), (x, qw, s, m)
    for G in quant.GROUP_SIZES:
        x, qw, s, m = _u8_case(33, 301, 1536 if G == 64 else 576 if G == 32 else 640, G, seed=G + 1)
        yield f"u8 G={G}", (lambda x, qw, s, m, G=G: u8_linear(x, qw, s, m, G)), (x, qw, s, m)


@pytest.mark.parametrize("name,fn,args", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_a_rows_result_does_not_depend_on_the_batch(name, fn, args):
    x, *weights = args
    whole = fn(x, *weights)
    eight = fn(x[:8].clone(), *weights)
    assert torch.equal(eight, whole[:8])
    for m in (0, 3, 7, 8, 31, 32):
        alone = fn(x[m:m + 1].clone(), *weights)
        assert torch.equal(alone[0], whole[m]), f"row {m}"
        view = fn(x[m:m + 1], *weights)  # a row of x in place (unaligned where K * 4 is no multiple of 64)
        assert torch.equal(view[0], whole[m])
    for a, b in ((1, 4), (5, 12), (9, 33)):  # tiles of every height
        assert torch.equal(fn(x[a:b].clone(), *weights), whole[a:b])


@pytest.mark.parametrize("name,fn,args", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_result_does_not_depend_on_the_thread_count(name, fn, args):
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(fn(*args))
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.parametrize("name,fn,args", list(_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_bfloat16_activations_are_the_float32_result_rounded_once(name, fn, args):
    x, *weights = args
    xb = x.bfloat16()
    got = fn(xb, *weights)
    assert got.dtype == torch.bfloat16 and got.shape == (x.shape[0], weights[0].shape[0])
    assert torch.equal(got, fn(xb.float(), *weights).bfloat16())
    for m in (0, 7, 32):  # a row alone, and in place inside the batch, as in float32
        assert torch.equal(fn(xb[m:m + 1].clone(), *weights)[0], got[m])
        assert torch.equal(fn(xb[m:m + 1], *weights)[0], got[m])


@pytest.mark.parametrize("kind", ["int8", "q4", "u8"])
def test_bfloat16_activations_against_the_oracle(kind):
    """Within a bfloat16 rounding of the oracle (which rounds its float64 sum to float32, then to
    bfloat16): half a bfloat16 step of the result, plus the float32 bound."""
    if kind == "int8":
        x, *w = _int8_case(5, 97, 576, seed=11)
        fn, ref, mag = int8_linear, int8_linear_ref, _int8_magnitude
    else:
        case, fn, ref, mag = ((_q4_case, q4_linear, q4_linear_ref, _q4_magnitude) if kind == "q4"
                              else (_u8_case, u8_linear, u8_linear_ref, _u8_magnitude))
        x, *w = case(5, 97, 576, 32, seed=12)
        w.append(32)
    xb = x.bfloat16()
    got, want = fn(xb, *w), ref(xb, *w)
    assert got.dtype == want.dtype == torch.bfloat16
    bound = RTOL * mag(xb.float(), *w) + want.float().abs() * 2.0 ** -8 + 1e-30
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert (got == want).float().mean() > 0.9  # one rounding apart at most, rarely that


@pytest.mark.parametrize("kind", ["q4", "u8"])
@pytest.mark.parametrize("M,N,K,G", [(1, 301, 576, 32), (3, 97, 1536, 64), (33, 13, 640, 128), (8, 7, 96, 32)])
def test_float16_scales_give_the_same_results(kind, M, N, K, G):
    case, fn, ref, mag = ((_q4_case, q4_linear, q4_linear_ref, _q4_magnitude) if kind == "q4"
                          else (_u8_case, u8_linear, u8_linear_ref, _u8_magnitude))
    x, qw, sc, mn = case(M, N, K, G, seed=K + G)
    sc16, mn16 = sc.half(), mn.half()  # values float16 holds: float32 copies of them give the same numbers
    got = fn(x, qw, sc16, mn16, G)
    assert torch.equal(got, fn(x, qw, sc16.float(), mn16.float(), G))
    _assert_within(got, ref(x, qw, sc16, mn16, G), mag(x, qw, sc16.float(), mn16.float(), G))
    assert not torch.equal(got, fn(x, qw, sc, mn, G))  # sc, mn themselves are no float16 values
    assert torch.equal(fn(x[-1:].clone(), qw, sc16, mn16, G)[0], got[-1])  # a row alone, as in float32
    assert torch.equal(fn(x.bfloat16(), qw, sc16, mn16, G), fn(x.bfloat16().float(), qw, sc16, mn16, G).bfloat16())


def test_a_bound_layer_reads_float16_scales_only_where_they_are_exact():
    x, qw, sc, mn = _q4_case(3, 97, 576, 32, seed=9)
    exact = quant.BoundLinear("q4", qw, sc.half().float(), mn.half().float(), 32)
    assert exact.half_scales and torch.equal(exact(x), q4_linear(x, qw, sc.half(), mn.half(), 32))
    inexact = quant.BoundLinear("q4", qw, sc, mn, 32)
    assert not inexact.half_scales and torch.equal(inexact(x), q4_linear(x, qw, sc, mn, 32))
    x8, q8, s8 = _int8_case(3, 97, 576, seed=9)
    assert torch.equal(quant.BoundLinear("int8", q8, s8, None, None)(x8), int8_linear(x8, q8, s8))
    with pytest.raises(ValueError, match=r"qweight must be \[N, K // 2\] = \[N, 272\]"):
        exact(x[:, :544].contiguous())  # x checked at each call, with the wrapper's messages
    with pytest.raises(ValueError, match="x must be torch.float32 or torch.bfloat16"):
        exact(x.half())


# ---------------------------------------------------------------- refusals

def test_int8_linear_refuses_what_it_cannot_read():
    x, qw, s = _int8_case(2, 5, 64)
    cases = [
        ((x.double(), qw, s), r"x must be torch.float32 or torch.bfloat16, got torch.float64"),
        ((x.half(), qw, s), r"x must be torch.float32 or torch.bfloat16, got torch.float16"),
        ((x, qw.to(torch.uint8), s), "qweight must be torch.int8"),
        ((x, qw, s.double()), "scale must be torch.float32"),
        ((torch.randn(64, 2).T, qw, s), "x must be contiguous"),
        ((x, torch.randint(-5, 5, (64, 5), dtype=torch.int8).T, s), "qweight must be contiguous"),
        ((x, qw, torch.rand(10)[::2]), "scale must be contiguous"),
        ((x[:, :63].contiguous(), qw, s), r"qweight must be \[N, K\] = \[N, 63\]"),
        ((x, qw, torch.rand(4)), r"scale must be \[N\] = \[5\]"),
        ((x[0], qw, s), "x must have 2 dimension"),
        ((x[:, :0], qw, s), "K >= 1"),
        ((x, qw[0], s), "qweight must have 2 dimension"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            int8_linear(*args)


def test_q4_linear_refuses_what_it_cannot_read():
    x, qw, sc, mn = _q4_case(2, 5, 128, 32)
    cases = [
        ((x, qw, sc, mn, 16), "group_size must be one of"),
        ((x, qw, sc, mn, 48), "group_size must be one of"),
        ((x[:, :96].contiguous(), qw, sc, mn, 64), "multiple of group_size"),
        ((x.double(), qw, sc, mn, 32), r"x must be torch.float32 or torch.bfloat16, got torch.float64"),
        ((x, qw.to(torch.int8), sc, mn, 32), "qweight must be torch.uint8"),
        ((x, qw, sc.double(), mn, 32), "scales must be torch.float32 or torch.float16, got torch.float64"),
        ((x, qw, sc, mn.double(), 32), "mins must be torch.float32"),
        ((x, qw, sc.half(), mn, 32), "mins must be torch.float16, got torch.float32"),  # the scales' dtype
        ((torch.randn(128, 2).T, qw, sc, mn, 32), "x must be contiguous"),
        ((x, torch.zeros(64, 5, dtype=torch.uint8).T, sc, mn, 32), "qweight must be contiguous"),
        ((x, qw, torch.rand(4, 5).T, mn, 32), "scales must be contiguous"),
        ((x, quant.q4_pack(torch.zeros(5, 64)), sc, mn, 32), r"qweight must be \[N, K // 2\] = \[N, 64\]"),
        ((x, torch.zeros(5, 128, dtype=torch.uint8), sc, mn, 32), r"qweight must be \[N, K // 2\]"),
        ((x, qw, sc[:, :2].contiguous(), mn, 32), r"scales must be \[N, K // group_size\] = \[5, 4\]"),
        ((x, qw, sc, mn[:4].contiguous(), 32), r"mins must be \[N, K // group_size\] = \[5, 4\]"),
        ((x, qw, sc, mn, 64), r"scales must be \[N, K // group_size\] = \[5, 2\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            q4_linear(*args)


def test_u8_linear_refuses_what_it_cannot_read():
    x, qw, sc, mn = _u8_case(2, 5, 128, 32)
    cases = [
        ((x, qw, sc, mn, 16), "group_size must be one of"),
        ((x, qw, sc, mn, 48), "group_size must be one of"),
        ((x[:, :96].contiguous(), qw, sc, mn, 64), "multiple of group_size"),
        ((x.double(), qw, sc, mn, 32), r"x must be torch.float32 or torch.bfloat16, got torch.float64"),
        ((x, qw.to(torch.int8), sc, mn, 32), "qweight must be torch.uint8"),
        ((x, qw, sc.double(), mn, 32), "scales must be torch.float32 or torch.float16, got torch.float64"),
        ((x, qw, sc, mn.double(), 32), "mins must be torch.float32"),
        ((x, qw, sc.half(), mn, 32), "mins must be torch.float16, got torch.float32"),  # the scales' dtype
        ((torch.randn(128, 2).T, qw, sc, mn, 32), "x must be contiguous"),
        ((x, torch.zeros(128, 5, dtype=torch.uint8).T, sc, mn, 32), "qweight must be contiguous"),
        ((x, qw, torch.rand(4, 5).T, mn, 32), "scales must be contiguous"),
        ((x, quant.q4_pack(torch.zeros(5, 128)), sc, mn, 32), r"qweight must be \[N, K\] = \[N, 128\] \(one code"),
        ((x, qw[0], sc, mn, 32), "qweight must have 2 dimension"),
        ((x, qw, sc[:, :2].contiguous(), mn, 32), r"scales must be \[N, K // group_size\] = \[5, 4\]"),
        ((x, qw, sc, mn[:4].contiguous(), 32), r"mins must be \[N, K // group_size\] = \[5, 4\]"),
        ((x, qw, sc, mn, 64), r"scales must be \[N, K // group_size\] = \[5, 2\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            u8_linear(*args)


def test_no_rows_give_an_empty_result():
    """A step without rows (no token to sample) is an empty result, its weights still checked."""
    x, qw, s = _int8_case(3, 5, 64)
    assert int8_linear(x[:0], qw, s).shape == (0, 5)
    with pytest.raises(ValueError, match=r"qweight must be \[N, K\]"):
        int8_linear(x[:0], qw[:, 1:].contiguous(), s)
    x, qw, sc, mn = _q4_case(3, 5, 64, 32)
    assert q4_linear(x[:0], qw, sc, mn, 32).shape == (0, 5)
    with pytest.raises(ValueError, match="group_size must be one of"):
        q4_linear(x[:0], qw, sc, mn, 16)
    x, qw, sc, mn = _u8_case(3, 5, 64, 32)
    assert u8_linear(x[:0], qw, sc, mn, 32).shape == (0, 5)
    with pytest.raises(ValueError, match=r"qweight must be \[N, K\]"):
        u8_linear(x[:0], qw[:, 32:].contiguous(), sc, mn, 32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA tensor to refuse")
def test_cuda_tensors_are_refused():
    x, qw, s = _int8_case(2, 5, 64)
    with pytest.raises(ValueError, match="x must be a CPU tensor"):
        int8_linear(x.cuda(), qw, s)


# ---------------------------------------------------------------- the other builds

def _cpu_has(*flags: str) -> bool:
    words = build._cpu_flags().split()
    return all(f in words for f in flags)


VARIANTS = {"generic": [], "avx2": ["-mavx2", "-mfma"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_generic_builds_compute_the_same(variant, tmp_path):
    """quant_matmul.cpp built without -march=native: plain C++ (no vector extension), and AVX2
    with FMA only; each is run where the CPU can, against the oracles and for batch invariance."""
    if variant == "avx2" and not _cpu_has("avx2", "fma"):
        pytest.skip("this CPU has no AVX2/FMA")
    src, flags = build.SOURCES[-1]
    assert src.name == "quant_matmul.cpp"
    out = tmp_path / f"quant_{variant}.so"
    cmd = [build.compiler(), *flags, *VARIANTS[variant], "-shared", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    lib = ctypes.CDLL(str(out))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.minillm_int8_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.minillm_q4_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i32, ptr, i64, i64, i64, i32, i32]
    lib.minillm_u8_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i32, ptr, i64, i64, i64, i32, i32]

    def int8(x, qw, s):
        y = x.new_empty(x.shape[0], qw.shape[0])
        assert lib.minillm_int8_linear(build.DTYPE_CODES[x.dtype], x.data_ptr(), qw.data_ptr(), s.data_ptr(),
                                       y.data_ptr(), x.shape[0], qw.shape[0], x.shape[1], 2) == 0
        return y

    def grouped(fn):
        def call(x, qw, sc, mn, G):
            y = x.new_empty(x.shape[0], qw.shape[0])
            assert fn(build.DTYPE_CODES[x.dtype], x.data_ptr(), qw.data_ptr(), sc.data_ptr(), mn.data_ptr(),
                      {torch.float32: 0, torch.float16: 1}[sc.dtype], y.data_ptr(), x.shape[0], qw.shape[0],
                      x.shape[1], G, 2) == 0
            return y
        return call

    q4, u8 = grouped(lib.minillm_q4_linear), grouped(lib.minillm_u8_linear)

    for M, N, K in [(1, 7, 40), (9, 301, 576), (3, 13, 1000)]:
        x, qw, s = _int8_case(M, N, K, seed=K)
        y = int8(x, qw, s)
        _assert_within(y, int8_linear_ref(x, qw, s), _int8_magnitude(x, qw, s))
        assert torch.equal(int8(x[-1:].clone(), qw, s)[0], y[-1])
    for M, N, K, G in [(1, 7, 96, 32), (9, 301, 576, 32), (3, 13, 640, 128), (2, 5, 192, 64)]:
        x, qw, sc, mn = _q4_case(M, N, K, G, seed=K)
        y = q4(x, qw, sc, mn, G)
        _assert_within(y, q4_linear_ref(x, qw, sc, mn, G), _q4_magnitude(x, qw, sc, mn, G))
        assert torch.equal(q4(x[-1:].clone(), qw, sc, mn, G)[0], y[-1])
        x, qw, sc, mn = _u8_case(M, N, K, G, seed=K + 1)
        y = u8(x, qw, sc, mn, G)
        _assert_within(y, u8_linear_ref(x, qw, sc, mn, G), _u8_magnitude(x, qw, sc, mn, G))
        assert torch.equal(u8(x[-1:].clone(), qw, sc, mn, G)[0], y[-1])
        xb = x.bfloat16()  # bfloat16 activations: the float32 result for x widened, rounded once
        assert torch.equal(u8(xb, qw, sc, mn, G), u8(xb.float(), qw, sc, mn, G).bfloat16())
        sc16, mn16 = sc.half(), mn.half()  # float16 scales: the float32 copies' results
        assert torch.equal(q4(x, quant.q4_pack(qw % 16), sc16, mn16, G),
                           q4(x, quant.q4_pack(qw % 16), sc16.float(), mn16.float(), G))
        assert torch.equal(u8(x, qw, sc16, mn16, G), u8(x, qw, sc16.float(), mn16.float(), G))
    x, qw, s = _int8_case(3, 13, 1000, seed=5)
    assert torch.equal(int8(x.bfloat16(), qw, s), int8(x.bfloat16().float(), qw, s).bfloat16())
    x, qw, sc, mn = _q4_case(3, 13, 640, 128, seed=6)
    assert torch.equal(q4(x.bfloat16(), qw, sc, mn, 128), q4(x.bfloat16().float(), qw, sc, mn, 128).bfloat16())
