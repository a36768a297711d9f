import pytest
import torch
from kernel_cases import GPU_DTYPES, INTERP_DTYPES, RMS_GPU, RMS_INTERP

from minillm.kernels import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref


def test_rms_norm_ref_matches_formula():
    # The oracle itself (fp32 math) against the textbook formula in float64.
    x = torch.randn(5, 48)
    w = torch.randn(48)
    xd, wd = x.double(), w.double()
    expected = xd / torch.sqrt((xd * xd).sum(-1, keepdim=True) / 48 + 1e-5) * wd
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-5).double(), expected, **close)
    y, r = fused_add_rms_norm_ref(x, 2 * x, w, 1e-5)
    torch.testing.assert_close(r, x + 2 * x)
    torch.testing.assert_close(y.double(), ((3 * xd) / torch.sqrt((9 * xd * xd).mean(-1, keepdim=True) + 1e-5)) * wd,
                               **close)


def _check(T, D, dtype, device, tol, strided=False):
    g = torch.Generator().manual_seed(T * 1000 + D)
    width = D + 5 if strided else D
    # A strided view (row stride != D) stands in for a slice of a wider activation.
    x = torch.randn(T, width, generator=g).to(dtype).to(device)[:, :D]  # [T, D]
    res = torch.randn(T, D, generator=g).to(dtype).to(device)  # [T, D]
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(device)  # [D]

    torch.testing.assert_close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), **tol(dtype))
    y, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    y_ref, new_res_ref = fused_add_rms_norm_ref(x, res, w, 1e-6)
    torch.testing.assert_close(new_res, new_res_ref, atol=0, rtol=0)  # same single rounding
    torch.testing.assert_close(y, y_ref, **tol(dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("T,D,strided", RMS_INTERP)
def test_rms_norm_small(T, D, strided, dtype, device, tol):
    _check(T, D, dtype, device, tol, strided)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("T,D,strided", RMS_GPU)
def test_rms_norm_gpu(T, D, strided, dtype, device, tol):
    _check(T, D, dtype, device, tol, strided)
