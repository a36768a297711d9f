"""The kernel tests' launch configurations, in one place.

The test modules parametrize over these lists, and the AOT tier (test_aot.py runs
``python tools/aot_audit.py --extra <this file>``) compiles every launch they make for
sm_80 and sm_90 -- the interpreter cases too: on a GPU machine they run compiled,
with the GPU tile sizes. Add a case here, not inline in a test, so both see it.

Only what decides a kernel's compiled variant matters to ``launches()``: dtypes,
head counts, head_dim, strides and the split decision. Sizes that only set a
grid or a loop bound (lengths, batch) are kept as the tests have them anyway.
"""

from __future__ import annotations

import torch

INTERP_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16]

# --- rmsnorm: (T, D, strided): a strided x has row stride D + 5 ------------------
RMS_INTERP = [(1, 64, False), (7, 96, True)]
RMS_GPU = [(1, 576, False), (513, 2048, False), (4096, 4096, False), (3, 5000, True)]

# --- store_kv: k/v are slices of a fused [T, 3H, D] buffer --------------------------
# interpreter: (dtype, slot dtype, H, D) with T=9, block_size=8, 4 blocks
STORE_KV_INTERP = [(torch.float32, torch.int32, 2, 32), (torch.float16, torch.int64, 3, 64)]
STORE_KV_GPU_T = [1, 37, 4096]  # H=2, D=64, block_size=16, 1024 blocks, int32 slots

# --- decode: (Hq, Hkv, D, block_size, context lengths) --------------------------------
# GQA ratios 1 and 3, lengths of 1, exact multiples of the block size and ragged ones.
DECODE_CASES = [
    (2, 2, 32, 8, [1, 8, 13, 40]),
    (6, 2, 64, 16, [17, 1, 64, 33]),
    (3, 1, 128, 32, [5, 70]),
]
DECODE_CASE_IDS = ["mha-bs8", "gqa3-bs16", "gqa3-bs32"]
DECODE_SPLITS = [1, 3]
DECODE_EMPTY = (2, 1, 32, 8, [0, 5])  # a padded batch entry with context 0; splits 1 and 2, fp32
DECODE_HUGE_BLOCK = (2, 1, 32, 8192, [1, 100, 257])  # the contiguous engines: one block per sequence; fp32
DECODE_GPU_TILING = (4, 2, 64, 16, [3, 64, 150])  # fp16, 2 splits, GPU tiles in the interpreter
DECODE_GPU_CASES = [
    (16, 2, 64, 16, [1, 15, 16, 17, 500, 2049, 3000, 33]),
    (8, 8, 128, 32, [7, 1000, 4096]),
    (12, 4, 64, 8192, [1, 3000, 8192]),
]
DECODE_GPU_CASE_IDS = ["gqa8-d64-bs16", "mha-d128-bs32", "gqa3-huge-block"]
DECODE_GPU_SPLITS = [None, 1, 7]

# --- prefill: (q_len, context_len) per sequence and (Hq, Hkv, D, block_size) ---------
# Empty query, length 1, full prefills, a later chunk with a context offset,
# a 3-token speculative verification.
PREFILL_SEQS = [(0, 5), (1, 1), (7, 7), (20, 37), (3, 50), (17, 17)]
PREFILL_CASES = [(2, 2, 32, 8), (6, 2, 64, 16), (3, 1, 128, 32)]
PREFILL_CASE_IDS = ["mha-bs8", "gqa3-bs16", "gqa3-bs32"]
PREFILL_GPU_TILING = ((4, 2, 64, 16), [(70, 70), (5, 90), (0, 3)])  # fp16 and fp32, GPU tiles
PREFILL_EQUALS_DECODE = (6, 2, 32, 8, [1, 8, 29])  # one query per sequence; interpreter dtypes
PREFILL_CHUNKED = (4, 2, 32, 8, 12)  # Hq, Hkv, D, block_size, num_blocks; fp32, 2 sequences, table [2, 5]
PREFILL_GPU_SEQS = [(1000, 1000), (1, 513), (37, 2000), (0, 10), (129, 129), (64, 64), (5, 1500)]
PREFILL_GPU_CASES = [(16, 2, 64, 16), (8, 8, 128, 32), (12, 4, 64, 2048)]
PREFILL_GPU_CASE_IDS = ["gqa8-d64-bs16", "mha-d128-bs32", "gqa3-huge-block"]
PREFILL_EQUALS_DECODE_GPU = (16, 2, 64, 16, [1, 16, 700, 4000])

