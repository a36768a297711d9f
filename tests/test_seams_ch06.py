"""Chapter 6's seams: the prefix-cache lookup, the allocator's eviction order and the
priority admission order, plugged into the paged engine.

A tiny random Llama on one thread. With the reference answers plugged the engine is the
library's, token for token, step for step, hit for hit; a wrong function either changes
the schedule (a legal but different choice) or is refused with a ValueError naming the
seam, and then the allocator is left as it was and every block is free again.
"""
from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

from minillm import SamplingParams, seams
from minillm.block_manager import BlockAllocator
from test_spec_engine import assert_all_free, tiny_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch06_prefix_and_priority as s06  # noqa: E402

OUT_LENS = (5, 9, 3, 7, 4, 6, 8, 2)
LEVELS = ("batch", "interactive", "standard", "batch", "interactive", "standard", "interactive", "batch")
# A tight cache: blocks are evicted while the second turns come in.
CACHING = dict(enable_prefix_caching=True, max_num_seqs=2, num_blocks=16, block_size=4, max_model_len=48)
# Every request arrives at time 0 of the engine's clock, long before the first step: the
# standard class (timeout 0) has timed out at every step, the other two never do. So the
# order is deterministic: standard first, then interactive, then batch.
PRIORITY = dict(CACHING, scheduling_policy="priority",
                queue_timeouts={"interactive": math.inf, "standard": 0.0, "batch": math.inf})
