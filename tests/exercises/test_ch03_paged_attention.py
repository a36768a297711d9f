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
    """Contract: the smallest b with b * block_size >= num_tokens; 0 tokens need 0 blocks; exact for any integer."""
    cases = [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (100, 1, 100), (8192, 16, 512), (8193, 16, 513)]
    for n, bs, want in cases:
        got = blocks_needed(n, bs)
        adapters.expect(got, want, f"blocks_needed({n}, {bs}) (ceil({n} / {bs}))")
        adapters.expect_that(isinstance(got, int) and not isinstance(got, bool), f"blocks_needed({n}, {bs})",
                             "an int", type(got).__name__)
    big = 10**18 + 1
    adapters.expect(blocks_needed(big, 2), 5 * 10**17 + 1, f"blocks_needed({big}, 2) (exact: integer arithmetic)")


# ---------------------------------------------------------------- slot_mapping


def test_slot_mapping_example():
    """Contract: position p has slot block_table[p // block_size] * block_size + p % block_size; start .. end-1."""
    # position p lives in slot block_table[p // block_size] * block_size + p % block_size
    adapters.expect(slot_mapping([7, 2, 5], 4, 2, 10), [30, 31, 8, 9, 10, 11, 20, 21],
                    "slot_mapping(block_table [7, 2, 5], block_size 4, positions 2..9)")
    adapters.expect(slot_mapping([7, 2, 5], 4, 5, 5), [],
                    "slot_mapping(block_table [7, 2, 5], block_size 4, start 5, end 5) (no positions)")
    adapters.expect(slot_mapping([3], 16, 9, 10), [57], "slot_mapping(block_table [3], block_size 16, position 9)")