# --- prefill with candidate trees (tree_start/tree_bits): (Hq, Hkv, D, block_size) and per
# sequence (q_len, context_len, tree): tree None for a plain chunk, else the parents of its
# nodes (node 0 the root, as minillm.spec_decode.tree.TreeSpec.parents), fed as the sequence's
# last q_len == len(parents) queries. Interpreter: a root and 7 nodes at positions 13..20 with
# block size 8 (the tree straddles the block edge at 16), a plain chunk before it, and the
# root and first 4 nodes of the same tree at positions 0..4 (the root is key 0). fp32 and fp16.
TREE_PARENTS = (-1, 0, 0, 0, 1, 1, 2, 4)
PREFILL_TREE = ((4, 2, 32, 8), [(6, 11, None), (8, 21, TREE_PARENTS), (5, 5, TREE_PARENTS[:5])])
# Raw bits, bit 63 included: queries with tree_start = position - 63, so every one of the
# 64 bits decides a causally visible key. (Hq, Hkv, D, block_size, q_len, context_len); fp32.
PREFILL_TREE_BITS = (2, 1, 32, 8, 5, 80)
# GPU: a 63-node tree (every bit but 63, each node's parent drawn at random) after 1500 cached
# tokens and a 5-node chain, beside long plain chunks; bf16/fp16 with the GPU tiles.
_G = torch.Generator().manual_seed(5)
TREE_GPU_PARENTS = (-1,) + tuple(int(torch.randint(0, n, (1,), generator=_G)) for n in range(1, 64))
PREFILL_TREE_GPU = ((16, 2, 64, 16), [(300, 1000, None), (64, 1564, TREE_GPU_PARENTS), (1, 513, None),
                                      (6, 40, (-1, 0, 1, 2, 3, 4)), (129, 129, None)])

# --- quant_gemv: (M, N, K, group_size): y[M, N] = x[M, K] @ w[N, K].T, w in 8-bit or 4-bit groups
# One decode row, a small batch, more rows than a tile; N never a multiple of the tile;
# K of several groups; group sizes 16, 32 and 128. Each case runs u8_gemv and q4_gemv.
QUANT_INTERP = [(1, 96, 64, 32), (5, 200, 160, 32), (70, 33, 96, 16), (2, 40, 256, 128)]
QUANT_GPU_TILING = [(3, 130, 96), (70, 130, 64)]  # group 32, the GPU tiles in the interpreter: fp16 and fp32
QUANT_BF16 = (3, 40, 64, 32)  # bf16 in the interpreter too (the wrapper runs it in fp32 there)
QUANT_GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# SmolLM2-135M's qkv, gate_up and down projections and its head at decode; batches; prefills.
QUANT_GPU = [(1, 960, 576, 32), (1, 3072, 576, 32), (1, 576, 1536, 32), (1, 49152, 576, 32), (7, 3072, 576, 32),
             (16, 576, 1536, 32), (17, 1000, 576, 32), (64, 49152, 576, 32), (300, 960, 576, 32),
             (4096, 3072, 576, 32), (1, 4100, 4096, 128)]


# ----------------------------------------------------------------------------
# For the AOT tier: the same launches as minillm.kernels.warmup.Launch objects
# ----------------------------------------------------------------------------


