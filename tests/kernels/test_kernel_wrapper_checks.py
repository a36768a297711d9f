"""The host wrappers must reject bad inputs with a message that names the problem.

All checks run before any kernel launch, so these tests are fast everywhere.
"""

import pytest
import torch

from minillm.kernels import HAS_TRITON, paged_decode_attention, paged_prefill_attention, rms_norm, store_kv

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _decode_inputs(device, Hq=4, Hkv=2, D=32):
    k_cache = torch.zeros(4, 8, Hkv, D, device=device)
    return dict(
        q=torch.zeros(2, Hq, D, device=device),
        k_cache=k_cache,
        v_cache=torch.zeros_like(k_cache),
        block_tables=torch.zeros(2, 2, dtype=torch.int32, device=device),
        context_lens=torch.ones(2, dtype=torch.int32, device=device),
        scale=1.0,
    )


def test_decode_rejects_int64_block_tables(device):
    args = _decode_inputs(device)
    args["block_tables"] = args["block_tables"].long()
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_decode_attention(**args)


def test_decode_rejects_mismatched_heads(device):
    args = _decode_inputs(device, Hq=3, Hkv=2)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of kv heads \(2\)"):
        paged_decode_attention(**args)


def test_decode_rejects_dtype_mismatch(device):
    args = _decode_inputs(device)
    args["q"] = args["q"].half()
    with pytest.raises(ValueError, match="must share a dtype"):
        paged_decode_attention(**args)


def test_prefill_rejects_bad_query_start_loc(device):
    args = _decode_inputs(device)
    args["query_start_loc"] = torch.tensor([0, 1], dtype=torch.int32, device=device)  # needs B+1 = 3
    with pytest.raises(ValueError, match=r"query_start_loc must be \[B\+1\]=3"):
        paged_prefill_attention(**args)


def test_store_kv_rejects_head_mismatch(device):
    k = torch.zeros(3, 2, 32, device=device)
    cache = torch.zeros(4, 8, 1, 32, device=device)
    with pytest.raises(ValueError, match="cache heads/head_dim"):
        store_kv(k, k, cache, cache.clone(), torch.zeros(3, dtype=torch.int32, device=device))


def test_rms_norm_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match=r"weight must be \[D\]=16"):
        rms_norm(torch.zeros(2, 16, device=device), torch.zeros(8, device=device))