SOLUTIONS = dict(longest_cached_prefix=s06.longest_cached_prefix,
                 allocate_with_eviction=s06.allocate_with_eviction, admission_order=s06.admission_order)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def conversations(seed: int = 0) -> list[list[int]]:
    """Two turns of four conversations after one system prompt: turn 2 resends turn 1's question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 64) for _ in range(10)]
    questions = [[rng.randrange(3, 64) for _ in range(rng.randint(3, 7))] for _ in range(4)]
    return [system + q * turn + [rng.randrange(3, 64) for _ in range(2)] for turn in (1, 2) for q in questions]


def params(priority: bool) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, priority=lv if priority else "standard")
            for n, lv in zip(OUT_LENS, LEVELS)]


def run(opts: dict, impls: dict | None = None, prompts=None, priority: bool = False):
    """One run: (tokens, schedule, prefix-hit tokens, evictions, calls per plugged seam, engine)."""
    prompts = conversations() if prompts is None else prompts
    eng = tiny_engine(**opts)
    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        return call

    with seams.plug(**{n: counted(n, f) for n, f in (impls or {}).items()}):
        reqs = [eng.make_request(p, sp, arrival_time=0.0) for p, sp in zip(prompts, params(priority))]
        tokens = [o.token_ids for o in eng.run(reqs)]
    sched = eng.scheduler
    schedule = [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in eng.step_records]
    return tokens, schedule, sched.prefix_hit_tokens, sched.block_manager.num_evictions, calls, eng


@pytest.fixture(scope="module")
def library():
    return {"caching": run(CACHING), "priority": run(PRIORITY, priority=True)}


# ------------------------------------------------------------------ the reference answers


def test_the_workloads_exercise_hits_evictions_and_classes(library):
    for name, (_, schedule, hits, evictions, _, eng) in library.items():
        assert hits > 0 and evictions > 0, f"{name}: the run must hit the cache and evict ({hits}, {evictions})"
        assert_all_free(eng)
    fcfs = run(dict(PRIORITY, scheduling_policy="fcfs"), priority=True)
    assert fcfs[1] != library["priority"][1], "the classes and timeouts must change the order"


def test_solutions_plugged_keep_prefix_caching_exact(library):
    tokens, schedule, hits, evictions, calls, eng = run(CACHING, {k: SOLUTIONS[k] for k in
                                                                  ("longest_cached_prefix", "allocate_with_eviction")})
    ref = library["caching"]
    assert tokens == ref[0]
    assert schedule == ref[1]
    assert (hits, evictions) == (ref[2], ref[3])
    assert calls.get("longest_cached_prefix", 0) > 0 and calls.get("allocate_with_eviction", 0) > 0, calls
    assert_all_free(eng)


def test_solutions_plugged_keep_the_priority_scheduler_exact(library):
    tokens, schedule, hits, evictions, calls, eng = run(PRIORITY, SOLUTIONS, priority=True)
    ref = library["priority"]
    assert tokens == ref[0]
    assert schedule == ref[1]
    assert (hits, evictions) == (ref[2], ref[3])
    assert set(calls) == set(SOLUTIONS) and min(calls.values()) > 0, calls
    assert_all_free(eng)


def test_a_function_that_modifies_its_inputs_cannot_touch_the_engine(library):
    def greedy_allocate(free_ids, evictable, n):
        out = s06.allocate_with_eviction(free_ids, evictable, n)
        free_ids.clear()  # the engine's free list is not this list
        evictable.reverse()
        return out

    tokens, schedule, hits, _, calls, eng = run(CACHING, dict(allocate_with_eviction=greedy_allocate))
    assert (tokens, schedule, hits) == library["caching"][:3] and calls
    assert_all_free(eng)


# ------------------------------------------------------------------ wrong but legal: another schedule


def test_evicting_the_most_recently_used_changes_the_schedule(library):
    def mru(free_ids, evictable, n):
        blocks = (list(free_ids) + list(reversed(evictable)))[:n]
        return blocks, [b for b in blocks if b in evictable]

    tokens, schedule, hits, _, calls, eng = run(CACHING, dict(allocate_with_eviction=mru))
    ref = library["caching"]
    assert tokens == ref[0], "another eviction order costs hits, never tokens"
    assert calls["allocate_with_eviction"] > 0
    assert schedule != ref[1] and hits != ref[2]
    assert_all_free(eng)


def test_a_lookup_that_stops_early_changes_the_schedule_not_the_tokens(library):
    def one_block_less(token_ids, block_size, cached, max_blocks=None):
        return s06.longest_cached_prefix(token_ids, block_size, cached, max_blocks)[:-1]

    tokens, schedule, hits, _, _, eng = run(CACHING, dict(longest_cached_prefix=one_block_less))
    ref = library["caching"]
    assert tokens == ref[0] and schedule != ref[1] and hits < ref[2]
    assert_all_free(eng)


def test_ignoring_priority_changes_the_schedule(library):
    def queue_order(waiting, now, timeouts):
        return [rid for rid, _, arrival in waiting if arrival <= now]

    tokens, schedule, _, _, calls, eng = run(PRIORITY, dict(admission_order=queue_order), priority=True)
    ref = library["priority"]
    assert tokens == ref[0] and calls["admission_order"] > 0
    assert schedule != ref[1]
    assert_all_free(eng)


def test_ignoring_the_timeouts_changes_the_schedule(library):
    def no_timeouts(waiting, now, timeouts):
        return s06.admission_order(waiting, now, {level: math.inf for level in timeouts})

    _, schedule, _, _, _, eng = run(PRIORITY, dict(admission_order=no_timeouts), priority=True)
    assert schedule != library["priority"][1]
    assert_all_free(eng)


# ------------------------------------------------------------------ wrong answers: a clear error


def _raises_and_frees(opts, impls, match, prompts=None, priority=False):
    eng = tiny_engine(**opts)
    prompts = conversations() if prompts is None else prompts
    reqs = [eng.make_request(p, sp, arrival_time=0.0) for p, sp in zip(prompts, params(priority))]
    with seams.plug(**impls):
        with pytest.raises(ValueError, match=match):
            eng.run(reqs)
    assert_all_free(eng)  # engine.run aborted every request: each block is free again
    return eng


def test_a_lookup_past_max_blocks_is_refused():
    def one_block_too_many(token_ids, block_size, cached, max_blocks=None):
        return s06.longest_cached_prefix(token_ids, block_size, cached, None if max_blocks is None else max_blocks + 1)

    # The second request repeats the first, 16 tokens = 4 full blocks, all cached: the
    # library shares 3 (the last token is computed), the wrong lookup returns 4.
    prompt = conversations()[1]
    assert len(prompt) % 4 == 0
    _raises_and_frees(dict(CACHING, num_blocks=40), dict(longest_cached_prefix=one_block_too_many),
                      r"longest_cached_prefix .* at most max_blocks = 3 .* returned 4 blocks",
                      prompts=[prompt, list(prompt)])


def test_a_lookup_that_returns_a_block_past_the_first_miss_is_refused():
    def one_more(token_ids, block_size, cached, max_blocks=None):
        hit = s06.longest_cached_prefix(token_ids, block_size, cached, max_blocks)
        others = [b for b in cached.values() if b not in hit]
        return hit + others[:1] if hit and others and len(hit) < max_blocks else hit

    _raises_and_frees(CACHING, dict(longest_cached_prefix=one_more),
                      r"longest_cached_prefix .* returned block \d+ at position \d+ .* does not hold")


@pytest.mark.parametrize("answer,match", [
    (lambda free, ev, n: ([ev[0]] * n, [ev[0]] * n), "returned block 3 twice"),
    (lambda free, ev, n: ([5] + (free + ev)[:n - 1], [b for b in (free + ev)[:n - 1] if b in ev]),
     "block 5, which it was not offered"),
    (lambda free, ev, n: ((free + ev)[:n - 1], [b for b in (free + ev)[:n - 1] if b in ev]), r"returned \d+ blocks for n="),
    (lambda free, ev, n: ((free + ev)[:n], []), "evicted="),
    (lambda free, ev, n: (free + ev)[:n], r"must return \(blocks, evicted\)"),
])
def test_a_wrong_allocation_is_refused_and_the_allocator_is_unchanged(answer, match):
    a = BlockAllocator(8)
    held = a.allocate(6)  # blocks 0..5 in use; 6 and 7 never cached
    for i, b in enumerate(held[:4]):  # 0..3 hold a prefix; freed: evictable, LRU first 3, 2, 1, 0
        a.register(b, 1000 + i, [i])
    for b in reversed(held[:4]):
        a.free(b)
    state = (list(a.free_ids), list(a.evictable), list(a.ref_counts), dict(a.cached), a.num_evictions)
    assert state[:2] == ([6, 7], [3, 2, 1, 0])
    with seams.plug(allocate_with_eviction=answer):
        with pytest.raises(ValueError, match=match):
            a.allocate(4)
        assert (list(a.free_ids), list(a.evictable), list(a.ref_counts), dict(a.cached), a.num_evictions) == state
        assert a.allocate(0) == []
    a.check_invariants()
    with seams.plug(allocate_with_eviction=s06.allocate_with_eviction):
        assert a.allocate(4) == [6, 7, 3, 2]
    assert a.num_evictions == 2 and a.block_hash[3] is None and a.block_hash[2] is None
    a.check_invariants()


def test_a_wrong_allocation_in_the_engine_frees_every_block():
    def duplicates(free_ids, evictable, n):
        blocks = [evictable[0]] * n
        return blocks, blocks

    _raises_and_frees(CACHING, dict(allocate_with_eviction=duplicates), "allocate_with_eviction .* twice")


@pytest.mark.parametrize("answer,match", [
    (lambda w, now, t: [rid for rid, _, _ in w] + [rid for rid, _, _ in w[:1]], "twice"),
    (lambda w, now, t: [rid for rid, _, _ in w][1:], "left out"),
    (lambda w, now, t: [rid for rid, _, _ in w] + ["nobody"], "not a waiting request"),
    (lambda w, now, t: None, "must return a list of request ids"),
])
def test_a_wrong_admission_order_is_refused_and_frees_every_block(answer, match):
    _raises_and_frees(PRIORITY, dict(admission_order=answer), f"admission_order .*{match}", priority=True)


def test_an_order_with_a_request_not_arrived_yet_is_refused():
    from minillm.request import Request
    from minillm.scheduler import priority

    waiting = [Request(rid, [1], SamplingParams(priority=lv), arrival_time=t)
               for rid, lv, t in [("a", 2, 0.0), ("b", 0, 5.0)]]
    with seams.plug(admission_order=lambda w, now, t: [rid for rid, _, _ in w]):
        with pytest.raises(ValueError, match="'b', which has not arrived yet"):
            priority.admission_order(waiting, 1.0, lambda level: 1.0)
    seen = []

    def spy(w, now, timeouts):
        seen.append((list(w), now, dict(timeouts)))
        return s06.admission_order(w, now, timeouts)

    with seams.plug(admission_order=spy):
        assert priority.admission_order(waiting, 1.0, lambda level: 0.5 * level) == waiting[:1]
    assert seen == [([("a", 2, 0.0), ("b", 0, 5.0)], 1.0, {0: 0.0, 1: 0.5, 2: 1.0})]