def launches():
    """Every wrapper call the kernel tests make, as minillm.kernels.warmup.Launch (CPU tensors
    with the tests' dtypes, shapes and strides; values never matter: nothing runs)."""
    import importlib

    from minillm.kernels.warmup import Launch, dtype_name

    rms = importlib.import_module("minillm.kernels.rmsnorm")
    skv = importlib.import_module("minillm.kernels.store_kv")
    dec = importlib.import_module("minillm.kernels.paged_decode_attention")
    pre = importlib.import_module("minillm.kernels.paged_prefill_attention")
    out = []

    def add(label, dtype, fn):
        out.append(Launch(f"tests: {label} {dtype_name(dtype)}", dtype, fn))

    def rms_calls(T, D, strided, dtype):
        def run(device):
            x = torch.empty(T, D + 5 if strided else D, dtype=dtype, device=device)[:, :D]
            w = torch.empty(D, dtype=dtype, device=device)
            rms.rms_norm(x, w, 1e-6)
            rms.fused_add_rms_norm(x, torch.empty(T, D, dtype=dtype, device=device), w, 1e-6)
        return run

    def store_call(T, H, D, block_size, dtype, slot_dtype, fused=True):
        def run(device):
            if fused:  # slices of one [T, 3H, D] buffer, as test_store_kv_kernel makes them
                qkv = torch.empty(T, 3 * H, D, dtype=dtype, device=device)
                k, v = qkv[:, H:2 * H], qkv[:, 2 * H:]
            else:  # contiguous, as the chunked-prefill test concatenates them
                k, v = (torch.empty(T, H, D, dtype=dtype, device=device) for _ in range(2))
            cache = torch.empty(1, block_size, H, D, dtype=dtype, device=device)
            skv.store_kv(k, v, cache, torch.empty_like(cache), torch.empty(T, dtype=slot_dtype, device=device))
        return run

    def decode_call(case, dtype, splits, spare=2):
        Hq, Hkv, D, bs, lens = case
        width = max(1, max(-(-n // bs) for n in lens)) + spare  # conftest.make_paged_kv's table

        def run(device):
            cache = torch.empty(1, bs, Hkv, D, dtype=dtype, device=device)
            dec.paged_decode_attention(torch.empty(len(lens), Hq, D, dtype=dtype, device=device), cache,
                                       torch.empty_like(cache),
                                       torch.zeros(len(lens), width, dtype=torch.int32, device=device),
                                       torch.tensor(lens, dtype=torch.int32, device=device), D ** -0.5,
                                       num_splits=splits)
        return run

    def prefill_call(head_case, seqs, dtype, width=None):
        Hq, Hkv, D, bs = head_case
        q_lens, ctx = [a for a, _ in seqs], [b for _, b in seqs]
        width = width or max(1, max(-(-n // bs) for n in ctx)) + 2

        def run(device):
            cache = torch.empty(1, bs, Hkv, D, dtype=dtype, device=device)
            qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
            pre.paged_prefill_attention(torch.empty(sum(q_lens), Hq, D, dtype=dtype, device=device), cache,
                                        torch.empty_like(cache),
                                        torch.zeros(len(seqs), width, dtype=torch.int32, device=device), qsl,
                                        torch.tensor(ctx, dtype=torch.int32, device=device), D ** -0.5,
                                        max_query_len=max(q_lens))
        return run

    def prefill_tree_call(head_case, seqs, dtype):
        Hq, Hkv, D, bs = head_case
        q_lens, ctx = [s[0] for s in seqs], [s[1] for s in seqs]
        width = max(1, max(-(-n // bs) for n in ctx)) + 2
        T = sum(q_lens)

        def run(device):
            cache = torch.empty(1, bs, Hkv, D, dtype=dtype, device=device)
            qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
            pre.paged_prefill_attention(torch.empty(T, Hq, D, dtype=dtype, device=device), cache,
                                        torch.empty_like(cache),
                                        torch.zeros(len(seqs), width, dtype=torch.int32, device=device), qsl,
                                        torch.tensor(ctx, dtype=torch.int32, device=device), D ** -0.5,
                                        max_query_len=max(q_lens),
                                        tree_start=torch.zeros(T, dtype=torch.int32, device=device),
                                        tree_bits=torch.zeros(T, dtype=torch.int64, device=device))
        return run

    for dtype in INTERP_DTYPES:
        add("prefill tree", dtype, prefill_tree_call(*PREFILL_TREE, dtype))
    Hq, Hkv, D, bs, q_len, n = PREFILL_TREE_BITS
    add("prefill tree bits", torch.float32, prefill_tree_call((Hq, Hkv, D, bs), [(q_len, n, None)], torch.float32))
    for dtype in GPU_DTYPES:
        add("prefill tree gpu", dtype, prefill_tree_call(*PREFILL_TREE_GPU, dtype))

    for dtype in INTERP_DTYPES:
        for T, D, strided in RMS_INTERP:
            add(f"rms_norm T={T} D={D}", dtype, rms_calls(T, D, strided, dtype))
        for case, ident in zip(DECODE_CASES, DECODE_CASE_IDS):
            for splits in DECODE_SPLITS:
                add(f"decode {ident} splits={splits}", dtype, decode_call(case, dtype, splits))
        for case, ident in zip(PREFILL_CASES, PREFILL_CASE_IDS):
            add(f"prefill {ident}", dtype, prefill_call(case, PREFILL_SEQS, dtype))
        Hq, Hkv, D, bs, lens = PREFILL_EQUALS_DECODE
        add("prefill == decode", dtype, prefill_call((Hq, Hkv, D, bs), [(1, n) for n in lens], dtype))
        add("decode == prefill", dtype, decode_call(PREFILL_EQUALS_DECODE, dtype, None))
        add("prefill gpu tiling", dtype, prefill_call(*PREFILL_GPU_TILING, dtype))
    for dtype, slot_dtype, H, D in STORE_KV_INTERP:
        add(f"store_kv H={H} D={D}", dtype, store_call(9, H, D, 8, dtype, slot_dtype))
    for splits in (1, 2):
        add(f"decode empty context splits={splits}", torch.float32, decode_call(DECODE_EMPTY, torch.float32, splits))
    add("decode huge block", torch.float32, decode_call(DECODE_HUGE_BLOCK, torch.float32, 2))
    add("decode gpu tiling", torch.float16, decode_call(DECODE_GPU_TILING, torch.float16, 2))
    Hq, Hkv, D, bs, _ = PREFILL_CHUNKED
    add("store_kv chunked", torch.float32, store_call(21, Hkv, D, bs, torch.float32, torch.int64, fused=False))
    for q_lens in [(16, 5), (14, 16), (3, 0), (1, 1)]:  # the chunked test's steps
        add(f"prefill chunked q_lens={q_lens}", torch.float32,
            prefill_call((Hq, Hkv, D, bs), [(q, q + 1) for q in q_lens], torch.float32, width=5))

    for dtype in GPU_DTYPES:
        for T, D, strided in RMS_GPU:
            add(f"rms_norm T={T} D={D}", dtype, rms_calls(T, D, strided, dtype))
        for T in STORE_KV_GPU_T:
            add(f"store_kv T={T}", dtype, store_call(T, 2, 64, 16, dtype, torch.int32))
        for case, ident in zip(DECODE_GPU_CASES, DECODE_GPU_CASE_IDS):
            for splits in DECODE_GPU_SPLITS:
                add(f"decode {ident} splits={splits}", dtype, decode_call(case, dtype, splits))
        for case, ident in zip(PREFILL_GPU_CASES, PREFILL_GPU_CASE_IDS):
            add(f"prefill {ident}", dtype, prefill_call(case, PREFILL_GPU_SEQS, dtype))
        Hq, Hkv, D, bs, lens = PREFILL_EQUALS_DECODE_GPU
        add("prefill == decode", dtype, prefill_call((Hq, Hkv, D, bs), [(1, n) for n in lens], dtype))
        add("decode == prefill", dtype, decode_call(PREFILL_EQUALS_DECODE_GPU, dtype, None))

    qg = importlib.import_module("minillm.kernels.quant_gemv")

    def quant_calls(M, N, K, G, dtype):
        def run(device):
            x = torch.empty(M, K, dtype=dtype, device=device)
            scales, mins = (torch.empty(N, K // G, dtype=torch.float32, device=device) for _ in range(2))
            qg.u8_gemv(x, torch.empty(N, K, dtype=torch.uint8, device=device), scales, mins, G)
            qg.q4_gemv(x, torch.empty(N, K // 2, dtype=torch.uint8, device=device), scales, mins, G)
        return run

    for dtype in INTERP_DTYPES:
        for M, N, K, G in QUANT_INTERP:
            add(f"quant_gemv M={M} N={N} K={K} G={G}", dtype, quant_calls(M, N, K, G, dtype))
        for M, N, K in QUANT_GPU_TILING:
            add(f"quant_gemv gpu tiling M={M} N={N} K={K}", dtype, quant_calls(M, N, K, 32, dtype))
    add("quant_gemv bf16", torch.bfloat16, quant_calls(*QUANT_BF16, torch.bfloat16))
    for dtype in QUANT_GPU_DTYPES:
        for M, N, K, G in QUANT_GPU:
            add(f"quant_gemv M={M} N={N} K={K} G={G}", dtype, quant_calls(M, N, K, G, dtype))
    return out
