"""Paged decode and prefill attention: the oracles against a naive dense
attention, then the Triton kernels against the oracles."""

import importlib
import math

import pytest
import torch
from kernel_cases import (
    DECODE_CASE_IDS,
    DECODE_CASES,
    DECODE_EMPTY,
    DECODE_GPU_CASE_IDS,
    DECODE_GPU_CASES,
    DECODE_GPU_SPLITS,
    DECODE_GPU_TILING,
    DECODE_HUGE_BLOCK,
    DECODE_SPLITS,
    GPU_DTYPES,
    INTERP_DTYPES,
    PREFILL_CASE_IDS,
    PREFILL_CASES,
    PREFILL_CHUNKED,
    PREFILL_EQUALS_DECODE,
    PREFILL_EQUALS_DECODE_GPU,
    PREFILL_GPU_CASE_IDS,
    PREFILL_GPU_CASES,
    PREFILL_GPU_SEQS,
    PREFILL_GPU_TILING,
    PREFILL_SEQS,
    PREFILL_TREE,
    PREFILL_TREE_BITS,
    PREFILL_TREE_GPU,
    TREE_PARENTS,
)

from minillm.kernels import (
    H100,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    store_kv,
)

# The package re-exports functions named like their modules, so fetch the
# modules themselves (for monkeypatching the tile configs) via importlib.
decode_mod = importlib.import_module("minillm.kernels.paged_decode_attention")
prefill_mod = importlib.import_module("minillm.kernels.paged_prefill_attention")


def naive_attention(q, k, v, scale):
    """Dense causal attention with explicit loops, in float64.

    q [q_len, Hq, D] are the *last* q_len positions of a sequence whose full
    keys/values are k, v [n, Hkv, D].
    """
    q_len, Hq, D = q.shape
    n, Hkv, _ = k.shape
    out = torch.zeros(q_len, Hq, D, dtype=torch.float64)
    for i in range(q_len):
        pos = n - q_len + i  # absolute position of query i
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            scores = [scale * float(q[i, h].double() @ k[j, kh].double()) for j in range(pos + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in enumerate(weights):
                out[i, h] += (w / total) * v[j, kh].double()
    return out


def pack_queries(q_lens, Hq, D, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = sum(q_lens)
    q = torch.randn(T, Hq, D, generator=g).to(dtype).to(device)  # [T, Hq, D]
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)  # [B+1]
    return q, qsl


# ----------------------------------------------------------------------------
# The oracles themselves (pure PyTorch, no Triton needed)
# ----------------------------------------------------------------------------


def test_oracles_match_naive_dense_attention(paged_kv):
    # The oracles compute in fp32; the naive loops in fp64.
    Hq, Hkv, D, block_size = 6, 2, 16, 8
    q_lens, ctx = [1, 3, 0, 20], [1, 9, 4, 20]
    k_cache, v_cache, tables, dense = paged_kv(ctx, Hkv, D, block_size, torch.float32, "cpu")
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    q, qsl = pack_queries(q_lens, Hq, D, torch.float32, "cpu")
    close = dict(atol=1e-5, rtol=1e-5)
    scale = D ** -0.5

    out = paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, context_lens, scale)
    for b, (k, v) in enumerate(dense):
        rows = slice(int(qsl[b]), int(qsl[b + 1]))
        torch.testing.assert_close(out[rows].double(), naive_attention(q[rows], k, v, scale), **close)

    # Decode: the last token of every sequence.
    qd = torch.randn(len(ctx), Hq, D)
    out = paged_decode_attention_ref(qd, k_cache, v_cache, tables, context_lens, scale)
    for b, (k, v) in enumerate(dense):
        torch.testing.assert_close(out[b].double(), naive_attention(qd[b:b + 1], k, v, scale)[0], **close)


# ----------------------------------------------------------------------------
# Decode kernel
# ----------------------------------------------------------------------------

# Cases (Hq, Hkv, D, block_size, context lengths) live in kernel_cases.py, which
# the AOT tier (test_aot.py) also compiles for sm_80 and sm_90.


def _run_decode(case, dtype, num_splits, device, tol, paged_kv):
    Hq, Hkv, D, block_size, lens = case
    k_cache, v_cache, tables, _ = paged_kv(lens, Hkv, D, block_size, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(len(lens), Hq, D, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, D ** -0.5, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, D ** -0.5)
    assert not out.isnan().any(), "masked (NaN-poisoned) cache slots leaked into the result"
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", DECODE_SPLITS)
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("case", DECODE_CASES, ids=DECODE_CASE_IDS)
def test_decode_small(case, dtype, num_splits, device, tol, paged_kv):
    _run_decode(case, dtype, num_splits, device, tol, paged_kv)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_context_gives_zeros(num_splits, device, paged_kv):
    # Padded batch entries may carry context_len 0: output zeros, never NaN.
    Hq, Hkv, D, block_size, lens = DECODE_EMPTY
    k_cache, v_cache, tables, _ = paged_kv(lens, Hkv, D, block_size, torch.float32, device)
    q = torch.randn(len(lens), Hq, D, device=device)
    context_lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.2, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out, paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, 0.2))


