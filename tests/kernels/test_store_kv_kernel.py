import pytest
import torch
from kernel_cases import GPU_DTYPES, STORE_KV_GPU_T, STORE_KV_INTERP

from minillm.kernels import store_kv, store_kv_ref


def _check(T, H, D, block_size, num_blocks, dtype, slot_dtype, device, pad_every=3):
    g = torch.Generator().manual_seed(T + H + D)
    # Source K/V as slices of one fused QKV-like buffer: strided rows, contiguous head_dim.
    qkv = torch.randn(T, 3 * H, D, generator=g).to(dtype).to(device)  # [T, 3H, D]
    k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]  # [T, H, D] views
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[::pad_every] = -1  # padding tokens must leave the cache untouched
    slots = slots.to(slot_dtype).to(device)

    base = torch.randn(num_blocks, block_size, H, D, generator=g).to(dtype).to(device)
    k_cache, v_cache = base.clone(), (-base).clone()
    k_ref, v_ref = base.clone(), (-base).clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    # A copy is exact: compare bit for bit, including untouched slots.
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)
    # And the oracle really wrote what it should.
    flat = k_ref.view(-1, H, D)
    keep = slots >= 0
    assert torch.equal(flat[slots[keep].long()], k[keep])


def test_store_kv_ref_skips_padding():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.ones(3, 1, 2)
    store_kv_ref(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 2).sum(-1).tolist() == [2, 0, 0, 0, 0, 2, 0, 0]
    assert v_cache.view(-1, 2).sum(-1).tolist() == [4, 0, 0, 0, 0, 4, 0, 0]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype,slot_dtype,H,D", STORE_KV_INTERP)
def test_store_kv_small(dtype, slot_dtype, H, D, device):
    _check(T=9, H=H, D=D, block_size=8, num_blocks=4, dtype=dtype, slot_dtype=slot_dtype, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("T", STORE_KV_GPU_T)
def test_store_kv_gpu(T, dtype, device):
    _check(T=T, H=2, D=64, block_size=16, num_blocks=1024, dtype=dtype, slot_dtype=torch.int32, device=device)
