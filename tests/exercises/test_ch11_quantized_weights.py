"""Grades exercises/ch11_quantized_weights.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain PyTorch), never taken from minillm, so the tests stay
meaningful for the solutions. The Triton GEMV runs under the Triton interpreter on the
CPU (tests/conftest.py sets TRITON_INTERPRET=1 when there is no GPU). Every failure is one
line: what was checked, what was expected, what came back.
"""
from __future__ import annotations

import math

import pytest
import torch

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch11_quantized_weights"
quantize_groups = adapters.function(CHAPTER, "quantize_groups")
dequantize_groups = adapters.function(CHAPTER, "dequantize_groups")
decode_floor_ms = adapters.function(CHAPTER, "decode_floor_ms")
int8_gemv_triton = adapters.function(CHAPTER, "int8_gemv_triton")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _expect_value_error(fn, *args, what: str, **kwargs):
    __tracebackhide__ = True
    try:
        got = fn(*args, **kwargs)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 -- reported in one line: which error came instead
        pytest.fail(f"{what}: expected ValueError, got {type(e).__name__}: {e}", pytrace=False)
    pytest.fail(f"{what}: expected ValueError, got a return value of type {type(got).__name__}", pytrace=False)


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * 0.05


def _oracle_groups(w: torch.Tensor, bits: int, G: int):
    N, K = w.shape
    top = 2 ** bits - 1
    g = w.reshape(N, K // G, G)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / top
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, top)
    return codes.reshape(N, K).to(torch.uint8), scale, lo