@pytest.mark.interpreter
def test_decode_one_huge_block(device, tol, paged_kv):
    # The contiguous-cache engine: a single block of max_model_len per sequence.
    _run_decode(DECODE_HUGE_BLOCK, torch.float32, 2, device, tol, paged_kv)


@pytest.mark.interpreter
def test_decode_gpu_tiling(monkeypatch, device, tol, paged_kv):
    # Exercise the tile sizes used on the GPU, even when running in the interpreter.
    real = decode_mod._pick_config
    monkeypatch.setattr(decode_mod, "_pick_config", lambda d, dt, gpu: real(d, dt, H100))
    _run_decode(DECODE_GPU_TILING, torch.float16, 2, device, tol, paged_kv)


# ----------------------------------------------------------------------------
# Prefill kernel
# ----------------------------------------------------------------------------

# PREFILL_SEQS: (q_len, context_len) per sequence: empty query, length 1, full
# prefills, a later chunk with a context offset, a 3-token speculative verification.


def _run_prefill(Hq, Hkv, D, block_size, seqs, dtype, device, tol, paged_kv):
    q_lens = [s[0] for s in seqs]
    lens = [s[1] for s in seqs]
    k_cache, v_cache, tables, _ = paged_kv(lens, Hkv, D, block_size, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q, qsl = pack_queries(q_lens, Hq, D, dtype, device)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5,
                                  max_query_len=max(q_lens))
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
    assert not out.isnan().any(), "masked (NaN-poisoned) cache slots leaked into the result"
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=PREFILL_CASE_IDS)
def test_prefill_small(case, dtype, device, tol, paged_kv):
    _run_prefill(*case, PREFILL_SEQS, dtype, device, tol, paged_kv)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])  # the tile depends on the dtype
def test_prefill_gpu_tiling(dtype, monkeypatch, device, tol, paged_kv):
    real = prefill_mod._pick_config
    monkeypatch.setattr(prefill_mod, "_pick_config", lambda d, dt, gpu: real(d, dt, H100))
    case, seqs = PREFILL_GPU_TILING
    _run_prefill(*case, seqs, dtype, device, tol, paged_kv)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
def test_prefill_with_one_query_equals_decode(dtype, device, tol, paged_kv):
    Hq, Hkv, D, block_size, lens = PREFILL_EQUALS_DECODE
    k_cache, v_cache, tables, _ = paged_kv(lens, Hkv, D, block_size, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q, qsl = pack_queries([1] * len(lens), Hq, D, dtype, device)  # q: [B, Hq, D]
    dec = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, D ** -0.5)
    pre = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
    torch.testing.assert_close(pre, dec, **tol(dtype))
    torch.testing.assert_close(
        paged_prefill_attention_ref(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5),
        paged_decode_attention_ref(q, k_cache, v_cache, tables, context_lens, D ** -0.5),
    )


