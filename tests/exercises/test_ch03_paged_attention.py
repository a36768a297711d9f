"""Grades exercises/ch03_paged_attention.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python, dense float64 attention), never taken from
minillm, so the tests stay meaningful for the solutions that wrap minillm. Small
sizes and seeded generators: the whole file runs in about a second.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch03_paged_attention"
blocks_needed = adapters.function(CHAPTER, "blocks_needed")
slot_mapping = adapters.function(CHAPTER, "slot_mapping")
allocate_blocks = adapters.function(CHAPTER, "allocate_blocks")
free_blocks = adapters.function(CHAPTER, "free_blocks")
online_softmax_update = adapters.function(CHAPTER, "online_softmax_update")
paged_decode_attention = adapters.function(CHAPTER, "paged_decode_attention")
choose_victim = adapters.function(CHAPTER, "choose_victim")
store_kv_triton = adapters.function(CHAPTER, "store_kv_triton")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- blocks_needed


def test_blocks_needed():
    cases = [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (100, 1, 100), (8192, 16, 512), (8193, 16, 513)]
    for n, bs, want in cases:
        got = blocks_needed(n, bs)
        assert got == want and isinstance(got, int), (
            f"blocks_needed({n}, {bs}) must be ceil({n} / {bs}) = {want} (an int), got {got!r}")
    big = 10**18 + 1
    assert blocks_needed(big, 2) == 5 * 10**17 + 1, "use integer arithmetic: float division loses precision"


# ---------------------------------------------------------------- slot_mapping


def test_slot_mapping_example():
    got = slot_mapping([7, 2, 5], 4, 2, 10)
    assert got == [30, 31, 8, 9, 10, 11, 20, 21], (
        "position p lives in slot block_table[p // block_size] * block_size + p % block_size; "
        f"for table [7, 2, 5], block_size 4, positions 2..9 expected [30, 31, 8, 9, 10, 11, 20, 21], got {got}")
    assert slot_mapping([7, 2, 5], 4, 5, 5) == [], "an empty range of positions maps to no slots"
    assert slot_mapping([3], 16, 9, 10) == [57], "a decode step asks for the slot of one position"


def test_slot_mapping_random_tables():
    rng = random.Random(0)
    for _ in range(50):
        bs = rng.choice([1, 2, 8, 16])
        table = rng.sample(range(64), rng.randint(1, 8))
        start = rng.randrange(len(table) * bs)
        end = rng.randint(start, len(table) * bs)
        got = slot_mapping(table, bs, start, end)
        want = []
        for p in range(start, end):  # the definition, one position at a time
            want.append(table[p // bs] * bs + p % bs)
        assert got == want, f"table {table}, block_size {bs}, positions {start}..{end - 1}: expected {want}, got {got}"
        flat = [s for b in table for s in range(b * bs, b * bs + bs)]
        assert len(set(slot_mapping(table, bs, 0, len(table) * bs))) == len(flat), \
            "distinct positions of one request must map to distinct slots"


# ---------------------------------------------------------------- allocate / free


def test_allocate_takes_from_the_front():
    free, refs = [3, 0, 1, 2], [0, 0, 0, 0]
    got = allocate_blocks(free, refs, 2)
    assert got == [3, 0], f"allocate_blocks must hand out the first n free blocks in order, got {got}"
    assert free == [1, 2], f"the allocated blocks leave the free list (in place); free list is now {free}"
    assert refs == [1, 0, 0, 1], f"each allocated block gets reference count 1; counts are {refs}"
    assert allocate_blocks(free, refs, 0) == [] and free == [1, 2]


def test_allocate_is_all_or_nothing():
    free, refs = [5, 6], [0] * 8
    with pytest.raises(RuntimeError):
        allocate_blocks(free, refs, 3)
    assert free == [5, 6] and refs == [0] * 8, (
        "a failed allocation (too few free blocks) must raise RuntimeError and change nothing")


def test_free_returns_blocks_to_the_back():
    free, refs = [4], [1, 1, 0, 1, 0]
    free_blocks(free, refs, [3, 0])
    assert free == [4, 3, 0], f"freed blocks are appended to the end of the free list, in order; got {free}"
    assert refs == [0, 1, 0, 0, 0]


def test_shared_blocks_and_double_free():
    free, refs = [], [2, 1]  # block 0 is shared by two block tables
    free_blocks(free, refs, [0])
    assert free == [] and refs == [1, 1], "a block with 2 holders stays allocated when one of them frees it"
    free_blocks(free, refs, [0, 1])
    assert free == [0, 1] and refs == [0, 0]
    with pytest.raises(ValueError):
        free_blocks(free, refs, [1])
    assert free == [0, 1] and refs == [0, 0], "a double free must raise ValueError, not corrupt the state"


def test_allocator_random_operations():
    rng = random.Random(1)
    n = 16
    free, refs = list(range(n)), [0] * n
    held: list[int] = []  # one entry per reference
    for step in range(2000):
        if rng.random() < 0.5:
            k = rng.randint(0, 4)
            if k <= len(free):
                held += allocate_blocks(free, refs, k)
            else:
                with pytest.raises(RuntimeError):
                    allocate_blocks(free, refs, k)
        elif held and rng.random() < 0.2:
            b = rng.choice(held)  # share a block: what a fork does
            refs[b] += 1
            held.append(b)
        elif held:
            b = held.pop(rng.randrange(len(held)))
            free_blocks(free, refs, [b])
        counts = [held.count(b) for b in range(n)]
        assert refs == counts, f"step {step}: reference counts {refs} differ from the holders {counts}"
        assert sorted(free) == [b for b in range(n) if counts[b] == 0], (
            f"step {step}: the free list must hold exactly the blocks nobody holds (no leak, no duplicate)")


# ---------------------------------------------------------------- online softmax


def _dense(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(scores) @ v in float64: scores [H, N], v [N, H, D] -> [H, D]."""
    p = torch.softmax(scores.double(), dim=-1)
    return torch.einsum("hn,nhd->hd", p, v.double())