def test_slot_mapping_random_tables():
    """Contract: end - start Python ints in position order, through a block table whose blocks sit anywhere."""
    rng = random.Random(0)
    cases = []
    for _ in range(50):
        bs = rng.choice([1, 2, 8, 16])
        table = rng.sample(range(64), rng.randint(1, 8))
        start = rng.randrange(len(table) * bs)
        end = rng.randint(start, len(table) * bs)
        cases.append((bs, table, start, end))
    for bs, table, start, end in sorted(cases, key=lambda c: (len(c[1]) * c[0], c[3] - c[2])):  # smallest first
        got = slot_mapping(table, bs, start, end)
        want = []
        for p in range(start, end):  # the definition, one position at a time
            want.append(table[p // bs] * bs + p % bs)
        adapters.expect(got, want, f"slot_mapping(block_table {table}, block_size {bs}, positions {start}..{end - 1})")
        flat = [s for b in table for s in range(b * bs, b * bs + bs)]
        every = slot_mapping(table, bs, 0, len(table) * bs)
        adapters.expect_that(len(set(every)) == len(flat),
                             f"slot_mapping(block_table {table}, block_size {bs}, positions 0..{len(flat) - 1})",
                             f"{len(flat)} distinct slots", f"{len(set(every))} distinct: {every}")


# ---------------------------------------------------------------- allocate / free


def test_allocate_takes_from_the_front():
    """Contract: the first n ids of free_list, in order, removed from it, each with count 1; n == 0 returns []."""
    free, refs = [3, 0, 1, 2], [0, 0, 0, 0]
    what = "allocate_blocks(free [3, 0, 1, 2], refs [0, 0, 0, 0], n=2)"
    adapters.expect(allocate_blocks(free, refs, 2), [3, 0], f"{what}: blocks returned")
    adapters.expect(free, [1, 2], f"{what}: free list after the call")
    adapters.expect(refs, [1, 0, 0, 1], f"{what}: reference counts after the call")
    what = "allocate_blocks(free [1, 2], refs [1, 0, 0, 1], n=0)"
    adapters.expect(allocate_blocks(free, refs, 0), [], f"{what}: blocks returned")
    adapters.expect(free, [1, 2], f"{what}: free list after the call")


def test_allocate_is_all_or_nothing():
    """Contract: with fewer than n free blocks, raise RuntimeError and leave both lists unchanged."""
    free, refs = [5, 6], [0] * 8
    what = "allocate_blocks(free [5, 6], refs [0] * 8, n=3)"
    adapters.expect_raises(RuntimeError, what, allocate_blocks, free, refs, 3)
    adapters.expect(free, [5, 6], f"{what}: free list after the failed call")
    adapters.expect(refs, [0] * 8, f"{what}: reference counts after the failed call")


def test_free_returns_blocks_to_the_back():
    """Contract: each count drops by one; a block whose count reaches 0 is appended to the END of free_list."""
    free, refs = [4], [1, 1, 0, 1, 0]
    what = "free_blocks(free [4], refs [1, 1, 0, 1, 0], blocks [3, 0])"
    free_blocks(free, refs, [3, 0])
    adapters.expect(free, [4, 3, 0], f"{what}: free list after the call")
    adapters.expect(refs, [0, 1, 0, 0, 0], f"{what}: reference counts after the call")


def test_shared_blocks_and_double_free():
    """Contract: a shared block is free only when its last holder frees it; a double free raises ValueError."""
    free, refs = [], [2, 1]  # block 0 is shared by two block tables
    free_blocks(free, refs, [0])
    what = "free_blocks(free [], refs [2, 1], blocks [0])"
    adapters.expect((free, refs), ([], [1, 1]), f"{what}: (free list, reference counts) after the call")
    free_blocks(free, refs, [0, 1])
    what = "free_blocks(free [], refs [1, 1], blocks [0, 1])"
    adapters.expect((free, refs), ([0, 1], [0, 0]), f"{what}: (free list, reference counts) after the call")
    what = "free_blocks(free [0, 1], refs [0, 0], blocks [1]) (block 1 is already free)"
    adapters.expect_raises(ValueError, what, free_blocks, free, refs, [1])
    adapters.expect((free, refs), ([0, 1], [0, 0]), f"{what}: (free list, reference counts) after the failed call")


def test_allocator_random_operations():
    """Contract: after any allocations, shares and frees, counts are holders and the free list holds the rest."""
    rng = random.Random(1)
    n = 16
    free, refs = list(range(n)), [0] * n
    held: list[int] = []  # one entry per reference
    for step in range(2000):
        op = "nothing"
        if rng.random() < 0.5:
            k = rng.randint(0, 4)
            op = f"allocate_blocks(free {free}, n={k})"
            if k <= len(free):
                held += allocate_blocks(free, refs, k)
            else:
                adapters.expect_raises(RuntimeError, f"operation {step}: {op} (too few free blocks)",
                                       allocate_blocks, free, refs, k)
        elif held and rng.random() < 0.2:
            b = rng.choice(held)  # share a block: what a fork does
            op = f"refs[{b}] += 1 (a second holder)"
            refs[b] += 1
            held.append(b)
        elif held:
            b = held.pop(rng.randrange(len(held)))
            op = f"free_blocks(free {free}, blocks [{b}])"
            free_blocks(free, refs, [b])
        counts = [held.count(b) for b in range(n)]
        adapters.expect(refs, counts, f"operation {step}, {op}: reference counts after it (one per holder)")
        adapters.expect(sorted(free), [b for b in range(n) if counts[b] == 0],
                        f"operation {step}, {op}: the free list after it, sorted (the blocks nobody holds)")


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
    """Contract: m = max(s), l = sum(exp(s - m)), acc = sum(exp(s - m) * v); old terms rescaled by exp(m - m_new)."""
    g = _gen(2)
    H, N, D = 3, 40, 8
    scores = 2 * torch.randn(H, N, generator=g)
    v = torch.randn(N, H, D, generator=g)
    for cuts in ([0, 40], [0, 16, 32, 40], [0, 1, 2, 3, 39, 40], [0, 7, 9, 30, 40]):
        m, l, acc = _fold(scores, v, cuts)
        what = f"online_softmax_update folded over key blocks {cuts} ({H} heads, {N} keys, D={D})"
        for name, t, shape in (("m", m, (H,)), ("l", l, (H,)), ("acc", acc, (H, D))):
            adapters.expect(adapters.shape_of(t), shape, f"{what}: shape of {name}")
        adapters.expect_close(m.double(), scores.double().max(-1).values, f"{what}: m vs the max of the scores",
                              atol=1e-6, rtol=0)
        adapters.expect_close(l.double(), (scores.double() - m.double()[:, None]).exp().sum(-1),
                              f"{what}: l vs sum(exp(scores - m))", atol=1e-5, rtol=1e-5)
        adapters.expect_close((acc / l[:, None]).double(), _dense(scores, v),
                              f"{what}: acc / l vs softmax(scores) @ v", atol=1e-5, rtol=1e-5,
                              note="a new block rescales the old l and acc by exp(m_old - m_new)")


def test_online_softmax_large_scores_and_masked_blocks():
    """Contract: never computes exp of a large positive number; a head whose scores are all -inf so far gets no NaN."""
    g = _gen(3)
    H, N, D = 2, 24, 4
    scores = 1000 + 5 * torch.randn(H, N, generator=g)  # exp(1000) overflows: subtract the max first
    scores[0, :8] = -math.inf  # head 0 sees a fully masked first block
    scores[1, 20:] = -math.inf  # head 1: a fully masked last block
    v = torch.randn(N, H, D, generator=g)
    m, l, acc = _fold(scores, v, [0, 8, 16, 24])
    what = ("online_softmax_update over key blocks [0, 8, 16, 24], scores ~1000, head 0's first block "
            "and head 1's last block all -inf")
    for name, t in (("acc", acc), ("l", l)):
        adapters.expect_that(torch.isfinite(t).all(), f"{what}: {name}", "finite values",
                             f"{t.tolist()}", note="exp of scores ~1000 overflows unless the running max is "
                             "subtracted first; a head whose max is still -inf needs a guard")
    adapters.expect_close((acc / l[:, None]).double(), _dense(scores, v), f"{what}: acc / l vs softmax(scores) @ v",
                          atol=1e-4, rtol=1e-4)


def test_online_softmax_all_masked_so_far():
    """Contract: a head whose scores are all -inf so far keeps m = -inf, l = 0, acc = 0, and no NaN appears."""
    H, D = 2, 4
    m, l, acc = torch.full((H,), -math.inf), torch.zeros(H), torch.zeros(H, D)
    scores = torch.full((H, 3), -math.inf)
    m, l, acc = online_softmax_update(m, l, acc, scores, torch.ones(3, H, D))
    what = "online_softmax_update(m = -inf, l = 0, acc = 0, a block of scores all -inf)"
    for name, t in (("m", m), ("l", l), ("acc", acc)):
        adapters.expect_that(not torch.isnan(t).any(), f"{what}: {name}", "no NaN", t.tolist(),
                             note="exp(-inf - -inf) is NaN: a head whose max is -inf needs a guard")
    adapters.expect(l.tolist(), [0.0] * H, f"{what}: l")
    adapters.expect(acc.tolist(), [[0.0] * D] * H, f"{what}: acc")


def test_online_softmax_returns_float32():
    """Contract: returns the new (m, l, acc), float32, whatever the dtype of the scores and values."""
    g = _gen(6)
    H, N, D = 2, 5, 4
    scores = torch.randn(H, N, generator=g, dtype=torch.float64)
    v = torch.randn(N, H, D, generator=g).to(torch.bfloat16)
    m, l, acc = torch.full((H,), -math.inf), torch.zeros(H), torch.zeros(H, D)
    got = online_softmax_update(m, l, acc, scores, v)
    what = "online_softmax_update(float32 state, float64 scores [2, 5], bfloat16 v [5, 2, 4])"
    for name, t in zip(("m", "l", "acc"), got):
        adapters.expect(getattr(t, "dtype", type(t).__name__), torch.float32, f"{what}: dtype of {name}")


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
    """Contract: out[h] = softmax(scale * q[h] . K^T) @ V over K/V head h // (Hq // Hkv), in block-table order."""
    g = _gen(4)
    D, num_blocks = 16, 24
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    need = -(-n // block_size)
    table = torch.randperm(num_blocks, generator=g)[:need].tolist()  # blocks in random order
    q = torch.randn(Hq, D, generator=g)
    out = paged_decode_attention(q, k_cache, v_cache, table, n, D ** -0.5)
    what = (f"paged_decode_attention(q [{Hq}, {D}], {Hkv} KV heads, block_size {block_size}, block_table {table}, "
            f"context_len {n})")
    adapters.expect(adapters.shape_of(out), (Hq, D), f"{what}: shape")
    adapters.expect(out.dtype, q.dtype, f"{what}: dtype")
    adapters.expect_close(out.double(), _reference(q, k_cache, v_cache, table, n, D ** -0.5),
                          f"{what} vs dense float64 attention", atol=1e-5, rtol=1e-5,
                          note="attention over the request's keys in block-table order, positions >= context_len "
                               "masked")


def test_paged_decode_attention_ignores_garbage_and_unused_table_entries():
    """Contract: slots past context_len may hold NaN; only the first blocks_needed(context_len) entries are read."""
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
    what = ("paged_decode_attention(block_table [5, 1, 99, -1], block_size 4, context_len 6; "
            "slots past position 5 hold 1e4 keys and NaN values)")
    adapters.expect(adapters.shape_of(out), (Hq, D), f"{what}: shape")
    adapters.expect_that(torch.isfinite(out).all(), what, "finite values", f"{int((~torch.isfinite(out)).sum())} "
                         f"of {out.numel()} values inf or NaN")
    adapters.expect_close(out.double(), want, f"{what} vs dense float64 attention over the 6 positions",
                          atol=1e-5, rtol=1e-5, note="only the first ceil(context_len / block_size) table entries "
                                                     "and the first context_len positions count")


# ---------------------------------------------------------------- choose_victim


def test_choose_victim_is_the_newest_and_leaves_the_list_alone():
    """Contract: return the request admitted LAST (the end of running, oldest first); never modify the list."""
    from minillm.request import Request
    from minillm.sampling_params import SamplingParams

    # Requests of different sizes and progress, so that "admitted last" is not also the
    # shortest, the longest or the least computed one in every case.
    sizes = [(6, 3), (2, 0), (9, 8), (4, 1)]  # (prompt tokens, tokens computed)
    requests = []
    for i, (prompt, computed) in enumerate(sizes):
        r = Request(str(i), [1] * prompt, SamplingParams(max_tokens=4))
        r.num_computed_tokens = computed
        requests.append(r)
    cases = [requests, requests[:1], requests[:2], requests[:3], [requests[2], requests[0], requests[3]]]
    # every request is the right answer in some case: a fixed position or size rule fails
    assert {c[-1].request_id for c in cases} == {r.request_id for r in requests}
    for case in cases:
        running = list(case)  # each call gets its own list: a call that modifies it spoils no other case
        before = list(running)
        want = running[-1]
        what = f"choose_victim(running {[r.request_id for r in running]}, oldest first)"
        got = choose_victim(running)
        adapters.expect_that(got is want, what, f"request {want.request_id} (admitted last)",
                             f"request {got.request_id}" if isinstance(got, Request) else repr(got))
        adapters.expect([r.request_id for r in running], [r.request_id for r in before],
                        f"{what}: the running list after the call")
        adapters.expect_that(all(a is b for a, b in zip(running, before)), f"{what}: the running list after the call",
                             "the same request objects", "other objects")


# ---------------------------------------------------------------- store_kv_triton (Triton interpreter)


def _store_ref(k, v, k_cache, v_cache, slots):
    H, D = k_cache.shape[2:]
    kc, vc = k_cache.clone().view(-1, H, D), v_cache.clone().view(-1, H, D)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kc[s], vc[s] = k[t], v[t]
    return kc.view_as(k_cache), vc.view_as(v_cache)


def test_store_kv_triton_writes_the_edges_of_the_cache():
    """Contract: row slot_mapping[t] <- k[t] (v[t]) for every slot >= 0, slot 0 included; a slot of -1 is skipped."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(7)
    H, D, block_size, num_blocks = 2, 8, 4, 3
    slots = torch.tensor([0, num_blocks * block_size - 1, -1, block_size])  # first slot, last slot, padding, block 1
    k = torch.randn(4, H, D, generator=g)
    v = torch.randn(4, H, D, generator=g)
    k_cache = torch.full((num_blocks, block_size, H, D), float("nan"))
    v_cache = torch.full((num_blocks, block_size, H, D), float("nan"))
    want_k, want_v = _store_ref(k, v, k_cache, v_cache, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    what = f"store_kv_triton(T=4, {H} heads, D={D}, block_size {block_size}, slot_mapping {slots.tolist()})"
    note = "slot 0 is a real slot (block 0, offset 0); only -1 marks a padding token"
    adapters.expect_close(k_cache, want_k, f"{what}: k_cache", equal_nan=True, note=note)
    adapters.expect_close(v_cache, want_v, f"{what}: v_cache", equal_nan=True, note=note)


@pytest.mark.parametrize("H,D,block_size,T", [(1, 16, 8, 1), (2, 8, 4, 5), (3, 64, 16, 7)])
def test_store_kv_triton_writes_each_token_to_its_slot(H, D, block_size, T):
    """Contract: the flat cache gets row slot_mapping[t] <- k[t] (v[t]); every other slot is left untouched."""
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
    what = f"store_kv_triton(T={T}, {H} heads, D={D}, block_size {block_size}, slot_mapping {slots.tolist()})"
    note = "cache row slot_mapping[t] holds k[t] (v[t]); a slot of -1 writes nothing; other rows keep their NaN"
    adapters.expect_close(k_cache, want_k, f"{what}: k_cache", equal_nan=True, note=note)
    adapters.expect_close(v_cache, want_v, f"{what}: v_cache", equal_nan=True, note=note)


def test_store_kv_triton_reads_strided_rows():
    """Contract: k, v [T, Hkv, D] have head_dim contiguous but their rows may be strided."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, 3 * 2, 16, generator=g)  # a fused projection: k is a strided view of it
    k, v = qkv[:, 2:4], qkv[:, 4:6]
    slots = torch.tensor([9, 0, 31, 17])
    k_cache = torch.zeros(4, 8, 2, 16)
    v_cache = torch.zeros(4, 8, 2, 16)
    want_k, want_v = _store_ref(k, v, k_cache, v_cache, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    what = "store_kv_triton(k, v strided views of a fused [4, 6, 16] projection, slot_mapping [9, 0, 31, 17])"
    note = "k.stride(0) and k.stride(1) locate a row of a strided k (v)"
    adapters.expect_close(k_cache, want_k, f"{what}: k_cache", note=note)
    adapters.expect_close(v_cache, want_v, f"{what}: v_cache", note=note)


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() returns a dict {question id: answer}; each answer matches the question's."""
    answers = quiz_answers()
    adapters.expect_that(isinstance(answers, dict), "quiz_answers()", "a dict of answers", type(answers).__name__)
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:  # the right answer is kept secret (a digest): the line says what was given
        pytest.fail(why, pytrace=False)