@pytest.mark.interpreter
def test_chunked_prefill_then_decode_matches_dense(device):
    """End to end like the engine: per step store this step's K/V, then attend.

    Two sequences advance with different schedules (chunks, an idle step, a
    3-token verification, a decode step); the concatenated outputs must equal
    dense causal attention over each full sequence.
    """
    Hq, Hkv, D, block_size, num_blocks = PREFILL_CHUNKED
    schedules = [[16, 14, 3, 1], [5, 16, 0, 1]]  # q_len per step, per sequence
    total = [sum(s) for s in schedules]
    g = torch.Generator().manual_seed(3)
    K = [torch.randn(n, Hkv, D, generator=g) for n in total]  # dense keys per sequence
    V = [torch.randn(n, Hkv, D, generator=g) for n in total]
    Q = [torch.randn(n, Hq, D, generator=g) for n in total]

    k_cache = torch.full((num_blocks, block_size, Hkv, D), float("nan"), device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.stack([perm[:5], perm[5:10]]).to(device)  # [2, 5], ample for 34 and 22 tokens
    outs = [[] for _ in schedules]
    done = [0, 0]
    for step in range(len(schedules[0])):
        q_lens = [s[step] for s in schedules]
        q_parts, k_parts, v_parts, slots = [], [], [], []
        for b, n_new in enumerate(q_lens):
            pos = torch.arange(done[b], done[b] + n_new)
            q_parts.append(Q[b][pos])
            k_parts.append(K[b][pos])
            v_parts.append(V[b][pos])
            slots.append(tables[b].cpu()[pos // block_size].long() * block_size + pos % block_size)
            done[b] += n_new
        q = torch.cat(q_parts).to(device)  # [T, Hq, D]
        store_kv(torch.cat(k_parts).to(device), torch.cat(v_parts).to(device), k_cache, v_cache,
                 torch.cat(slots).to(device))
        qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32).to(device)
        context_lens = torch.tensor(done, dtype=torch.int32, device=device)
        out = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
        for b in range(2):
            outs[b].append(out[int(qsl[b]):int(qsl[b + 1])].cpu())

    for b in range(2):
        got = torch.cat(outs[b])  # [total_b, Hq, D]
        # Dense causal attention over the whole sequence (queries = all positions).
        torch.testing.assert_close(got.double(), naive_attention(Q[b], K[b], V[b], D ** -0.5),
                                   atol=2e-4, rtol=2e-4)


# ----------------------------------------------------------------------------
# Prefill with candidate trees (tree_start / tree_bits)
# ----------------------------------------------------------------------------

# PREFILL_TREE: (q_len, context_len, parents or None) per sequence. A tree's q_len queries
# are its root and nodes 1..N at consecutive positions; node n sees the cached context up to
# the root, and among nodes 1..N its ancestors and itself.


def ancestor_bits(parents):
    """Per node, its ancestors-or-self among nodes 1..N: bit m - 1 for node m (the root: 0)."""
    bits = [0] * len(parents)
    for n in range(1, len(parents)):
        bits[n] = bits[parents[n]] | (1 << (n - 1))
    return bits


def tree_inputs(seqs, device, seed=4):
    """tree_start [T] int32 and tree_bits [T] int64 for a batch of PREFILL_TREE rows.

    Plain sequences get tree_start = position + 1 or far beyond it, with random bits that
    must not matter; a tree's queries (root included) get tree_start = root position + 1.
    """
    g = torch.Generator().manual_seed(seed)
    starts, bits = [], []
    for q_len, n, parents in seqs:
        positions = range(n - q_len, n)
        if parents is None:
            starts += [p + 1 + (1 << 20) * (i % 2) for i, p in enumerate(positions)]
            bits += torch.randint(-(1 << 62), 1 << 62, (q_len,), generator=g).tolist()
        else:
            assert len(parents) == q_len
            starts += [n - q_len + 1] * q_len
            bits += ancestor_bits(parents)
    return (torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor(bits, dtype=torch.int64, device=device))


def _tree_batch(head_case, seqs, dtype, device, paged_kv):
    Hq, Hkv, D, block_size = head_case
    q_lens, lens = [s[0] for s in seqs], [s[1] for s in seqs]
    k_cache, v_cache, tables, dense = paged_kv(lens, Hkv, D, block_size, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q, qsl = pack_queries(q_lens, Hq, D, dtype, device)
    return q, k_cache, v_cache, tables, qsl, context_lens, dense


def _run_prefill_tree(head_case, seqs, dtype, device, tol, paged_kv):
    """Kernel against the oracle, both with the tree mask; returns the batch for more checks."""
    D = head_case[2]
    q, k_cache, v_cache, tables, qsl, context_lens, dense = _tree_batch(head_case, seqs, dtype, device, paged_kv)
    tree_start, tree_bits = tree_inputs(seqs, device)
    args = (q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
    out = paged_prefill_attention(*args, max_query_len=max(s[0] for s in seqs),
                                  tree_start=tree_start, tree_bits=tree_bits)
    ref = paged_prefill_attention_ref(*args, tree_start=tree_start, tree_bits=tree_bits)
    assert not out.isnan().any(), "masked (NaN-poisoned) cache slots leaked into the result"
    torch.testing.assert_close(out, ref, **tol(dtype))
    return out, args, dense


def subset_attention(q, k, v, keys, scale):
    """Attention of one query row q [Hq, D] over the listed key positions of k, v [n, Hkv, D], fp64."""
    Hq, Hkv = q.shape[0], k.shape[1]
    kk = k[keys].double().repeat_interleave(Hq // Hkv, dim=1)  # [len(keys), Hq, D]
    vv = v[keys].double().repeat_interleave(Hq // Hkv, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), kk) * scale, dim=-1)  # [Hq, len(keys)]
    return torch.einsum("hn,nhd->hd", p, vv)  # [Hq, D]


@pytest.mark.interpreter
@pytest.mark.parametrize("tiles", ["interp", "gpu"])
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
def test_prefill_tree_matches_oracle(dtype, tiles, monkeypatch, device, tol, paged_kv):
    if tiles == "gpu":  # the GPU tile sizes (one query tile holds the whole tree), in the interpreter
        real = prefill_mod._pick_config
        monkeypatch.setattr(prefill_mod, "_pick_config", lambda d, dt, gpu: real(d, dt, H100))
    head_case, seqs = PREFILL_TREE
    out, (q, *_, scale), dense = _run_prefill_tree(head_case, seqs, dtype, device, tol, paged_kv)

    # Independently of the oracle: each node's row is attention over the context up to the
    # root plus its path from the root (ancestors and itself); a plain row is causal.
    first = 0
    for (q_len, n, parents), (k, v) in zip(seqs, dense):
        root = n - q_len
        for i in range(q_len):
            if parents is None:
                keys = list(range(root + i + 1))
            else:
                path, node = [], i
                while node > 0:
                    path.append(root + node)
                    node = parents[node]
                keys = list(range(root + 1)) + sorted(path)
            want = subset_attention(q[first + i].cpu(), k.cpu(), v.cpu(), keys, scale)
            torch.testing.assert_close(out[first + i].cpu().double(), want, **tol(dtype))
        first += q_len


@pytest.mark.interpreter
def test_prefill_tree_wrong_mask_changes_output(device, tol, paged_kv):
    """The kernel follows the bits it is given: a chain mask (every earlier node), no tree
    at all, a tree_start one too far and one node's own bit cleared each change the tree's
    rows -- and only the rows whose visible keys change -- and still match the oracle."""
    dtype = torch.float32
    head_case, seqs = PREFILL_TREE
    out, args, _ = _run_prefill_tree(head_case, seqs, dtype, device, tol, paged_kv)
    tree_start, tree_bits = tree_inputs(seqs, device)
    q_len, n, parents = seqs[1]
    rows = slice(seqs[0][0], seqs[0][0] + q_len)  # the big tree's rows (root first)
    chain = torch.tensor([(1 << i) - 1 for i in range(q_len)], dtype=torch.int64, device=device)
    wrong = {
        "chain": (tree_start, torch.cat([tree_bits[:rows.start], chain, tree_bits[rows.stop:]])),
        "no tree": (torch.cat([tree_start[:rows.start],
                               torch.arange(n - q_len + 1, n + 1, dtype=torch.int32, device=device),
                               tree_start[rows.stop:]]), tree_bits),
        "start + 1": (torch.cat([tree_start[:rows.start], tree_start[rows] + 1, tree_start[rows.stop:]]), tree_bits),
        "no self": (tree_start, torch.cat([tree_bits[:rows.start + 7], tree_bits[rows.start + 7:][:1] & ~(1 << 6),
                                           tree_bits[rows.start + 8:]])),
    }
    for name, (ts, tb) in wrong.items():
        got = paged_prefill_attention(*args, tree_start=ts, tree_bits=tb)
        torch.testing.assert_close(got, paged_prefill_attention_ref(*args, tree_start=ts, tree_bits=tb),
                                   **tol(dtype), msg=lambda m: f"{name}: {m}")
        changed = (got - out).abs().amax(dim=(1, 2)) > 1e-3  # [T] rows that moved
        # A row moves exactly when its set of visible keys does (ties have probability 0).
        k_pos = torch.arange(n, device=device)
        q_pos = torch.arange(n - q_len, n, device=device)
        causal = k_pos[None, :] <= q_pos[:, None]
        mask = causal & decode_mod.tree_key_mask(k_pos, tree_start[rows], tree_bits[rows])
        mask_wrong = causal & decode_mod.tree_key_mask(k_pos, ts[rows], tb[rows])
        expect = torch.zeros_like(changed)
        expect[rows] = (mask != mask_wrong).any(dim=1)
        assert expect.any(), name
        assert torch.equal(changed, expect), f"{name}: rows changed {changed.tolist()}, expected {expect.tolist()}"


@pytest.mark.interpreter
def test_prefill_tree_reads_all_64_bits(device, tol, paged_kv):
    """tree_start = position - 63: bit m of each row decides key tree_start + m, m = 0..63,
    bit 63 (the int64 sign bit) included. One row sees only its own key of the region
    (bits = -2**63), one all of it (-1), one none of it (0), two random with the sign bit."""
    Hq, Hkv, D, block_size, q_len, n = PREFILL_TREE_BITS
    dtype = torch.float32
    seqs = [(q_len, n, None)]
    q, k_cache, v_cache, tables, qsl, context_lens, _ = _tree_batch((Hq, Hkv, D, block_size), seqs, dtype,
                                                                    device, paged_kv)
    tree_start = torch.arange(n - q_len, n, dtype=torch.int32, device=device) - 63
    g = torch.Generator().manual_seed(6)
    rand = torch.randint(-(1 << 62), 1 << 62, (2,), generator=g) | (-(1 << 63))
    tree_bits = torch.tensor([-(1 << 63), -1, 0, *rand.tolist()], dtype=torch.int64, device=device)
    assert q_len == 5 and (tree_bits < 0).sum() == 4
    args = (q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
    out = paged_prefill_attention(*args, tree_start=tree_start, tree_bits=tree_bits)
    ref = paged_prefill_attention_ref(*args, tree_start=tree_start, tree_bits=tree_bits)
    torch.testing.assert_close(out, ref, **tol(dtype))
    # Bit 63 matters: clearing it moves the rows that had it (they lose their own key).
    cleared = paged_prefill_attention_ref(*args, tree_start=tree_start, tree_bits=tree_bits & ((1 << 63) - 1))
    moved = (cleared - out).abs().amax(dim=(1, 2)) > 1e-3
    assert moved.tolist() == (tree_bits < 0).tolist()


@pytest.mark.interpreter
def test_prefill_tree_nothing_masked_equals_plain(device, paged_kv):
    """Tree arguments that mask nothing (every query's tree_start past its position) give
    bit for bit the plain kernel's output: the tree term only removes keys."""
    head_case, seqs = PREFILL_TREE
    plain_seqs = [(q_len, n, None) for q_len, n, _ in seqs]
    q, k_cache, v_cache, tables, qsl, context_lens, _ = _tree_batch(head_case, plain_seqs, torch.float32,
                                                                    device, paged_kv)
    args = (q, k_cache, v_cache, tables, qsl, context_lens, head_case[2] ** -0.5)
    tree_start, tree_bits = tree_inputs(plain_seqs, device)
    out = paged_prefill_attention(*args, tree_start=tree_start, tree_bits=tree_bits)
    assert torch.equal(out, paged_prefill_attention(*args))


def _tree_bad_args(device, T=5):
    good_start = torch.zeros(T, dtype=torch.int32, device=device)
    good_bits = torch.zeros(T, dtype=torch.int64, device=device)
    return {
        "only start": (dict(tree_start=good_start), "pass tree_start and tree_bits together"),
        "only bits": (dict(tree_bits=good_bits), "pass tree_start and tree_bits together"),
        "start shape": (dict(tree_start=good_start[:T - 1], tree_bits=good_bits),
                        rf"tree_start must be \[T\]={T}, got shape \({T - 1},\)"),
        "bits 2-d": (dict(tree_start=good_start, tree_bits=good_bits[:, None]),
                     rf"tree_bits must be \[T\]={T}, got shape \({T}, 1\)"),
        "start int64": (dict(tree_start=good_start.long(), tree_bits=good_bits),
                        "tree_start must be int32, got torch.int64"),
        "bits int32": (dict(tree_start=good_start, tree_bits=good_bits.int()),
                       "tree_bits must be int64, got torch.int32"),
        "strided": (dict(tree_start=torch.zeros(2 * T, dtype=torch.int32, device=device)[::2], tree_bits=good_bits),
                    "tree_start must be contiguous"),
        "device": (dict(tree_start=good_start, tree_bits=torch.zeros(T, dtype=torch.int64, device="meta")),
                   "all tensors must be on the same device"),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(_tree_bad_args("cpu")))
def test_prefill_tree_argument_checks(case, device):
    kwargs, message = _tree_bad_args(device)[case]
    k_cache = torch.zeros(4, 8, 2, 32, device=device)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(torch.zeros(5, 4, 32, device=device), k_cache, torch.zeros_like(k_cache),
                                torch.zeros(2, 2, dtype=torch.int32, device=device),
                                torch.tensor([0, 2, 5], dtype=torch.int32, device=device),
                                torch.tensor([3, 4], dtype=torch.int32, device=device), 1.0, **kwargs)


# ----------------------------------------------------------------------------
# GPU: compiled kernels, larger shapes, bf16/fp16
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_splits", DECODE_GPU_SPLITS)
@pytest.mark.parametrize("case", DECODE_GPU_CASES, ids=DECODE_GPU_CASE_IDS)
def test_decode_gpu(case, num_splits, dtype, device, tol, paged_kv):
    _run_decode(case, dtype, num_splits, device, tol, paged_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("case", PREFILL_GPU_CASES, ids=PREFILL_GPU_CASE_IDS)
def test_prefill_gpu(case, dtype, device, tol, paged_kv):
    _run_prefill(*case, PREFILL_GPU_SEQS, dtype, device, tol, paged_kv)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_prefill_with_one_query_equals_decode_gpu(dtype, device, tol, paged_kv):
    Hq, Hkv, D, block_size, lens = PREFILL_EQUALS_DECODE_GPU
    k_cache, v_cache, tables, _ = paged_kv(lens, Hkv, D, block_size, dtype, device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q, qsl = pack_queries([1] * len(lens), Hq, D, dtype, device)
    dec = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, D ** -0.5)
    pre = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, context_lens, D ** -0.5)
    torch.testing.assert_close(pre, dec, **tol(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
def test_prefill_tree_gpu(dtype, device, tol, paged_kv):
    _run_prefill_tree(*PREFILL_TREE_GPU, dtype, device, tol, paged_kv)
