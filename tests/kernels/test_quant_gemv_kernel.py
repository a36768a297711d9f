"""u8_gemv and q4_gemv (kernels/quant_gemv.py): x @ w.T with w in minillm.quantization's
int8_group / q4_group formats, against the float64 oracles; the 4-bit nibble order against
kernels/cpu/quant.py's q4_pack; the wrappers' input checks."""

import functools
import importlib

import pytest
import torch
from kernel_cases import INTERP_DTYPES, QUANT_BF16, QUANT_GPU, QUANT_GPU_DTYPES, QUANT_GPU_TILING, QUANT_INTERP

from minillm.kernels import H100, HAS_TRITON, q4_gemv, q4_gemv_ref, u8_gemv, u8_gemv_ref
from minillm.kernels.cpu.quant import q4_linear_ref, q4_pack, u8_linear_ref
from minillm.quantization import QuantizedLinear, quantize_groups

qmod = importlib.import_module("minillm.kernels.quant_gemv")  # the module (for monkeypatching its tiles)


def _quantized(N, K, G, bits, seed=0, device="cpu"):
    """(w as the kernel takes it: codes or packed nibbles, the codes unpacked, scales, mins):
    a random weight of about a real model's scale, quantized by minillm.quantization."""
    return tuple(t.to(device) for t in _quantized_cpu(N, K, G, bits, seed))


@functools.lru_cache(maxsize=8)
def _quantized_cpu(N, K, G, bits, seed):
    w = 0.05 * torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    codes, scales, mins = quantize_groups(w, bits, G)
    return (codes if bits == 8 else q4_pack(codes)), codes, scales, mins


def _x(M, K, dtype, device, seed=1):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def _check(M, N, K, G, dtype, device, tol):
    x = _x(M, K, dtype, device, seed=M + N + K)
    for bits, fn, ref in ((8, u8_gemv, u8_gemv_ref), (4, q4_gemv, q4_gemv_ref)):
        w, codes, scales, mins = _quantized(N, K, G, bits, seed=N * K + bits, device=device)
        y = fn(x, w, scales, mins, G)
        assert y.shape == (M, N) and y.dtype == dtype and y.device == x.device
        torch.testing.assert_close(y, ref(x, w, scales, mins, G), **tol(dtype))
        # The 4-bit path must equal the 8-bit one on the same (unpacked) codes.
        torch.testing.assert_close(y, u8_gemv_ref(x, codes, scales, mins, G), **tol(dtype))


def test_oracles_match_the_cpu_oracles():
    x = torch.randn(3, 96)
    for bits, ref, cpu_ref in ((8, u8_gemv_ref, u8_linear_ref), (4, q4_gemv_ref, q4_linear_ref)):
        w, _, scales, mins = _quantized(40, 96, 32, bits)
        torch.testing.assert_close(ref(x, w, scales, mins, 32), cpu_ref(x, w, scales, mins, 32), atol=0, rtol=0)
    # In x's dtype.
    w, _, scales, mins = _quantized(40, 96, 32, 8)
    assert u8_gemv_ref(x.half(), w, scales, mins, 32).dtype == torch.float16


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("M,N,K,G", QUANT_INTERP)
def test_quant_gemv_small(M, N, K, G, dtype, device, tol):
    _check(M, N, K, G, dtype, device, tol)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the prefill tile depends on the dtype
@pytest.mark.parametrize("M,N,K", QUANT_GPU_TILING)
def test_quant_gemv_gpu_tiling(M, N, K, dtype, monkeypatch, device, tol):
    # The GPU's tiles (16 or 64 rows of x, 64 rows of w), even in the interpreter: M and N
    # cross tile edges.
    real = qmod._pick_config
    monkeypatch.setattr(qmod, "_pick_config", lambda m, n, dt, gpu: real(m, n, dt, H100))
    _check(M, N, K, 32, dtype, device, tol)


@pytest.mark.interpreter
def test_quant_gemv_bf16(device, tol):
    # The interpreter's tl.dot cannot multiply bf16 (it holds the raw bits); the wrapper
    # runs the fp32 kernel there instead. On a GPU: the bf16 kernel.
    _check(*QUANT_BF16, torch.bfloat16, device, tol)


@pytest.mark.interpreter
def test_q4_nibble_order(device):
    """Element 2j is byte j's low nibble, 2j + 1 its high one (kernels/cpu/quant.q4_pack):
    x = e_k picks column k of the dequantized weight, which must be code k's."""
    N, K, G = 5, 32, 32
    codes = torch.arange(N * K).reshape(N, K).remainder(16).to(torch.uint8)
    codes[:, 1] = 15 - codes[:, 0]  # elements 0 and 1 of byte 0 differ in every row
    packed = q4_pack(codes)
    scales = torch.full((N, 1), 0.5)
    mins = torch.full((N, 1), -1.0)
    x = torch.eye(K)[[0, 1, 2, 31]]  # [4, K]: columns 0, 1 (byte 0), 2 (byte 1), 31 (last high nibble)
    y = q4_gemv(x.to(device), packed.to(device), scales.to(device), mins.to(device), G).cpu()
    expected = codes[:, [0, 1, 2, 31]].T.float() * 0.5 - 1.0  # [4, N]
    assert torch.equal(y, expected)


