"""Paged decode attention (one new query token per sequence), flash-decoding style.

What it computes
----------------
For each sequence b and query head h, with n = context_lens[b] cached tokens:

    out[b, h] = softmax(scale * q[b, h] . K_b[:n, kvh]^T) @ V_b[:n, kvh]
    kvh = h // (Hq // Hkv)                                   (grouped-query attention)

Shapes:
    q            [B, Hq, D]       the newest token of every sequence
    k_cache      [num_blocks, block_size, Hkv, D]   (v_cache the same)
    block_tables [B, max_blocks_per_seq] int32      logical block i -> physical block
    context_lens [B] int32        keys to attend, including the token just stored
    out          [B, Hq, D]

Token position p of sequence b lives in physical block block_tables[b, p // block_size]
at row p % block_size. Only the first ceil(n / block_size) table entries are read.

Napkin math
-----------
Decode attention does ~2 flops per byte of K/V it reads (q.k and p.v per key
element), i.e. it is entirely memory bound. Bytes per step, element size e:

    K and V:  2 * sum_b(context_lens[b]) * Hkv * D * e       <- dominates
    q, out:   2 * B * Hq * D * e

e.g. B=64 sequences x 4k tokens, Hkv=2, D=64, bf16: 2*64*4096*2*64*2 B = 128 MiB,
~40 us at 3.3 TB/s. The goal is to stream K/V exactly once at full bandwidth.

Design
------
* One program per (sequence, kv head, split). It handles all Hq/Hkv query heads
  that share this kv head, so each K/V tile is loaded once for the whole group
  instead of once per query head (the point of GQA).
* The group of query heads is padded to BLOCK_G >= 16 rows so both products can
  use tl.dot (tensor cores need M >= 16). Most of those rows are zero padding,
  but the wasted math is free: the kernel waits on memory, not on the MMA units.
* Keys are processed in tiles of BLOCK_N tokens with an online softmax (running
  max m, running sum l, unnormalised accumulator acc), so nothing of size n is
  ever materialised. A tile may span several cache blocks: every key position
  looks up its own physical block, which makes any block size work, from 8
  tokens up to one huge block per sequence.
* Split-K ("flash-decoding"): with few sequences, B * Hkv programs cannot fill
  the GPU. Then each sequence's keys are cut into num_splits contiguous chunks
  processed by separate programs, each writing a partial (acc, m, l); a second
  small kernel merges the partials:  out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
  The partials cost 2 * B * Hq * S * (D + 2) * 4 bytes (written, then read
  back), small next to K/V as long as each split covers a few hundred keys.
  With num_splits == 1 the first kernel normalises and writes the output itself.
* Both products pass input_precision="ieee": fp32 caches then get true fp32
  math rather than TF32; fp16/bf16 inputs use tensor cores either way.
* Softmax runs in base 2 (exp2 is the native instruction): scores are multiplied
  by scale * log2(e) and the m values live in that base-2 domain throughout.

Compiled variants
-----------------
Triton compiles one binary per distinct set of compile-time facts: every
tl.constexpr value, and by default two facts about each integer argument
(whether it equals 1, whether it is divisible by 16). A fact that changes from
one step to the next therefore means a fresh compile (~0.5 s) in the middle of
serving. So everything that varies per step, or per engine, is a plain runtime
integer marked do_not_specialize:

* NUM_SPLITS follows the batch size and the block-table width; the kernel
  tests it at run time to choose its ending (normalise and write out, or
  write partials). The reduce kernel loops over the partials BLOCK_S at a
  time, so one binary merges any number of splits.
* stride_bt, the block-table width, grows with the longest sequence of a step.
* BLOCK_SIZE: the paged engine's 8, 16 or 32, or the contiguous engines' one
  block of max_model_len. It costs an integer division per key position,
  next to the 2 * HEAD_DIM elements loaded for that key.
* The unused partial buffers of a split-free launch are still fp32 pointers:
  a pointer's dtype is part of the compiled signature too.

What stays constexpr is fixed by the model: GROUP, HEAD_DIM, and the tile
sizes. For one model and dtype there is exactly one decode binary and one
reduce binary, whatever the batch, the context lengths or the block size;
tools/aot_capture.py enumerates them (the audit), and minillm.kernels.warmup compiles
them before any request is timed.
"""

from __future__ import annotations

import math

import torch