def _fold(scores: torch.Tensor, v: torch.Tensor, cuts: list[int]):
    H, D = scores.shape[0], v.shape[-1]
    m, l, acc = torch.full((H,), -math.inf), torch.zeros(H), torch.zeros(H, D)
    for a, b in zip(cuts, cuts[1:]):
        m, l, acc = online_softmax_update(m, l, acc, scores[:, a:b], v[a:b])
    return m, l, acc


def test_online_softmax_equals_dense():
    g = _gen(2)
    H, N, D = 3, 40, 8
    scores = 2 * torch.randn(H, N, generator=g)
    v = torch.randn(N, H, D, generator=g)
    for cuts in ([0, 40], [0, 16, 32, 40], [0, 1, 2, 3, 39, 40], [0, 7, 9, 30, 40]):
        m, l, acc = _fold(scores, v, cuts)
        for name, t, shape in (("m", m, (H,)), ("l", l, (H,)), ("acc", acc, (H, D))):
            assert isinstance(t, torch.Tensor) and t.shape == shape, f"{name} must be shaped {shape}"
        torch.testing.assert_close(m.double(), scores.double().max(-1).values, atol=1e-6, rtol=0,
                                   msg=lambda s: "m must be the running max of the scores\n" + s)
        torch.testing.assert_close(l.double(), (scores.double() - m.double()[:, None]).exp().sum(-1),
                                   atol=1e-5, rtol=1e-5, msg=lambda s: "l must be sum(exp(s - m))\n" + s)
        torch.testing.assert_close(
            (acc / l[:, None]).double(), _dense(scores, v), atol=1e-5, rtol=1e-5,
            msg=lambda s: f"blocks {cuts}: acc / l must equal softmax(scores) @ v; "
                          "rescale the old l and acc by exp(m_old - m_new)\n" + s)


def test_online_softmax_large_scores_and_masked_blocks():
    g = _gen(3)
    H, N, D = 2, 24, 4
    scores = 1000 + 5 * torch.randn(H, N, generator=g)  # exp(1000) overflows: subtract the max first
    scores[0, :8] = -math.inf  # head 0 sees a fully masked first block
    scores[1, 20:] = -math.inf  # head 1: a fully masked last block
    v = torch.randn(N, H, D, generator=g)
    m, l, acc = _fold(scores, v, [0, 8, 16, 24])
    assert torch.isfinite(acc).all() and torch.isfinite(l).all(), (
        "no inf or NaN allowed: subtract the running max before exp, and guard heads whose max is still -inf")
    torch.testing.assert_close((acc / l[:, None]).double(), _dense(scores, v), atol=1e-4, rtol=1e-4)


def test_online_softmax_all_masked_so_far():
    H, D = 2, 4
    m, l, acc = torch.full((H,), -math.inf), torch.zeros(H), torch.zeros(H, D)
    scores = torch.full((H, 3), -math.inf)
    m, l, acc = online_softmax_update(m, l, acc, scores, torch.ones(3, H, D))
    assert not torch.isnan(m).any() and not torch.isnan(l).any() and not torch.isnan(acc).any(), (
        "a block where every key is masked must not produce NaN (exp(-inf - -inf) is NaN: guard it)")
    assert torch.equal(l, torch.zeros(H)) and torch.equal(acc, torch.zeros(H, D)), (
        "after only masked keys the state stays l = 0, acc = 0")


# ---------------------------------------------------------------- paged decode attention


