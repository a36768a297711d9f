"""Write this step's keys and values into the paged KV cache.

What it computes
----------------
Every new token t has a "slot" in the cache: slot = block_id * block_size +
offset_in_block, chosen by the block manager. With the cache laid out as

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]  (contiguous)

a slot is simply a row index of the flattened view [num_blocks * block_size,
num_kv_heads, head_dim], so the kernel does

    k_cache.view(-1, Hkv, D)[slot_mapping[t]] = k[t]      (same for v)

A slot of -1 marks a padding token (e.g. a batch padded for a CUDA graph):
nothing is written for it.

Napkin math
-----------
Pure data movement: read 2*T*Hkv*D*e bytes, write the same. For the real model
(Hkv*D = 128 values per token) one token is only 2 * 2 * 128 * 2 B = 1 KiB, so a
decode step barely registers; a 8k-token prefill moves ~8 MiB.

Design: one program per token copies that token's [Hkv, D] tile for both K and
V. The source may be a strided view (e.g. a slice of a fused QKV projection)
as long as head_dim is contiguous; the cache must be contiguous.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, check, check_device, cuda_or_skip, next_pow2, report, require_triton, tl, triton

if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(
        k_ptr,  # [T, Hkv, D] new keys
        v_ptr,  # [T, Hkv, D] new values
        k_cache_ptr,  # [num_blocks * block_size, Hkv, D] flattened cache
        v_cache_ptr,
        slot_ptr,  # [T] int32/int64 destination rows, -1 = skip
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        H,
        D,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        # int64: slot * H * D overflows int32 once the cache passes 2**31 elements.
        slot = tl.load(slot_ptr + t).to(tl.int64)

        # Padding tokens (slot -1) write nothing. The branch is uniform across
        # the program, so it costs no divergence.
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
            d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
            mask = (h < H) & (d < D)  # [BLOCK_H, BLOCK_D] trims the power-of-two padding

            k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)  # [BLOCK_H, BLOCK_D]
            v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)  # [BLOCK_H, BLOCK_D]
            dst = slot * H * D + h * D + d  # contiguous cache row of this slot
            tl.store(k_cache_ptr + dst, k, mask=mask)
            tl.store(v_cache_ptr + dst, v, mask=mask)


def _check_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    name = "store_kv"
    check(k.dim() == 3, f"{name}: k must be [T, Hkv, D], got shape {tuple(k.shape)}")
    check(v.shape == k.shape, f"{name}: v shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    check(k_cache.dim() == 4, f"{name}: k_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape,
          f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    T, H, D = k.shape
    check(tuple(k_cache.shape[2:]) == (H, D),
          f"{name}: cache heads/head_dim {tuple(k_cache.shape[2:])} do not match k's (Hkv, D)=({H}, {D})")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), f"{name}: k_cache and v_cache must be contiguous")
    check(k.dtype == k_cache.dtype and v.dtype == v_cache.dtype,
          f"{name}: k/v dtype ({k.dtype}, {v.dtype}) must match the cache dtype ({k_cache.dtype}, {v_cache.dtype})")
    check(k.stride(2) == 1 and v.stride(2) == 1, f"{name}: k and v must be contiguous along head_dim")
    check(slot_mapping.dim() == 1 and slot_mapping.shape[0] == T,
          f"{name}: slot_mapping must be [T]={T}, got shape {tuple(slot_mapping.shape)}")
    check(slot_mapping.dtype in (torch.int32, torch.int64),
          f"{name}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    check(slot_mapping.is_contiguous(), f"{name}: slot_mapping must be contiguous")
    check_device(name, k, v, k_cache, v_cache, slot_mapping)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """In place: k_cache/v_cache at flattened row slot_mapping[t] <- k[t]/v[t]; slot -1 is skipped."""
    require_triton("store_kv")
    _check_inputs(k, v, k_cache, v_cache, slot_mapping)
    T, H, D = k.shape
    if T == 0:
        return
    _store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H, D,
        BLOCK_H=next_pow2(H),
        BLOCK_D=next_pow2(D),
        num_warps=1 if H * D <= 256 else 4,  # a token is tiny; one warp covers 128 values in a go
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    padded: bool = True,
) -> None:
    """Plain-PyTorch version with the same in-place semantics; the KV write of the torch and
    cpu attention backends too (``attention.write_kv``).

    ``padded``: slot_mapping may hold -1 (a padding token, nothing written), as the kernel
    allows. The backends' steps are never padded (only the Triton backend's CUDA graphs pad)
    and pass False: no mask, so no read of a device tensor (a boolean index waits for the GPU)
    and no copy of k and v.
    """
    H, D = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()  # [T]
    if padded:
        keep = slots >= 0  # [T] drop padding tokens
        slots, k, v = slots[keep], k[keep], v[keep]  # [T'], [T', H, D]
    k_cache.view(-1, H, D).index_copy_(0, slots, k)
    v_cache.view(-1, H, D).index_copy_(0, slots, v)


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cuda_or_skip("store_kv"):
        return
    from triton.testing import do_bench

    H, D, block_size, num_blocks = 2, 64, 16, 8192
    e = torch.tensor([], dtype=dtype).element_size()
    k_cache = torch.zeros(num_blocks, block_size, H, D, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for T in [64, 2048, 16384]:
        k = torch.randn(T, H, D, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(num_blocks * block_size, device="cuda")[:T].to(torch.int32)
        ms = do_bench(lambda: store_kv(k, v, k_cache, v_cache, slots))
        report(f"store_kv T={T} Hkv={H} D={D} {dtype}", ms, 4 * T * H * D * e + 4 * T)


if __name__ == "__main__":
    bench()
