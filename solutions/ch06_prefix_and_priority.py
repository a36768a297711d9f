"""Chapter 6 solutions: same names and signatures as ``exercises/ch06_prefix_and_priority.py``.

Each answer is the library's own code, called on plain lists: the hash-chain lookup of
``minillm/block_manager.py``, the allocation order of its ``BlockAllocator`` (free list,
then the evictable pool, least recently used first), and the admission order of
``minillm/scheduler/priority.py``.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from types import SimpleNamespace

from minillm import block_manager
from minillm.block_manager import BlockAllocator
from minillm.scheduler import priority
from minillm.course import quiz

ROOT_HASH = block_manager.ROOT_HASH


def longest_cached_prefix(token_ids: list[int], block_size: int, cached: dict[int, int],
                          max_blocks: int | None = None) -> list[int]:
    """``minillm/block_manager.py``, ``longest_cached_prefix``."""
    return block_manager.longest_cached_prefix(token_ids, block_size, cached, max_blocks)


def allocate_with_eviction(free_ids: list[int], evictable: list[int], n: int) -> tuple[list[int], list[int]]:
    """``BlockAllocator.allocate`` on an allocator in the given state: free list first, then evict LRU."""
    if n > len(free_ids) + len(evictable):
        raise ValueError(f"asked for {n} blocks but only {len(free_ids) + len(evictable)} are free")
    ids = sorted(set(free_ids) | set(evictable))
    a = BlockAllocator(max(ids, default=0) + 1)
    a.free_ids = deque(free_ids)
    a.ref_counts = [0 if b in ids else 1 for b in range(a.num_blocks)]
    a.evictable = OrderedDict.fromkeys(evictable)
    for b in evictable:  # an evictable block holds a cached prefix
        a.block_hash[b] = b
        a.cached[b] = b
    blocks = a.allocate(n)
    pool = set(evictable)
    evicted = [b for b in blocks if b in pool]
    return blocks, evicted


def admission_order(waiting: list[tuple[str, int, float]], now: float,
                    timeouts: dict[int, float]) -> list[str]:
    """``minillm/scheduler/priority.py``, ``admission_order``, on stand-ins for requests."""
    reqs = [SimpleNamespace(request_id=rid, priority=level, arrival_time=t) for rid, level, t in waiting]
    return [r.request_id for r in priority.admission_order(reqs, now, lambda level: timeouts[level])]


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: only full blocks are shared, and the last token is always
    computed; q2: the tokens found in the cache over the prompt tokens; q3: which block the pool gives up first;
    q4: who is admitted when a class has waited past its timeout."""
    return quiz.sealed("ch06")
