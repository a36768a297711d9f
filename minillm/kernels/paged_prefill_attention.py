"""Paged prefill attention: causal attention of a batch of new query tokens
(variable length per sequence) over the paged KV cache.

What it computes
----------------
The batch packs the new tokens of B sequences back to back:

    q               [T, Hq, D]     T = total new tokens of the step
    query_start_loc [B + 1] int32  sequence b owns q rows query_start_loc[b] : query_start_loc[b+1]
    context_lens    [B] int32      cached tokens of b, *including* this step's (already stored)
    k_cache         [num_blocks, block_size, Hkv, D]   (v_cache the same)
    block_tables    [B, max_blocks_per_seq] int32
    out             [T, Hq, D]

Sequence b has q_len = query_start_loc[b+1] - query_start_loc[b] new tokens; they
are the *last* q_len tokens of its context, so query j sits at absolute position

    pos_j = context_lens[b] - q_len + j

and attends every cached key at positions 0 .. pos_j (causal). The offset makes
one kernel serve a plain prefill (q_len == context_len), a later chunk of a
chunked prefill, speculative verification of k+1 tokens, and plain decode
(q_len == 1). Sequences with q_len == 0 are simply skipped.

Candidate trees (Medusa-style verification, ``minillm.spec_decode.tree``): the nodes of
a tree are fed as the queries of one sequence after its root, and a node may only see
its ancestors (and itself) among them. Optional per-query ``tree_start`` [T] int32 and
``tree_bits`` [T] int64 add one term to the mask: query t sees key j only if, besides
the causal rule, j < tree_start[t] or bit j - tree_start[t] of tree_bits[t] is set
(``tree_key_mask`` in paged_decode_attention.py). Queries outside any tree pass
tree_start[t] >= their position + 1, so one launch mixes trees with plain chunks.

Napkin math
-----------
Unlike decode, prefill reuses every K/V tile for BLOCK_M query rows, so each
K/V element loaded feeds 2 * BLOCK_M flops and long prompts become compute
bound: flops ~ 4 * sum_b(q_len * (context_len - q_len/2)) * Hq * D. The
minimum traffic is q + out (2 * T * Hq * D * e) plus the K/V each query tile
reads; the bench prints that lower bound's GB/s plus achieved TFLOP/s.

Design
------
* Grid (query tiles, query heads, sequences). A program owns BLOCK_M consecutive
  query rows of one sequence and one head, and streams that sequence's keys in
  tiles of BLOCK_N through the block table, with the same online softmax as the
  decode kernel. Programs whose tile starts past q_len exit at once; the grid's
  first axis is sized by max_query_len.
* The key loop stops at the last key position any row of the tile may see
  (causal), so a tile early in the chunk does not read keys beyond it.
* GQA is handled by indexing: query head h reads kv head h // (Hq // Hkv). The
  group's programs read the same K/V tiles; they mostly come from L2. (Packing
  the group into the M dimension, as the decode kernel does, would save that L2
  traffic at the price of more index arithmetic.)
* One masked loop handles everything: positions past the context and keys after
  each query's own position get -inf. Splitting off the fully-visible tiles into
  a mask-free loop would be a further speed-up.
* The tile depends on the dtype (_pick_config): 64x64 for bf16/fp16 on tensor
  cores; 32x32 over 8 warps for fp32, whose FMA dot keeps every operand in
  registers and would spill with the larger tile.
* The tree mask is a constexpr branch (HAS_TREE): without tree arguments the kernel
  is exactly the plain causal one (the tree pointers are None, nothing extra is
  loaded); with them each row loads its tree_start and bits once, and every tile
  adds a shift-and-test to its mask. Tiles and the key loop are the same.
* Two compiled binaries per model and dtype, plain and tree: the block-table width
  and the block size are runtime integers that Triton never specialises on (see
  "Compiled variants" in paged_decode_attention.py).
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    GpuSpec,
    check,
    check_device,
    cuda_or_skip,
    planning_gpu,
    report,
    require_triton,
    tl,
    triton,
)
from .paged_decode_attention import _check_inputs as _check_decode_inputs
from .paged_decode_attention import paged_attention_ref

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    # The block-table width changes from step to step and the block size from
    # engine to engine: never specialise on them (see "Compiled variants" in
    # paged_decode_attention.py). One binary per model and dtype (two: HAS_TREE or not).
    @triton.jit(do_not_specialize=["stride_bt", "BLOCK_SIZE"])
    def _paged_prefill_kernel(
        q_ptr,  # [T, Hq, D]
        k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
        v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
        block_tables_ptr,  # [B, max_blocks_per_seq] int32
        query_start_loc_ptr,  # [B + 1] int32
        context_lens_ptr,  # [B] int32
        tree_start_ptr,  # [T] int32 (HAS_TREE; else None)
        tree_bits_ptr,  # [T] int64 (HAS_TREE; else None)
        out_ptr,  # [T, Hq, D]
        qk_scale,  # softmax scale * log2(e)
        stride_qt,
        stride_qh,
        stride_ot,
        stride_oh,
        stride_bt,  # block-table row stride (its width): runtime
        BLOCK_SIZE,  # tokens per cache block: runtime (upper case: a size, but not a constexpr)
        Hkv,
        GROUP: tl.constexpr,  # query heads per kv head
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,  # query rows per program
        BLOCK_N: tl.constexpr,  # keys per tile
        HAS_TREE: tl.constexpr,  # candidate-tree mask on top of the causal one
    ):
        tile = tl.program_id(0)
        h = tl.program_id(1)
        b = tl.program_id(2)

        q_first = tl.load(query_start_loc_ptr + b)
        q_len = tl.load(query_start_loc_ptr + b + 1) - q_first
        m_start = tile * BLOCK_M
        if m_start >= q_len:
            # The grid is sized for the longest sequence; shorter ones (and q_len == 0) stop here.
            return

        ctx = tl.load(context_lens_ptr + b)
        kvh = h // GROUP
        rows = m_start + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index within the sequence
        row_valid = rows < q_len
        q_pos = ctx - q_len + rows  # [BLOCK_M] absolute positions of the queries
        d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
        n = tl.arange(0, BLOCK_N)  # [BLOCK_N]

        tok = (q_first + rows).to(tl.int64)  # [BLOCK_M] row in the packed batch
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=row_valid[:, None],
            other=0.0,
        )  # [BLOCK_M, HEAD_DIM]
        if HAS_TREE:
            # Per query row: where its tree region starts and which keys of it it sees.
            t_start = tl.load(tree_start_ptr + tok, mask=row_valid, other=0)  # [BLOCK_M] int32
            t_bits = tl.load(tree_bits_ptr + tok, mask=row_valid, other=0)  # [BLOCK_M] int64

        # Causality bounds the keys the whole tile needs: up to the position of
        # its last valid row (never beyond the context, even for bad inputs).
        kv_end = tl.minimum(ctx, ctx - q_len + tl.minimum(m_start + BLOCK_M, q_len))

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # running max, finite (see decode kernel)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running denominator
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)  # running numerator

        row_stride = Hkv * HEAD_DIM  # elements between consecutive cache slots
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for tile_start in range(0, kv_end, BLOCK_N):
            pos = tile_start + n  # [BLOCK_N] key positions
            kv_valid = pos < kv_end
            phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)  # [BLOCK_N]
            kv_off = (phys * BLOCK_SIZE + pos % BLOCK_SIZE) * row_stride + kvh * HEAD_DIM  # [BLOCK_N]

            # K^T as a [HEAD_DIM, BLOCK_N] tile for q @ K^T.
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=kv_valid[None, :], other=0.0)
            s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = kv_valid[None, :] & (pos[None, :] <= q_pos[:, None])  # causal + in range
            if HAS_TREE:
                # Key j is before the query's tree region, or bit j - tree_start of its set.
                # Arithmetic (sign-extending) shift of the int64 bits, then & 1: bit 63 reads
                # right too. The shift is clamped to 0..63; outside that the bit is not used.
                off = pos[None, :] - t_start[:, None]  # [BLOCK_M, BLOCK_N] int32
                shift = tl.minimum(tl.maximum(off, 0), 63).to(tl.int64)
                bit = (t_bits[:, None] >> shift) & 1  # [BLOCK_M, BLOCK_N] int64
                visible = visible & ((off < 0) | ((off < 64) & (bit != 0)))
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_M]
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)

            # V in natural [BLOCK_N, HEAD_DIM] layout for p @ V.
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        # A valid query always sees at least key 0 (a tree region starts after its root);
        # the guard only protects padding rows.
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )


def _pick_config(head_dim: int, dtype: torch.dtype, gpu: GpuSpec | None) -> dict:
    """Tile sizes for a GPU (None: the CPU interpreter). Tests may monkeypatch this."""
    if gpu is None:
        # Interpreter: small tiles so short test prompts span several tiles.
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        # fp32 has no tensor-core path here (input_precision="ieee"): tl.dot becomes
        # FMA loops whose operands all sit in registers. The 64x64 tile then needs
        # more than the 255 registers a thread may have and spills (sm_80: ~16 KB of
        # local-memory traffic per thread). A 32x32 tile over 8 warps needs 48-80
        # registers for head_dim 32..128 on sm_80 and sm_90, with no spills, under
        # Triton 3.6 and 3.9 alike (python tools/aot_audit.py checks it).
        return dict(BLOCK_M=32, BLOCK_N=32, num_warps=8, num_stages=2)
    # bf16/fp16: tensor cores (mma.sync on sm_80, wgmma on sm_90) keep the 64-row
    # tile in 140-240 registers; K and V tiles double-buffered in shared memory
    # (24-49 KB, python tools/aot_audit.py).
    if head_dim <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[T, Hq, D]: varlen causal attention of the packed new tokens over the paged cache.

    max_query_len sizes the grid; pass it from the host-side batch metadata.
    If None it is computed from query_start_loc, which costs a device sync.
    Rows of q past query_start_loc[B] belong to no sequence; their output is undefined.

    Candidate trees: ``tree_start`` [T] int32 and ``tree_bits`` [T] int64, both or neither,
    one per query token. Query t then also needs, for key position j, j < tree_start[t] or
    bit j - tree_start[t] of tree_bits[t] set (bit 63 is the int64 sign bit); keys 64 or
    more past tree_start[t] are masked. A query outside any tree passes tree_start[t] >= its
    position + 1. The oracle is paged_attention_ref(..., tree_start=, tree_bits=).
    Without them the kernel is the plain causal one (HAS_TREE=False: no extra loads).
    """
    name = "paged_prefill_attention"
    require_triton(name)
    check(context_lens.dim() == 1, f"{name}: context_lens must be [B], got shape {tuple(context_lens.shape)}")
    B = context_lens.shape[0]
    # Everything shared with decode (caches, heads, dtypes, block table) is checked there.
    _check_decode_inputs(q, k_cache, v_cache, block_tables, context_lens, name=name, batch=B)
    check(query_start_loc.dim() == 1 and query_start_loc.shape[0] == B + 1,
          f"{name}: query_start_loc must be [B+1]={B + 1}, got shape {tuple(query_start_loc.shape)}")
    check(query_start_loc.dtype == torch.int32, f"{name}: query_start_loc must be int32, got {query_start_loc.dtype}")
    check(query_start_loc.is_contiguous(), f"{name}: query_start_loc must be contiguous")
    check_device(name, q, query_start_loc)
    T = q.shape[0]
    has_tree = tree_start is not None or tree_bits is not None
    if has_tree:
        check(tree_start is not None and tree_bits is not None,
              f"{name}: pass tree_start and tree_bits together (got only "
              f"{'tree_start' if tree_bits is None else 'tree_bits'})")
        for label, t, dtype in (("tree_start", tree_start, torch.int32), ("tree_bits", tree_bits, torch.int64)):
            check(t.dim() == 1 and t.shape[0] == T, f"{name}: {label} must be [T]={T}, got shape {tuple(t.shape)}")
            check(t.dtype == dtype, f"{name}: {label} must be {str(dtype).removeprefix('torch.')}, got {t.dtype}")
            check(t.is_contiguous(), f"{name}: {label} must be contiguous")
        check_device(name, q, tree_start, tree_bits)

    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty(T, Hq, D, device=q.device, dtype=q.dtype)  # [T, Hq, D]
    if T == 0 or B == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())  # syncs with the device
    check(0 <= int(max_query_len) <= T, f"{name}: max_query_len={max_query_len} must lie in [0, T={T}]")
    if max_query_len == 0:
        return out

    cfg = _pick_config(D, q.dtype, planning_gpu(q.device))
    grid = (triton.cdiv(int(max_query_len), cfg["BLOCK_M"]), Hq, B)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        tree_start, tree_bits,  # None without a tree: constexpr None, nothing is loaded
        out,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        block_size,
        Hkv,
        GROUP=Hq // Hkv,
        HEAD_DIM=D,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        HAS_TREE=has_tree,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