@pytest.mark.interpreter
def test_matches_the_quantized_layer(device):
    """The model's QuantizedLinear (int8_group and q4_group, and the head's symmetric
    int8_group): the kernel computes its forward_reference."""
    w = 0.05 * torch.randn(48, 64, generator=torch.Generator().manual_seed(3))
    x = torch.randn(3, 64)
    for fmt, symmetric, fn in (("int8_group", False, u8_gemv), ("int8_group", True, u8_gemv),
                               ("q4_group", False, q4_gemv)):
        layer = QuantizedLinear(w, fmt, symmetric=symmetric)
        y = fn(x.to(device), layer.qweight.to(device), layer.scales.to(device), layer.mins.to(device), 32)
        torch.testing.assert_close(y.cpu(), layer.forward_reference(x), atol=2e-5, rtol=2e-5)


@pytest.mark.interpreter
def test_empty_batch(device):
    w, _, scales, mins = _quantized(8, 32, 32, 8, device=device)
    y = u8_gemv(torch.empty(0, 32, device=device), w, scales, mins)
    assert y.shape == (0, 8)


# ----------------------------------------------------------------------------
# Input checks: before any launch, so they run everywhere (triton installed)
# ----------------------------------------------------------------------------


def _args(bits=8, M=2, N=4, K=64, G=32):
    w, _, scales, mins = _quantized(N, K, G, bits)
    return dict(x=torch.randn(M, K), w=w, scales=scales, mins=mins, G=G)


_REJECTS = [
    # (format, what to change, the message)
    (8, dict(x=torch.randn(2, 1, 64)), r"u8_gemv: x must be \[M, K\]"),
    (8, dict(x=torch.ones(2, 64, dtype=torch.int32)), "x must be fp16/bf16/fp32"),
    (8, dict(x=torch.randn(64, 2).T), "x must be contiguous"),
    (8, dict(G=24), "group_size must be a power of two from 16 to 128"),
    (8, dict(G=256), "group_size must be a power of two from 16 to 128"),
    (8, dict(x=torch.randn(2, 48)), r"K = 48 \(x's columns\) must be a multiple of group_size = 32"),
    (4, dict(x=torch.randn(2, 33)), r"q4_gemv: K = 33 .* must be even"),
    (8, dict(w=torch.zeros(4, 64, dtype=torch.int8)), "codes must be torch.uint8"),
    (8, dict(w=torch.zeros(4, 32, dtype=torch.uint8)), r"codes must be \[N, K\] = \[N, 64\]"),
    (4, dict(w=torch.zeros(4, 64, dtype=torch.uint8)), r"packed must be \[N, K // 2\] = \[N, 32\]"),
    (8, dict(w=torch.zeros(4, 128, dtype=torch.uint8)[:, ::2]), "codes must be contiguous"),
    (8, dict(scales=torch.ones(4, 1)), r"scales must be \[N, K // group_size\] = \[4, 2\]"),
    (4, dict(mins=torch.zeros(4, 2, dtype=torch.float16)), "mins must be torch.float32"),
    (8, dict(mins=torch.zeros(4, 2, device="meta")), "all tensors must be on the same device"),
]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("bits,change,message", _REJECTS, ids=[f"{'u8' if b == 8 else 'q4'}-{'-'.join(c)}-{i}"
                                                               for i, (b, c, _) in enumerate(_REJECTS)])
def test_rejects_bad_inputs(bits, change, message):
    a = {**_args(bits), **change}
    fn = u8_gemv if bits == 8 else q4_gemv
    with pytest.raises(ValueError, match=message):
        fn(a["x"], a["w"], a["scales"], a["mins"], a["G"])


# ----------------------------------------------------------------------------
# GPU: the real shapes, compiled
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", QUANT_GPU_DTYPES)
@pytest.mark.parametrize("M,N,K,G", QUANT_GPU)
def test_quant_gemv_gpu(M, N, K, G, dtype, device, tol):
    _check(M, N, K, G, dtype, device, tol)


# ----------------------------------------------------------------------------
# Warm-up: the quantized GEMVs only for a quantized model
# ----------------------------------------------------------------------------


def test_warmup_adds_quantized_gemvs_only_when_asked():
    from minillm.config import ModelConfig
    from minillm.kernels import warmup
    from minillm.kernels.warmup import engine_launches, quant_launches

    cfg = ModelConfig()  # SmolLM2-135M
    plain = engine_launches(cfg, torch.bfloat16, 16, max_num_seqs=8, max_model_len=256)
    assert not [launch for launch in plain if "_group" in launch.label]
    for scheme, fmt in (("int8", "int8_group"), ("q4", "q4_group")):
        quant = engine_launches(cfg, torch.bfloat16, 16, max_num_seqs=8, max_model_len=256, quantization=scheme)
        assert [launch.label for launch in quant[:len(plain)]] == [launch.label for launch in plain]
        added = [launch.label for launch in quant[len(plain):]]
        assert added == [launch.label for launch in quant_launches(cfg, torch.bfloat16, scheme, max_num_seqs=8)]
        # Every projection at 1 row (the decode tile) and at 17 (the prefill tile); the head in int8_group.
        d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        for name, n, k in (("qkv_proj", 960, d), ("o_proj", d, 576), ("gate_up_proj", 2 * f, d),
                           ("down_proj", d, f)):
            for m in (1, 17):
                assert f"{name} {fmt} M={m} N={n} K={k}" in added, added
        assert f"lm_head int8_group M=1 N={v} K={d}" in added, added
    with pytest.raises(ValueError, match="quantization must be None or one of 'int8', 'q4'"):
        warmup(cfg, torch.bfloat16, 16, "cpu", quantization="int4")