def _reference(q, k_cache, v_cache, table, n, scale):
    """Gather the request's first n tokens in position order, then dense attention in float64."""
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    Hq = q.shape[0]
    k = torch.cat([k_cache[b] for b in table])[:n].double()  # [n, Hkv, D]
    v = torch.cat([v_cache[b] for b in table])[:n].double()
    k = k.repeat_interleave(Hq // Hkv, dim=1)  # [n, Hq, D]
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size, n, Hq, Hkv", [(4, 13, 6, 2), (8, 8, 4, 4), (16, 1, 3, 1), (2, 31, 8, 2)],
                         ids=["ragged-gqa", "one-full-block-mha", "single-token", "many-blocks"])
def test_paged_decode_attention(block_size, n, Hq, Hkv):
    g = _gen(4)
    D, num_blocks = 16, 24
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    need = -(-n // block_size)
    table = torch.randperm(num_blocks, generator=g)[:need].tolist()  # blocks in random order
    q = torch.randn(Hq, D, generator=g)
    out = paged_decode_attention(q, k_cache, v_cache, table, n, D ** -0.5)
    assert isinstance(out, torch.Tensor) and out.shape == (Hq, D), f"the output must be [Hq, D] = {(Hq, D)}"
    assert out.dtype == q.dtype, f"the output must have q's dtype {q.dtype}, got {out.dtype}"
    torch.testing.assert_close(
        out.double(), _reference(q, k_cache, v_cache, table, n, D ** -0.5), atol=1e-5, rtol=1e-5,
        msg=lambda s: f"{n} tokens in blocks of {block_size}, {Hq} query heads over {Hkv} KV heads: attention "
                      "over the request's keys in block-table order, positions >= context_len masked\n" + s)


def test_paged_decode_attention_ignores_garbage_and_unused_table_entries():
    g = _gen(5)
    bs, Hkv, Hq, D, n = 4, 1, 2, 8, 6
    k_cache = torch.randn(6, bs, Hkv, D, generator=g)
    v_cache = torch.randn(6, bs, Hkv, D, generator=g)
    q = torch.randn(Hq, D, generator=g)
    table = [5, 1]
    want = _reference(q, k_cache, v_cache, table, n, 0.3)
    k_cache[1, 2:] = 1e4  # slots past context_len: stale K/V of an earlier request
    v_cache[1, 2:] = float("nan")
    out = paged_decode_attention(q, k_cache, v_cache, table + [99, -1], n, 0.3)
    assert torch.isfinite(out).all(), "slots at or past context_len must not reach the output (mask them)"
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5,
                               msg=lambda s: "only the first ceil(context_len / block_size) table entries "
                                             "and the first context_len positions count\n" + s)


# ---------------------------------------------------------------- choose_victim


def test_choose_victim_is_the_newest_and_leaves_the_list_alone():
    from minillm.request import Request
    from minillm.sampling_params import SamplingParams

    running = [Request(str(i), [1, 2], SamplingParams(max_tokens=4)) for i in range(4)]
    before = list(running)
    assert choose_victim(running) is running[-1], "preempt the request admitted last (least work lost)"
    assert running == before, "choose_victim must not modify the running list"
    assert choose_victim(running[:1]) is running[0]


# ---------------------------------------------------------------- store_kv_triton (Triton interpreter)


def _store_ref(k, v, k_cache, v_cache, slots):
    H, D = k_cache.shape[2:]
    kc, vc = k_cache.clone().view(-1, H, D), v_cache.clone().view(-1, H, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s], vc[s] = k[t], v[t]
    return kc.view_as(k_cache), vc.view_as(v_cache)


@pytest.mark.parametrize("H,D,block_size,T", [(3, 64, 16, 7), (2, 8, 4, 5), (1, 16, 8, 1)])
def test_store_kv_triton_writes_each_token_to_its_slot(H, D, block_size, T):
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(H * 100 + T)
    num_blocks = 6
    k = torch.randn(T, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    if T > 2:
        slots[1] = -1  # a padding token: nothing written
    k_cache = torch.full((num_blocks, block_size, H, D), float("nan"))
    v_cache = torch.full((num_blocks, block_size, H, D), float("nan"))
    want_k, want_v = _store_ref(k, v, k_cache, v_cache, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, want_k, equal_nan=True,
                               msg=lambda m: "k_cache row slot_mapping[t] must hold k[t]; other rows untouched\n" + m)
    torch.testing.assert_close(v_cache, want_v, equal_nan=True)


def test_store_kv_triton_reads_strided_rows():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, 3 * 2, 16, generator=g)  # a fused projection: k is a strided view of it
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([9, 0, 31, 17])
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    want_k, want_v = _store_ref(k, v, k_cache, v_cache, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, want_k, msg=lambda m: "use k.stride(0) and k.stride(1): rows may be strided\n" + m)
    torch.testing.assert_close(v_cache, want_v)


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