# ----------------------------------------------------------------------------
# Oracle: per sequence, gather dense K/V through the block table and apply an
# explicit causal mask shifted by the context offset. One body serves both kernels:
# paged_decode_attention.paged_attention_ref (a decode row is a query of its own).
# ----------------------------------------------------------------------------

paged_prefill_attention_ref = paged_attention_ref


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cuda_or_skip("paged_prefill_attention"):
        return
    from triton.testing import do_bench

    Hq, Hkv, D, block_size = 16, 2, 64, 16
    e = torch.tensor([], dtype=dtype).element_size()
    for B, q_len, ctx in [(1, 8192, 8192), (4, 2048, 2048), (8, 512, 4096), (32, 5, 1024)]:
        blocks_per_seq = ctx // block_size
        num_blocks = B * blocks_per_seq
        k_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(B, blocks_per_seq)
        context_lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
        qsl = torch.arange(0, (B + 1) * q_len, q_len, device="cuda", dtype=torch.int32)
        q = torch.randn(B * q_len, Hq, D, device="cuda", dtype=dtype)
        ms = do_bench(lambda: paged_prefill_attention(q, k_cache, v_cache, block_tables, qsl, context_lens,
                                                      D ** -0.5, max_query_len=q_len))
        # Lower bound on traffic: q, out, and each sequence's K/V read once.
        nbytes = 2 * B * q_len * Hq * D * e + 2 * B * ctx * Hkv * D * e
        flops = 4 * B * q_len * (ctx - q_len / 2) * Hq * D
        report(f"prefill B={B} q_len={q_len} ctx={ctx}", ms, nbytes)
        print(f"{'':<48s} {flops / (ms * 1e-3) / 1e12:9.1f} TFLOP/s")


if __name__ == "__main__":
    bench()