from ._common import (
    HAS_TRITON,
    GpuSpec,
    check,
    check_device,
    cuda_or_skip,
    is_pow2,
    planning_gpu,
    report,
    require_triton,
    tl,
    triton,
)

_LOG2E = 1.4426950408889634

if HAS_TRITON:

    # The block-table width and the split count change from step to step, the
    # block size from engine to engine: plain runtime integers, never specialised
    # on (see "Compiled variants" above). Upper case marks them as sizes, like
    # the constexprs, but they are not.
    @triton.jit(do_not_specialize=["stride_bt", "BLOCK_SIZE", "NUM_SPLITS"])
    def _paged_decode_kernel(
        q_ptr,  # [B, Hq, D]
        k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
        v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
        block_tables_ptr,  # [B, max_blocks_per_seq] int32
        context_lens_ptr,  # [B] int32
        out_ptr,  # [B, Hq, D]          written when NUM_SPLITS == 1
        part_acc_ptr,  # [B, Hq, S, D] fp32  written when NUM_SPLITS > 1
        part_m_ptr,  # [B, Hq, S] fp32
        part_l_ptr,  # [B, Hq, S] fp32
        qk_scale,  # softmax scale * log2(e)
        stride_qb,
        stride_qh,
        stride_ob,
        stride_oh,
        stride_bt,  # block-table row stride (its width): runtime
        BLOCK_SIZE,  # tokens per cache block: runtime
        Hq,
        Hkv,
        NUM_SPLITS,  # S, key chunks per sequence: runtime
        GROUP: tl.constexpr,  # query heads per kv head
        HEAD_DIM: tl.constexpr,
        BLOCK_G: tl.constexpr,  # GROUP padded to >= 16 for tl.dot
        BLOCK_N: tl.constexpr,  # keys per tile
    ):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        ctx = tl.load(context_lens_ptr + b)
        # This split's key range [start, end); chunk sizes are whole tiles so
        # only the last tile of the last busy split is ragged. Splits past the
        # end of a short sequence get an empty range and just write m=-big, l=0.
        per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, ctx)

        g = tl.arange(0, BLOCK_G)  # [BLOCK_G] query-head index inside the group
        d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
        n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
        heads = kvh * GROUP + g  # [BLOCK_G] absolute query heads
        g_valid = g < GROUP  # padding rows are loaded as zeros and never stored

        q = tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g_valid[:, None],
            other=0.0,
        )  # [BLOCK_G, HEAD_DIM]

        # The running max starts at a large finite negative instead of -inf so that
        # exp2(m_old - m_new) stays defined while all keys seen so far were masked.
        m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)  # running softmax denominator
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)  # running numerator

        row_stride = Hkv * HEAD_DIM  # elements between consecutive cache slots
        bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + n  # [BLOCK_N] logical key positions
            kv_valid = pos < end
            # Translate logical positions to cache slots through the block table.
            # Masked lanes never touch the table, so stale/-1 entries are harmless.
            phys = tl.load(bt_row + pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)  # [BLOCK_N]
            slot = phys * BLOCK_SIZE + pos % BLOCK_SIZE  # [BLOCK_N]
            kv_off = slot * row_stride + kvh * HEAD_DIM  # [BLOCK_N] start of each key row

            # K is loaded already transposed ([HEAD_DIM, BLOCK_N]) for q @ K^T.
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=kv_valid[None, :], other=0.0)
            s = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(kv_valid[None, :], s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # [BLOCK_G]
            alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated so far
            p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
            l_i = l_i * alpha + tl.sum(p, axis=1)

            # V in natural [BLOCK_N, HEAD_DIM] layout for p @ V.
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        # A runtime branch, the same for the whole program (and launch): both
        # endings live in the one binary, and no thread diverges.
        if NUM_SPLITS == 1:
            # l_i == 0 only for an empty sequence; emit zeros instead of 0/0.
            out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
            tl.store(
                out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=g_valid[:, None],
            )
        else:
            row = (b.to(tl.int64) * Hq + heads) * NUM_SPLITS + split  # [BLOCK_G] index into [B, Hq, S]
            tl.store(part_m_ptr + row, m_i, mask=g_valid)
            tl.store(part_l_ptr + row, l_i, mask=g_valid)
            tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_valid[:, None])

    @triton.jit(do_not_specialize=["NUM_SPLITS"])
    def _reduce_splits_kernel(
        part_acc_ptr,  # [B, Hq, S, D] fp32
        part_m_ptr,  # [B, Hq, S] fp32
        part_l_ptr,  # [B, Hq, S] fp32
        out_ptr,  # [B, Hq, D]
        stride_ob,
        stride_oh,
        Hq,
        NUM_SPLITS,  # S: runtime, never specialised, so one binary merges any split count
        BLOCK_S: tl.constexpr,  # partials merged per loop iteration
        HEAD_DIM: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
        first = (b * Hq + h) * NUM_SPLITS  # row of partial 0 of (b, h) in [B * Hq * S]

        # The decode kernel's online softmax one level up: bring every partial to
        # the running max before adding. Empty splits have l = 0 and acc = 0 so
        # they drop out whatever their weight. With S <= BLOCK_S the loop runs
        # once and alpha == 0, so this is exactly the one-shot merge.
        m_run = -1.0e30  # running max (an fp32 scalar once the loop has run)
        l_run = 0.0  # running denominator
        acc_run = tl.zeros([HEAD_DIM], dtype=tl.float32)  # running numerator
        for s0 in range(0, NUM_SPLITS, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)  # [BLOCK_S]
            s_valid = s < NUM_SPLITS
            m = tl.load(part_m_ptr + first + s, mask=s_valid, other=-1.0e30)  # [BLOCK_S]
            l = tl.load(part_l_ptr + first + s, mask=s_valid, other=0.0)  # [BLOCK_S]
            acc = tl.load(part_acc_ptr + (first + s)[:, None] * HEAD_DIM + d[None, :],
                          mask=s_valid[:, None], other=0.0)  # [BLOCK_S, HEAD_DIM]
            m_new = tl.maximum(m_run, tl.max(m, axis=0))
            alpha = tl.exp2(m_run - m_new)  # rescales what was merged so far
            w = tl.exp2(m - m_new)  # [BLOCK_S]
            l_run = l_run * alpha + tl.sum(w * l, axis=0)
            acc_run = acc_run * alpha + tl.sum(w[:, None] * acc, axis=0)
            m_run = m_new
        out = acc_run / tl.where(l_run > 0.0, l_run, 1.0)  # [HEAD_DIM]
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# Partials the reduce kernel merges per loop iteration; any split count works.
_REDUCE_BLOCK_S = 16


def _pick_config(head_dim: int, dtype: torch.dtype, gpu: GpuSpec | None) -> dict:
    """Tile sizes for a GPU (None: the CPU interpreter). Tests may monkeypatch this."""
    if gpu is None:
        # Interpreter: small tiles make short test sequences cross tile edges.
        return dict(BLOCK_N=16, num_warps=4)
    # K and V tiles of [BLOCK_N, HEAD_DIM], pipelined: ~21 KB of shared memory in
    # bf16/fp16 and ~43 KB in fp32 (python tools/aot_audit.py), far below the 163 KB
    # (A100) / 227 KB (H100) a program may use. fp32 has no tensor cores here
    # (input_precision="ieee"): its dots are FMA loops with every operand in
    # registers, so 8 warps share them; with 4, head_dim 128 spills on sm_90.
    return dict(BLOCK_N=64 if head_dim <= 64 else 32, num_warps=8 if dtype == torch.float32 else 4)


def _default_num_splits(batch: int, num_kv_heads: int, max_len: int, gpu: GpuSpec | None) -> int:
    """Enough splits to give ~2 programs per SM, but never chunks under ~256 keys.

    max_len is an upper bound taken from the block-table width, so no
    device-to-host copy (and no sync) is needed to decide. The result is a
    runtime argument of the kernels: any value reuses the same binaries.
    """
    if gpu is None:
        return 1
    by_occupancy = math.ceil(2 * gpu.num_sms / max(1, batch * num_kv_heads))
    by_length = math.ceil(max_len / 256)
    return max(1, min(by_occupancy, by_length, 64))


def _check_inputs(q, k_cache, v_cache, block_tables, context_lens, name="paged_decode_attention", batch=None) -> None:
    """Checks shared with the prefill kernel, where q is [T, Hq, D] and batch = len(context_lens)."""
    check(q.dim() == 3, f"{name}: q must be [{'B' if batch is None else 'T'}, Hq, D], got shape {tuple(q.shape)}")
    check(k_cache.dim() == 4, f"{name}: k_cache must be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)}")
    check(v_cache.shape == k_cache.shape,
          f"{name}: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _, Hq, D = q.shape
    B = q.shape[0] if batch is None else batch
    _, block_size, Hkv, Dk = k_cache.shape
    check(Dk == D, f"{name}: head_dim of q ({D}) != head_dim of the cache ({Dk})")
    check(Hq % Hkv == 0, f"{name}: query heads ({Hq}) must be a multiple of kv heads ({Hkv})")
    check(is_pow2(D) and 16 <= D <= 256, f"{name}: head_dim must be a power of two in [16, 256], got {D}")
    check(block_size >= 1, f"{name}: block_size must be positive")
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32), f"{name}: q must be fp16/bf16/fp32, got {q.dtype}")
    check(k_cache.dtype == q.dtype and v_cache.dtype == q.dtype,
          f"{name}: q ({q.dtype}) and the caches ({k_cache.dtype}, {v_cache.dtype}) must share a dtype")
    check(q.stride(2) == 1, f"{name}: q must be contiguous along head_dim")
    check(k_cache.is_contiguous() and v_cache.is_contiguous(), f"{name}: k_cache and v_cache must be contiguous")
    check(block_tables.dim() == 2 and block_tables.shape[0] == B,
          f"{name}: block_tables must be [B={B}, max_blocks], got shape {tuple(block_tables.shape)}")
    check(block_tables.dtype == torch.int32, f"{name}: block_tables must be int32, got {block_tables.dtype}")
    check(block_tables.stride(1) == 1, f"{name}: block_tables rows must be contiguous")
    check(context_lens.dim() == 1 and context_lens.shape[0] == B,
          f"{name}: context_lens must be [B={B}], got shape {tuple(context_lens.shape)}")
    check(context_lens.dtype == torch.int32, f"{name}: context_lens must be int32, got {context_lens.dtype}")
    check(context_lens.is_contiguous(), f"{name}: context_lens must be contiguous")
    check_device(name, q, k_cache, v_cache, block_tables, context_lens)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """out[B, Hq, D]: one query per sequence attending its first context_lens[b] cached tokens."""
    require_triton("paged_decode_attention")
    _check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    B, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    group = Hq // Hkv
    out = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)  # [B, Hq, D]
    if B == 0:
        return out

    gpu = planning_gpu(q.device)  # None under the interpreter
    if num_splits is None:
        num_splits = _default_num_splits(B, Hkv, block_tables.shape[1] * block_size, gpu)
    check(int(num_splits) >= 1, f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    num_splits = int(num_splits)
    cfg = _pick_config(D, q.dtype, gpu)

    if num_splits > 1:
        part_acc = torch.empty(B, Hq, num_splits, D, device=q.device, dtype=torch.float32)  # [B, Hq, S, D]
        part_m = torch.empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)  # [B, Hq, S]
        part_l = torch.empty(B, Hq, num_splits, device=q.device, dtype=torch.float32)  # [B, Hq, S]
    else:
        # Unused by the kernel in this mode. Still fp32: a pointer's dtype is part
        # of the compiled signature, so `out` here would mean a second binary.
        part_acc = part_m = part_l = torch.empty(1, device=q.device, dtype=torch.float32)

    _paged_decode_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out,
        part_acc, part_m, part_l,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        block_size,
        Hq, Hkv,
        num_splits,
        GROUP=group,
        HEAD_DIM=D,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"],
    )
    if num_splits > 1:
        _reduce_splits_kernel[(B, Hq)](
            part_acc, part_m, part_l, out,
            out.stride(0), out.stride(1),
            Hq,
            num_splits,
            BLOCK_S=_REDUCE_BLOCK_S,
            HEAD_DIM=D,
            num_warps=1 if D <= 64 else 2,
        )
    return out


