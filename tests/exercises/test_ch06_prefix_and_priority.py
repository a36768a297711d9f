"""Grades exercises/ch06_prefix_and_priority.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here in plain Python, never taken from minillm, so the tests stay
meaningful for the solutions. The whole file runs in about a second.
"""
from __future__ import annotations

import random

import pytest

import adapters

pytestmark = pytest.mark.exercises

CHAPTER = "ch06_prefix_and_priority"
longest_cached_prefix = adapters.function(CHAPTER, "longest_cached_prefix")
allocate_blocks = adapters.function(CHAPTER, "allocate_blocks")
admission_order = adapters.function(CHAPTER, "admission_order")


def chain(tokens, bs):
    out, h = [], 0
    for i in range(len(tokens) // bs):
        h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
        out.append(h)
    return out


# ---------------------------------------------------------------- longest_cached_prefix


def test_lookup_example():
    toks = [5, 6, 7, 8, 9]
    h = chain(toks, 2)
    got = longest_cached_prefix(toks, 2, {h[0]: 4, h[1]: 1})
    assert got == [4, 1], f"both full blocks are cached (blocks 4 and 1): expected [4, 1], got {got}"


def test_lookup_is_a_chain_not_a_set_of_blocks():
    a, b = [1, 2, 3, 4], [9, 9, 3, 4]
    ha = chain(a, 2)
    assert longest_cached_prefix(b, 2, {ha[0]: 0, ha[1]: 1}) == [], \
        "block [3, 4] after [9, 9] is not block [3, 4] after [1, 2]: its hash must include its parent's"
    assert longest_cached_prefix(a, 2, {ha[1]: 1}) == [], "stop at the first miss: block 1 is useless without block 0"
    assert longest_cached_prefix(a, 4, {}) == []


def test_lookup_max_blocks_and_partial_blocks():
    toks = list(range(10))
    h = chain(toks, 3)  # 3 full blocks; the 10th token is a partial block, never cached
    cached = {x: i + 20 for i, x in enumerate(h)}
    assert longest_cached_prefix(toks, 3, cached) == [20, 21, 22]
    assert longest_cached_prefix(toks, 3, cached, 2) == [20, 21], "max_blocks caps the run"
    assert longest_cached_prefix(toks[:9], 3, cached, (9 - 1) // 3) == [20, 21], \
        "the engine's cap leaves the last prompt token to compute"


def test_lookup_random():
    rng = random.Random(0)
    for _ in range(200):
        bs = rng.choice([1, 2, 4])
        base = [rng.randrange(5) for _ in range(rng.randint(0, 12))]
        cached = {}
        for j in range(3):  # a few cached prompts sharing parts of ``base``
            p = base[:rng.randint(0, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
            for i, x in enumerate(chain(p, bs)):
                cached.setdefault(x, 100 * j + i)
        q = base[:rng.randint(0, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        want = []
        for x in chain(q, bs):
            if x not in cached:
                break
            want.append(cached[x])
        before = dict(cached)
        assert longest_cached_prefix(list(q), bs, cached) == want, f"tokens {q}, block size {bs}"
        assert cached == before, "longest_cached_prefix must not modify cached"


# ---------------------------------------------------------------- allocate_blocks


def test_allocate_example():
    got = allocate_blocks([7], [3, 5, 1], 3)
    assert got == ([7, 3, 5], [3, 5]) or tuple(got) == ([7, 3, 5], [3, 5]), (
        f"the never-cached block 7 first, then evict the least recently used 3 and 5: expected "
        f"([7, 3, 5], [3, 5]), got {got}")


def test_allocate_prefers_never_cached_blocks():
    blocks, evicted = allocate_blocks([2, 0, 9], [4, 6], 2)
    assert list(blocks) == [2, 0] and list(evicted) == [], "no eviction while never-cached blocks are free"
    blocks, evicted = allocate_blocks([], [4, 6, 8], 3)
    assert list(blocks) == [4, 6, 8] == list(evicted)
    assert tuple(map(list, allocate_blocks([1], [2], 0))) == ([], [])


def test_allocate_too_many_and_inputs_untouched():
    free, ev = [1, 2], [3]
    with pytest.raises(ValueError):
        allocate_blocks(free, ev, 4)
    allocate_blocks(free, ev, 3)
    assert free == [1, 2] and ev == [3], "allocate_blocks must not modify its inputs"


def test_allocate_random():
    rng = random.Random(1)
    for _ in range(200):
        ids = rng.sample(range(30), rng.randint(0, 12))
        k = rng.randint(0, len(ids))
        free, ev = ids[:k], ids[k:]
        n = rng.randint(0, len(ids))
        blocks, evicted = allocate_blocks(list(free), list(ev), n)
        want = (free + ev)[:n]
        assert list(blocks) == want and list(evicted) == [b for b in want if b in ev], (free, ev, n)


# ---------------------------------------------------------------- admission_order

T = {0: 0.05, 1: 0.2, 2: 1.0}


def test_admission_example():
    got = admission_order([("i_new", 0, 1.98), ("b_old", 2, 0.0), ("s_old", 1, 1.7)], 2.0, T)
    assert got == ["s_old", "b_old", "i_new"], (
        f"b_old and s_old waited past their timeouts (standard before batch), i_new did not: "
        f"expected ['s_old', 'b_old', 'i_new'], got {got}")


def test_admission_classes_then_queue_order():
    w = [("b1", 2, 0.0), ("s1", 1, 0.0), ("i1", 0, 0.0), ("b2", 2, 0.0), ("i2", 0, 0.0), ("later", 0, 9.0)]
    assert admission_order(w, 0.01, T) == ["i1", "i2", "s1", "b1", "b2"], \
        "lower level first, queue order within a level; a request that has not arrived is left out"
    assert admission_order(w, 0.01, T) == admission_order(list(w), 0.01, T)


def test_admission_timeout_is_strict():
    assert admission_order([("a", 1, 0.0), ("b", 0, 0.19)], 0.2, T) == ["b", "a"], \
        "a waited exactly its 0.2 s timeout: not past it, so the higher class goes first"
    assert admission_order([("a", 1, 0.0), ("b", 0, 0.22)], 0.25, T) == ["a", "b"], \
        "a waited past its timeout, b did not: a first, whatever the classes"


def test_admission_random():
    rng = random.Random(2)
    for _ in range(300):
        w = [(f"r{i}", rng.randint(0, 2), round(rng.uniform(0, 3), 2)) for i in range(rng.randint(0, 8))]
        now = round(rng.uniform(0, 3), 2)
        keyed = [((0 if now - t > T[lv] else 1), lv, i, rid) for i, (rid, lv, t) in enumerate(w) if t <= now]
        want = [k[-1] for k in sorted(keyed)]
        assert admission_order(list(w), now, T) == want, f"waiting {w} at {now}"
