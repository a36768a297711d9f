"""Grades exercises/ch06_prefix_and_priority.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here in plain Python, never taken from minillm, so the tests stay
meaningful for the solutions. Every failure is one line: what was checked, what was
expected and what came back (``adapters.expect``). The whole file runs in about a second.
"""
from __future__ import annotations

import random

import pytest

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch06_prefix_and_priority"
longest_cached_prefix = adapters.function(CHAPTER, "longest_cached_prefix")
allocate_with_eviction = adapters.function(CHAPTER, "allocate_with_eviction")
admission_order = adapters.function(CHAPTER, "admission_order")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def chain(tokens, bs):
    out, h = [], 0
    for i in range(len(tokens) // bs):
        h = hash((h, tuple(tokens[i * bs:(i + 1) * bs])))
        out.append(h)
    return out


def expect_value_error(call, what: str) -> None:
    """``call()`` must raise ValueError; one line saying what came instead."""
    __tracebackhide__ = True
    try:
        call()
    except ValueError:
        return
    except Exception as e:  # a stub's NotImplementedError is reported by adapters, not here
        pytest.fail(f"{what}: expected ValueError, got {type(e).__name__}: {e}", pytrace=False)
    pytest.fail(f"{what}: expected ValueError, got no error", pytrace=False)


def as_pair(got, what: str) -> tuple[list, list]:
    """``(blocks, evicted)`` as two lists; one line when the result has another shape."""
    __tracebackhide__ = True
    try:
        blocks, evicted = got
        return list(blocks), list(evicted)
    except (TypeError, ValueError):
        pytest.fail(f"{what}: expected a pair (blocks, evicted) of lists, got {got!r}", pytrace=False)


# ---------------------------------------------------------------- longest_cached_prefix


def test_lookup_example():
    """Contract: return the block ids of the leading hits of h_0, h_1, ... in order."""
    toks = [5, 6, 7, 8, 9]
    h = chain(toks, 2)
    adapters.expect(longest_cached_prefix(toks, 2, {h[0]: 4, h[1]: 1}), [4, 1],
                    "lookup of [5, 6, 7, 8, 9], block size 2, both full blocks cached (in blocks 4 and 1)")


def test_lookup_is_a_chain_not_a_set_of_blocks():
    """Contract: each block's hash is chained from its parent's; stop at the first miss."""
    a, b = [1, 2, 3, 4], [9, 9, 3, 4]
    ha = chain(a, 2)
    adapters.expect(longest_cached_prefix(b, 2, {ha[0]: 0, ha[1]: 1}), [],
                    "lookup of [9, 9, 3, 4] when [1, 2, 3, 4] is cached (block [3, 4] after [9, 9] is another "
                    "block: its hash includes its parent's)")
    adapters.expect(longest_cached_prefix(a, 2, {ha[1]: 1}), [],
                    "lookup of [1, 2, 3, 4] with only its second block cached (stop at the first miss: block 1 "
                    "is useless without block 0)")
    adapters.expect(longest_cached_prefix(a, 4, {}), [], "lookup in an empty cache")


def test_lookup_max_blocks_and_partial_blocks():
    """Contract: only full blocks count; at most max_blocks blocks when it is given."""
    toks = list(range(10))
    h = chain(toks, 3)  # 3 full blocks; the 10th token is a partial block, never cached
    cached = {x: i + 20 for i, x in enumerate(h)}
    adapters.expect(longest_cached_prefix(toks, 3, cached), [20, 21, 22],
                    "lookup of 10 tokens, block size 3, its 3 full blocks cached (in 20, 21, 22)")
    adapters.expect(longest_cached_prefix(toks, 3, cached, 2), [20, 21],
                    "the same lookup with max_blocks=2 (max_blocks caps the run)")
    adapters.expect(longest_cached_prefix(toks[:9], 3, cached, (9 - 1) // 3), [20, 21],
                    "lookup of a 9-token prompt with the engine's cap (9 - 1) // 3 = 2 (the last prompt token "
                    "is always computed)")


def test_lookup_prompt_ending_on_a_block_edge():
    """Contract: block i holds token_ids[i * block_size:(i + 1) * block_size]: a prompt ending on a block edge
    has no partial block, and without max_blocks its last full block is looked up too."""
    toks = [4, 1, 4, 2, 7, 7, 3, 0, 5, 5, 6, 1]
    h = chain(toks, 4)
    cached = {h[0]: 8, h[1]: 2, h[2]: 5}
    adapters.expect(longest_cached_prefix(toks, 4, cached), [8, 2, 5],
                    "lookup of 12 tokens, block size 4, its 3 full blocks cached (in 8, 2, 5), no max_blocks")
    adapters.expect(longest_cached_prefix(toks, 4, cached, (12 - 1) // 4), [8, 2],
                    "the same lookup with the engine's cap (12 - 1) // 4 = 2")
    adapters.expect(longest_cached_prefix([9, 8], 1, {x: i for i, x in enumerate(chain([9, 8], 1))}), [0, 1],
                    "lookup of [9, 8], block size 1, both blocks cached (in 0 and 1), no max_blocks")


def test_lookup_max_blocks_zero():
    """Contract: at most max_blocks blocks when it is given, max_blocks = 0 included (a prompt of one block)."""
    toks = [6, 2, 6, 3]
    h = chain(toks, 4)
    adapters.expect(longest_cached_prefix(toks, 4, {h[0]: 3}, 0), [],
                    "lookup of a 4-token prompt, block size 4, its block cached, with the engine's cap (4 - 1) // 4 "
                    "= 0 (max_blocks=0: no block may be shared)")
    longer = toks + [1, 1, 1, 1]
    both = dict(zip(chain(longer, 4), [3, 4]))
    adapters.expect(longest_cached_prefix(longer, 4, both, 0), [], "lookup of 8 tokens, block size 4, both blocks "
                                                                   "cached (in 3 and 4), max_blocks=0")


def test_lookup_random():
    """Contract: the leading hits of the chained hashes, in order, stopping at the first miss (random prompts,
    smallest first)."""
    rng = random.Random(0)
    cases = []
    for _ in range(200):
        bs = rng.choice([1, 2, 4])
        base = [rng.randrange(5) for _ in range(rng.randint(0, 12))]
        cached = {}
        for j in range(3):  # a few cached prompts sharing parts of ``base``
            p = base[:rng.randint(0, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
            for i, x in enumerate(chain(p, bs)):
                cached.setdefault(x, 100 * j + i)
        q = base[:rng.randint(0, len(base))] + [rng.randrange(5) for _ in range(rng.randint(0, 6))]
        cases.append((bs, cached, q))
    for bs, cached, q in sorted(cases, key=lambda c: (len(c[2]), len(c[1]))):
        want = []
        for x in chain(q, bs):
            if x not in cached:
                break
            want.append(cached[x])
        before = dict(cached)
        adapters.expect(longest_cached_prefix(list(q), bs, cached), want,
                        f"lookup of tokens {q}, block size {bs}")
        adapters.expect(cached == before, True, f"cached left unmodified by the lookup of tokens {q}")


# ---------------------------------------------------------------- allocate_with_eviction


def test_allocate_example():
    """Contract: never-cached free blocks first, then the front of evictable; (blocks, evicted) in the order taken."""
    what = "allocate_with_eviction(free [7], evictable [3, 5, 1], n=3)"
    blocks, evicted = as_pair(allocate_with_eviction([7], [3, 5, 1], 3), what)
    adapters.expect(blocks, [7, 3, 5], f"blocks of {what} (the never-cached 7 first, then the least recently "
                                       f"used 3 and 5)")
    adapters.expect(evicted, [3, 5], f"evicted of {what}")


def test_allocate_prefers_never_cached_blocks():
    """Contract: take blocks from the front of free_ids while there are any; only then evict."""
    what = "allocate_with_eviction(free [2, 0, 9], evictable [4, 6], n=2)"
    blocks, evicted = as_pair(allocate_with_eviction([2, 0, 9], [4, 6], 2), what)
    adapters.expect(blocks, [2, 0], f"blocks of {what} (no eviction while never-cached blocks are free)")
    adapters.expect(evicted, [], f"evicted of {what}")
    what = "allocate_with_eviction(free [], evictable [4, 6, 8], n=3)"
    blocks, evicted = as_pair(allocate_with_eviction([], [4, 6, 8], 3), what)
    adapters.expect(blocks, [4, 6, 8], f"blocks of {what}")
    adapters.expect(evicted, [4, 6, 8], f"evicted of {what}")
    what = "allocate_with_eviction(free [1], evictable [2], n=0)"
    adapters.expect(as_pair(allocate_with_eviction([1], [2], 0), what), ([], []), what)


def test_allocate_too_many_and_inputs_untouched():
    """Contract: n larger than both lists together -> ValueError, nothing taken; the input lists are not modified."""
    free, ev = [1, 2], [3]
    expect_value_error(lambda: allocate_with_eviction(free, ev, 4),
                       "allocate_with_eviction(free [1, 2], evictable [3], n=4): more blocks than are free")
    adapters.expect((free, ev), ([1, 2], [3]), "(free_ids, evictable) after asking for too many blocks")
    allocate_with_eviction(free, ev, 3)
    adapters.expect((free, ev), ([1, 2], [3]), "(free_ids, evictable) after allocate_with_eviction(.., n=3): "
                                               "the inputs are not modified")


def test_allocate_random():
    """Contract: the first n of free_ids then evictable, and the evicted ones among them (random pools, smallest
    first)."""
    rng = random.Random(1)
    cases = []
    for _ in range(200):
        ids = rng.sample(range(30), rng.randint(0, 12))
        k = rng.randint(0, len(ids))
        cases.append((ids[:k], ids[k:], rng.randint(0, len(ids))))
    for free, ev, n in sorted(cases, key=lambda c: (len(c[0]) + len(c[1]), c[2])):
        what = f"allocate_with_eviction(free {free}, evictable {ev}, n={n})"
        blocks, evicted = as_pair(allocate_with_eviction(list(free), list(ev), n), what)
        want = (free + ev)[:n]
        adapters.expect(blocks, want, f"blocks of {what}")
        adapters.expect(evicted, [b for b in want if b in ev], f"evicted of {what}")


# ---------------------------------------------------------------- admission_order

T = {0: 0.05, 1: 0.2, 2: 1.0}


def test_admission_example():
    """Contract: every timed-out request comes before every other one; within a group, lower level first."""
    adapters.expect(admission_order([("i_new", 0, 1.98), ("b_old", 2, 0.0), ("s_old", 1, 1.7)], 2.0, T),
                    ["s_old", "b_old", "i_new"],
                    "admission order at now=2.0 (b_old and s_old waited past their timeouts, standard before "
                    "batch; i_new did not)")


def test_admission_classes_then_queue_order():
    """Contract: requests not arrived yet are left out; lower level first, then queue order."""
    w = [("b1", 2, 0.0), ("s1", 1, 0.0), ("i1", 0, 0.0), ("b2", 2, 0.0), ("i2", 0, 0.0), ("later", 0, 9.0)]
    adapters.expect(admission_order(list(w), 0.01, T), ["i1", "i2", "s1", "b1", "b2"],
                    f"admission order of {w} at now=0.01 (lower level first, queue order within a level; "
                    f"'later' has not arrived)")


def test_admission_timeout_is_strict():
    """Contract: a request has timed out when now - arrival > timeouts[level] (strictly)."""
    adapters.expect(admission_order([("a", 1, 0.0), ("b", 0, 0.19)], 0.2, T), ["b", "a"],
                    "admission order at now=0.2 of a (standard, arrived 0.0) and b (interactive, arrived 0.19): "
                    "a waited exactly its 0.2 s timeout, not past it")
    adapters.expect(admission_order([("a", 1, 0.0), ("b", 0, 0.22)], 0.25, T), ["a", "b"],
                    "admission order at now=0.25 of a (standard, arrived 0.0) and b (interactive, arrived 0.22): "
                    "a waited past its timeout, b did not")


def test_admission_queue_order_is_not_arrival_order():
    """Contract: within each group, lower level first, then queue order (the order of `waiting`, not of arrival)."""
    adapters.expect(admission_order([("b_late", 2, 0.5), ("b_early", 2, 0.3)], 0.6, T), ["b_late", "b_early"],
                    "admission order at now=0.6 of b_late (batch, arrived 0.5) queued ahead of b_early (batch, "
                    "arrived 0.3), neither timed out")
    adapters.expect(admission_order([("s_late", 1, 0.3), ("s_early", 1, 0.1), ("i", 0, 0.58)], 0.6, T),
                    ["s_late", "s_early", "i"],
                    "admission order at now=0.6 of s_late (standard, arrived 0.3) queued ahead of s_early (standard, "
                    "arrived 0.1), both timed out, and i (interactive, arrived 0.58)")


def test_admission_random():
    """Contract: timed out first, then lower level, then queue order; not arrived left out (random queues,
    shortest first)."""
    rng = random.Random(2)
    cases = []
    for _ in range(300):
        w = [(f"r{i}", rng.randint(0, 2), round(rng.uniform(0, 3), 2)) for i in range(rng.randint(0, 8))]
        cases.append((w, round(rng.uniform(0, 3), 2)))
    for w, now in sorted(cases, key=lambda c: len(c[0])):
        keyed = [((0 if now - t > T[lv] else 1), lv, i, rid) for i, (rid, lv, t) in enumerate(w) if t <= now]
        want = [k[-1] for k in sorted(keyed)]
        adapters.expect(admission_order(list(w), now, T), want,
                        f"admission order at now={now} of waiting {w}")


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() returns a dict of this chapter's answers."""
    answers = quiz_answers()
    adapters.expect(type(answers).__name__, "dict", "the type quiz_answers() returns (a dict of answers)")
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:
        pytest.fail(f"question {why}", pytrace=False)