# ----------------------------------------------------------------------------
# Oracle: gather each sequence's keys through its block table, then textbook attention.
# One body for both paged kernels (and the CPU's): a decode row is a sequence with one
# query, and paged_prefill_attention_ref is this same function.
# ----------------------------------------------------------------------------


def gather_kv_ref(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the first n logical tokens of one sequence as dense fp32 [n, Hkv, D] K and V."""
    block_size, Hkv, D = k_cache.shape[1:]
    num_blocks = -(-n // block_size)  # ceil: never touch table entries past the sequence
    blocks = block_table[:num_blocks].long()  # [num_blocks]
    k = k_cache[blocks].reshape(-1, Hkv, D)[:n].float()  # [n, Hkv, D]
    v = v_cache[blocks].reshape(-1, Hkv, D)[:n].float()  # [n, Hkv, D]
    return k, v


def tree_key_mask(k_pos: torch.Tensor, tree_start: torch.Tensor, tree_bits: torch.Tensor) -> torch.Tensor:
    """[q, n] bool: key position k_pos[j] is outside query i's tree region or its bit is set.

    k_pos [n]; tree_start [q] and tree_bits [q] (int64 bit set: bit m is the key at
    tree_start + m). A tree holds at most 64 nodes after its root, so only bits 0..63 are read.
    """
    off = k_pos[None, :].long() - tree_start[:, None].long()  # [q, n]
    inside = (off >= 0) & (off < 64)
    bit = (tree_bits[:, None].long() >> off.clamp(0, 63)) & 1
    return (off < 0) | (inside & (bit == 1))


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,  # accepted for signature parity with paged_prefill_attention
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The oracle of paged attention, in fp32: every query of a step over its sequence's keys.

    q [T, Hq, D] packs the new tokens of B sequences (query_start_loc [B+1]); sequence b's
    q_len queries are the last of its context_lens[b] cached tokens, so query j sits at
    position context_lens[b] - q_len + j and sees keys 0 .. that position (causal). A decode
    row is q_len 1; a sequence with no keys gives zeros. Returns out [T, Hq, D] in q.dtype.

    Candidate trees (``minillm.spec_decode.tree``): ``tree_start`` [T] int32 and ``tree_bits``
    [T] int64, both or neither. Query t then sees key j only if, besides the causal rule,
    j < tree_start[t] or bit j - tree_start[t] of tree_bits[t] is set (``tree_key_mask``):
    the nodes of a tree sit after their root and a node sees its ancestors and itself.
    A query outside any tree has tree_start[t] >= its position + 1 (nothing is masked).
    """
    Hq = q.shape[1]
    Hkv = k_cache.shape[2]
    out = torch.zeros_like(q)  # [T, Hq, D]
    for b in range(context_lens.shape[0]):
        first, last = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, n = last - first, int(context_lens[b])
        if q_len == 0:
            continue
        k, v = gather_kv_ref(k_cache, v_cache, block_tables[b], n)  # [n, Hkv, D]
        # GQA: query head h reads kv head h // (Hq // Hkv); repeat kv heads to line them up.
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
        scores = torch.einsum("qhd,nhd->hqn", q[first:last].float(), k) * scale  # [Hq, q_len, n]
        q_pos = torch.arange(n - q_len, n, device=q.device)  # [q_len] absolute query positions
        k_pos = torch.arange(n, device=q.device)  # [n]
        causal = k_pos[None, :] <= q_pos[:, None]  # [q_len, n]
        if tree_start is not None:
            causal &= tree_key_mask(k_pos, tree_start[first:last], tree_bits[first:last])
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hq, q_len, n]
        out[first:last] = torch.einsum("hqn,nhd->qhd", probs, v).to(q.dtype)  # [q_len, Hq, D]
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,  # accepted for signature parity; splitting does not change the math
) -> torch.Tensor:
    """``paged_attention_ref`` with one query per sequence: q [B, Hq, D] -> out [B, Hq, D]."""
    one_each = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)  # query_start_loc [B+1]
    return paged_attention_ref(q, k_cache, v_cache, block_tables, one_each, context_lens, scale)


# ----------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------


def bench(dtype: torch.dtype = torch.bfloat16) -> None:
    if not cuda_or_skip("paged_decode_attention"):
        return
    from triton.testing import do_bench

    Hq, Hkv, D, block_size = 16, 2, 64, 16
    e = torch.tensor([], dtype=dtype).element_size()
    for B, ctx in [(1, 8192), (8, 4096), (64, 1024), (256, 512)]:
        blocks_per_seq = ctx // block_size
        num_blocks = B * blocks_per_seq
        k_cache = torch.randn(num_blocks, block_size, Hkv, D, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(B, blocks_per_seq)
        context_lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        nbytes = 2 * B * ctx * Hkv * D * e + 2 * B * Hq * D * e
        for splits in [1, None]:
            ms = do_bench(lambda: paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                         D ** -0.5, num_splits=splits))
            label = f"decode B={B} ctx={ctx} splits={'auto' if splits is None else splits}"
            report(label, ms, nbytes)


if __name__ == "__main__":
    bench()