def _check_triple(out, N: int, K: int, G: int, what: str):
    adapters.expect_that(isinstance(out, tuple) and len(out) == 3, what, "a tuple (codes, scales, mins)",
                         type(out).__name__)
    codes, scales, mins = out
    adapters.expect((codes.dtype, tuple(codes.shape)), (torch.uint8, (N, K)), f"{what}: codes (dtype, shape)")
    adapters.expect((scales.dtype, tuple(scales.shape)), (torch.float32, (N, K // G)),
                    f"{what}: scales (dtype, shape)")
    adapters.expect((mins.dtype, tuple(mins.shape)), (torch.float32, (N, K // G)), f"{what}: mins (dtype, shape)")
    return codes, scales, mins


# ---------------------------------------------------------------- quantize_groups


def test_quantize_groups_example():
    """The docstring's example: min -1, scale (max - min) / 15 = 1, codes the nearest grid points (a tie to even)."""
    w = torch.tensor([[-1.0, 0.0, 0.5, 14.0]])
    codes, scales, mins = _check_triple(quantize_groups(w, 4, group_size=4), 1, 4, 4,
                                        "quantize_groups([[-1, 0, 0.5, 14]], bits=4, group_size=4)")
    adapters.expect(codes.tolist(), [[0, 1, 2, 15]], "quantize_groups([[-1, 0, 0.5, 14]], 4 bits): codes "
                                                     "(min -1, scale 1; 1.5 steps rounds to the even 2)")
    adapters.expect((scales.tolist(), mins.tolist()), ([[1.0]], [[-1.0]]),
                    "quantize_groups([[-1, 0, 0.5, 14]], 4 bits): (scales, mins)")


@pytest.mark.parametrize("bits,N,K,G", [(8, 5, 64, 32), (4, 7, 96, 32), (4, 3, 64, 16), (8, 2, 128, 128)])
def test_quantize_groups_matches_the_grid(bits, N, K, G):
    """Contract: per group, min is the smallest weight, scale (max - min) / (2**bits - 1), each code the nearest
    grid point clamped to the range; every weight within scale / 2 of what it dequantizes to."""
    w = _weights(N, K, seed=bits * 100 + K)
    what = f"quantize_groups(weight [{N}, {K}], bits={bits}, group_size={G})"
    codes, scales, mins = _check_triple(quantize_groups(w, bits, group_size=G), N, K, G, what)
    want_codes, want_scales, want_mins = _oracle_groups(w, bits, G)
    adapters.expect_that(torch.allclose(mins, want_mins, rtol=0, atol=0), f"{what}: mins",
                         "each group's smallest weight", f"largest error {float((mins - want_mins).abs().max()):.3g}")
    adapters.expect_that(torch.allclose(scales, want_scales, rtol=1e-6, atol=0), f"{what}: scales",
                         f"(max - min) / {2 ** bits - 1} per group",
                         f"largest relative error {float(((scales - want_scales) / want_scales).abs().max()):.3g}")
    adapters.expect_that(int(codes.max()) <= 2 ** bits - 1, f"{what}: largest code", f"<= {2 ** bits - 1}",
                         int(codes.max()))
    wrong = (codes.int() - want_codes.int()).abs()
    if int(wrong.max()) > 0:
        n, k = divmod(int(wrong.flatten().argmax()), K)
        pytest.fail(f"{what}: code [{n}, {k}] (weight {float(w[n, k]):.6g}): expected {int(want_codes[n, k])} "
                    f"(the nearest grid point), got {int(codes[n, k])}; {int((wrong > 0).sum())} codes differ",
                    pytrace=False)
    back = codes.float().view(N, K // G, G) * scales[..., None] + mins[..., None]
    err = ((back.view(N, K) - w).abs() / scales.repeat_interleave(G, dim=1)).max()
    adapters.expect_that(float(err) <= 0.5 + 1e-4, f"{what}: rounding error", "at most half a step (scale / 2)",
                         f"{float(err):.3f} steps")


def test_quantize_groups_constant_group():
    """Contract: a constant group (max == min) gets scale 1.0 and every code 0."""
    w = torch.cat([torch.full((2, 32), 0.25), _weights(2, 32, seed=5)], dim=1)
    what = "quantize_groups(weight [2, 64] whose first group is all 0.25, bits=8)"
    codes, scales, mins = _check_triple(quantize_groups(w, 8, group_size=32), 2, 64, 32, what)
    adapters.expect((codes[:, :32].unique().tolist(), scales[:, 0].tolist(), mins[:, 0].tolist()),
                    ([0], [1.0, 1.0], [0.25, 0.25]), f"{what}: the constant group's (codes, scales, mins)")


def test_quantize_groups_rejects_bad_input():
    """Contract: bits not 4 or 8, group_size < 1, or K not a multiple of it -> ValueError."""
    w = _weights(2, 64, seed=1)
    _expect_value_error(quantize_groups, w, 3, 32, what="quantize_groups(w, bits=3) (only 4 or 8)")
    _expect_value_error(quantize_groups, w, 8, 48, what="quantize_groups(w [2, 64], bits=8, group_size=48) "
                                                        "(64 is not a multiple of 48)")
    _expect_value_error(quantize_groups, w, 8, 0, what="quantize_groups(w, bits=8, group_size=0)")


# ---------------------------------------------------------------- dequantize_groups


def test_dequantize_groups_is_exact():
    """Contract: element (n, k) is codes[n, k] * scale + min of its group k // G, in float32, exact."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (6, 96), generator=g, dtype=torch.uint8)
    scales = torch.rand(6, 3, generator=g) * 0.01
    mins = -torch.rand(6, 3, generator=g)
    want = codes.float().view(6, 3, 32) * scales[..., None] + mins[..., None]
    got = dequantize_groups(codes, scales, mins)
    adapters.expect((got.dtype, tuple(got.shape)), (torch.float32, (6, 96)),
                    "dequantize_groups(codes [6, 96], scales [6, 3], mins [6, 3]): (dtype, shape)")
    wrong = (got != want.view(6, 96))
    if bool(wrong.any()):
        n, k = divmod(int(wrong.flatten().int().argmax()), 96)
        pytest.fail(f"dequantize_groups: element [{n}, {k}] (group {k // 32}): expected "
                    f"{int(codes[n, k])} * {float(scales[n, k // 32]):.6g} + {float(mins[n, k // 32]):.6g} = "
                    f"{float(want.view(6, 96)[n, k])!r}, got {float(got[n, k])!r}", pytrace=False)


def test_dequantize_undoes_quantize():
    """Contract: every weight dequantizes to within scale / 2 of itself."""
    w = _weights(4, 64, seed=9)
    codes, scales, mins = quantize_groups(w, 8, group_size=32)
    back = dequantize_groups(codes, scales, mins)
    err = float(((back - w).abs() / scales.repeat_interleave(32, dim=1)).max())
    adapters.expect_that(err <= 0.5 + 1e-4, "dequantize_groups(quantize_groups(w, 8)) against w",
                         "within half a step of every weight", f"{err:.3f} steps")


def test_dequantize_groups_rejects_bad_shapes():
    """Contract: scales and mins of different shapes, another N, or K not a multiple of the groups -> ValueError."""
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    _expect_value_error(dequantize_groups, codes, torch.ones(4, 2), torch.ones(4, 3),
                        what="dequantize_groups(codes [4, 64], scales [4, 2], mins [4, 3])")
    _expect_value_error(dequantize_groups, codes, torch.ones(3, 2), torch.ones(3, 2),
                        what="dequantize_groups(codes [4, 64], scales [3, 2], mins [3, 2]) (another N)")
    _expect_value_error(dequantize_groups, codes, torch.ones(4, 3), torch.ones(4, 3),
                        what="dequantize_groups(codes [4, 64], scales [4, 3]) (64 columns do not make 3 groups)")


# ---------------------------------------------------------------- decode_floor_ms


@pytest.mark.parametrize("n,bits,G,bw,bytes_", [
    (135_000_000, 32, None, 25.0, 540_000_000),        # float32: 4 bytes a weight
    (135_000_000, 16, None, 25.0, 270_000_000),        # bfloat16
    (1_000_000, 8, 32, 10.0, 1_000_000 + 31_250 * 8),  # 8-bit codes + a scale and a min per 32
    (1_000_000, 4, 32, 10.0, 500_000 + 31_250 * 8),    # 4-bit: 6 bits a weight
    (100, 4, 32, 1.0, 50 + 4 * 8),                     # 100 weights: 4 groups, the last one partial
])
def test_decode_floor(n, bits, G, bw, bytes_):
    """Contract: bytes / (bandwidth_gbps * 1e9) in milliseconds; a group stores a float32 scale and minimum, and
    there are ceil(num_weights / group_size) groups."""
    want = bytes_ / (bw * 1e9) * 1e3
    got = decode_floor_ms(n, bits, G, bw)
    adapters.expect_that(isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9),
                         f"decode_floor_ms({n}, bits={bits}, group_size={G}, bandwidth_gbps={bw})",
                         f"{want!r} ms ({bytes_} bytes at {bw} GB/s)", got)


def test_decode_floor_rejects_bad_input():
    """Contract: num_weights < 1, bits not 4/8/16/32, group_size < 1 or bandwidth_gbps <= 0 -> ValueError."""
    for args in [(0, 8, 32, 10.0), (100, 5, 32, 10.0), (100, 8, 0, 10.0), (100, 8, 32, 0.0), (100, 8, 32, -1.0)]:
        _expect_value_error(decode_floor_ms, *args, what=f"decode_floor_ms{args}")


# ---------------------------------------------------------------- int8_gemv_triton (Triton interpreter)


def _gemv_case(M: int, N: int, K: int, G: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.uint8)
    scales = torch.rand(N, K // G, generator=g) * 0.01 + 1e-4
    mins = -torch.rand(N, K // G, generator=g) * 1.3
    w = codes.double().view(N, K // G, G) * scales.double()[..., None] + mins.double()[..., None]
    return x, codes, scales, mins, (x.double() @ w.view(N, K).T).float()


def test_int8_gemv_triton_reads_every_group_scale():
    """Contract: each weight reads the scale and minimum of its own group, k // group_size (here every
    group's scale differs by a factor of ten, so one per row or the wrong group shows)."""
    pytest.importorskip("triton")
    N, K, G = 8, 128, 32
    x = torch.ones(1, K)
    codes = torch.full((N, K), 2, dtype=torch.uint8)
    scales = torch.tensor([[1.0, 10.0, 100.0, 1000.0]] * N)
    mins = torch.tensor([[0.5, 0.0, -1.0, 0.0]] * N)
    want = G * (2 * (1 + 10 + 100 + 1000) + 0.5 - 1.0)
    got = int8_gemv_triton(x, codes, scales, mins, G)
    adapters.expect(got[0].tolist(), [want] * N, "int8_gemv_triton(x = ones [1, 128], every code 2, group scales "
                                                 "[1, 10, 100, 1000], mins [0.5, 0, -1, 0]): y[0]")


@pytest.mark.parametrize("M,N,K,G", [(1, 64, 64, 32), (1, 40, 128, 64), (2, 129, 576, 32), (3, 300, 256, 32)])
def test_int8_gemv_triton_matches_the_oracle(M, N, K, G):
    """Contract: y[m, n] = sum_k x[m, k] * (codes[n, k] * scale + min of its group), float32, within 1e-4 of the
    largest |y|, with N not a multiple of the block (the edges masked)."""
    pytest.importorskip("triton")
    x, codes, scales, mins, want = _gemv_case(M, N, K, G, seed=M * 1000 + N)
    what = f"int8_gemv_triton(x [{M}, {K}], codes [{N}, {K}], group_size={G})"
    got = int8_gemv_triton(x, codes, scales, mins, G)
    adapters.expect_that(isinstance(got, torch.Tensor), what, "a tensor", type(got).__name__)
    adapters.expect((got.dtype, tuple(got.shape)), (torch.float32, (M, N)), f"{what}: (dtype, shape)")
    err = (got - want).abs()
    tol = 1e-4 * float(want.abs().max())
    if float(err.max()) > tol:
        m, n = divmod(int(err.flatten().argmax()), N)
        pytest.fail(f"{what}: y[{m}, {n}]: expected {float(want[m, n]):.6g} (the dequantized weight times x, "
                    f"in float64), got {float(got[m, n]):.6g}; {int((err > tol).sum())} of {M * N} outputs off "
                    f"by more than {tol:.3g}", pytrace=False)


# ---------------------------------------------------------------- quiz


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """The chapter's questions: each answer as the question asks for it."""
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
