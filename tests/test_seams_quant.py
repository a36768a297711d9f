"""Chapter 11's seams: a learner's group quantizer, dequantizer and 8-bit GEMV inside
``QuantizedLinear`` (the engine's quantized layers).

The reference answers plugged in give the library's layer exactly (codes, scales, mins,
outputs); wrong ones are caught: a different rounding changes the codes, a bad return is a
ValueError that says what came back, and the plugged functions are really the ones called.
"""
from __future__ import annotations

import pytest
import torch

from minillm import seams
from minillm.quantization import QuantizedLinear
from solutions import ch11_quantized_weights as ref


def _w(n=64, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _x(m=3, k=96, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", ["int8_group", "q4_group"])
def test_reference_quantizer_builds_the_librarys_layer(fmt):
    lib = QuantizedLinear(_w(), fmt)
    with seams.plug(quantize_groups=ref.quantize_groups):
        mine = QuantizedLinear(_w(), fmt)
    for name in ("qweight", "scales", "mins"):
        assert torch.equal(getattr(mine, name), getattr(lib, name)), name
    assert torch.equal(mine(_x()), lib(_x()))


def test_a_wrong_rounding_changes_the_codes():
    calls = []

    def floor_quantizer(weight, bits, group_size):  # floor in place of round: codes half a step low
        calls.append((tuple(weight.shape), bits, group_size))
        N, K = weight.shape
        g = weight.reshape(N, K // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / (2 ** bits - 1)
        codes = torch.floor((g - lo[..., None]) / scale[..., None]).clamp(0, 2 ** bits - 1)
        return codes.reshape(N, K).to(torch.uint8), scale, lo

    lib = QuantizedLinear(_w(), "int8_group")
    with seams.plug(quantize_groups=floor_quantizer):
        mine = QuantizedLinear(_w(), "int8_group")
    assert calls == [((64, 96), 8, 32)]
    assert not torch.equal(mine.qweight, lib.qweight)


def test_the_symmetric_head_keeps_the_librarys_quantizer():
    def boom(*a):
        raise AssertionError("a symmetric layer (the LM head) must not call the plugged quantizer")

    with seams.plug(quantize_groups=boom):
        QuantizedLinear(_w(), "int8_group", symmetric=True)


@pytest.mark.parametrize("bad,match", [
    (lambda w, b, g: (w, w, w), "codes must be torch.uint8"),
    (lambda w, b, g: [0, 1, 2], r"must return \(codes, scales, mins\)"),
    (lambda w, b, g: ref.quantize_groups(w, b, g)[:2] + (torch.zeros(3),), r"mins must be torch.float32 \[64, 3\]"),
    (lambda w, b, g: (torch.full(w.shape, 16, dtype=torch.uint8),) + ref.quantize_groups(w, b, g)[1:],
     "4-bit codes must be <= 15"),
])
def test_a_bad_quantizer_is_a_clear_error(bad, match):
    with seams.plug(quantize_groups=bad), pytest.raises(ValueError, match=match):
        QuantizedLinear(_w(), "q4_group")


@pytest.mark.parametrize("fmt", ["int8_group", "q4_group"])
def test_plugged_dequantizer_serves_the_layer(fmt):
    layer = QuantizedLinear(_w(), fmt)
    calls = []

    def spy(codes, scales, mins):
        calls.append((codes.dtype, tuple(codes.shape)))
        return ref.dequantize_groups(codes, scales, mins)

    with seams.plug(dequantize_groups=spy):
        y = layer(_x())
    assert calls == [(torch.uint8, (64, 96))]  # 4-bit codes arrive unpacked, one a byte
    torch.testing.assert_close(y, layer.forward_reference(_x()), rtol=1e-5, atol=1e-5)


def test_plugged_gemv_serves_only_the_8bit_layers():
    calls = []

    def spy(x, codes, scales, mins, group_size):
        calls.append((tuple(x.shape), tuple(codes.shape), group_size))
        return torch.nn.functional.linear(x, ref.dequantize_groups(codes, scales, mins))

    with seams.plug(int8_gemv_triton=spy):
        y8 = QuantizedLinear(_w(), "int8_group")(_x().reshape(1, 3, 96))
        QuantizedLinear(_w(), "q4_group")(_x())
    assert calls == [((3, 96), (64, 96), 32)]
    assert y8.shape == (1, 3, 64)


def test_a_plugged_dequantizer_or_gemv_of_the_wrong_dtype_or_shape_stops_the_layer():
    layer = QuantizedLinear(_w(), "int8_group")
    in_float64 = lambda codes, scales, mins: ref.dequantize_groups(codes, scales, mins).double()  # noqa: E731
    with seams.plug(dequantize_groups=in_float64), \
            pytest.raises(seams.SeamContractError, match=r"the weight is float32 \[64, 96\]: torch.float64"):
        layer(_x())
    one_row = lambda x, codes, scales, mins, group_size: torch.zeros(1, codes.shape[0])  # noqa: E731
    with seams.plug(int8_gemv_triton=one_row), pytest.raises(seams.SeamContractError, match=r"y is float32 \[3, 64\]"):
        layer(_x())


def test_a_quantizer_with_nan_scales_stops_the_layer():
    def nan_scales(w, b, g):
        codes, scales, mins = ref.quantize_groups(w, b, g)
        return codes, torch.full_like(scales, float("nan")), mins

    with seams.plug(quantize_groups=nan_scales), pytest.raises(seams.SeamContractError, match="finite"):
        QuantizedLinear(_w(), "q4_group")
