"""Chapter 6 exercises: the prefix cache's lookup and eviction, and the priority admission order.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch06          # or: .venv/bin/python tests/grade.py ch06

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file named at the end of the docstring. Plain Python is all you need;
do not import the answers from ``minillm``.

The picture: KV blocks of ``block_size`` tokens. A *full* block of a prompt is named by a
hash chained from the block before it, so equal names mean equal prefixes. The engine
keeps ``cached``: hash -> the physical block holding those tokens. Free blocks that
still hold a cached prefix wait in an *evictable* pool until an allocation needs them.
Waiting requests carry a priority level (interactive 0, standard 1, batch 2) and each
level has a queue timeout.

Each of the three functions is also a seam of the engine (``minillm/seams.py``): the
chapter's "run it in the engine" cell plugs yours into the paged engine with prefix
caching and the priority scheduler, and checks that the tokens, the step schedule and
the prefix hits are the library's.
"""
from __future__ import annotations

ROOT_HASH = 0  # the parent hash of a prompt's first block


def longest_cached_prefix(token_ids: list[int], block_size: int, cached: dict[int, int],
                          max_blocks: int | None = None) -> list[int]:
    """The physical blocks of the longest run of ``token_ids``' full blocks found in ``cached``.

    Block i holds ``token_ids[i * block_size:(i + 1) * block_size]``; only full blocks
    count (a partial last block is never cached). Its hash is chained:

        h_0 = hash((ROOT_HASH, tuple(block 0)))
        h_i = hash((h_{i-1}, tuple(block i)))

    (Python's ``hash`` of a tuple of ints: the engine uses the very same expression, so
    your hashes find its blocks.)

    Contract:
      - look up h_0, h_1, ... in ``cached`` (hash -> block id) and return the block ids
        of the leading hits, in order; stop at the first miss (block i + 1 is useless
        without block i's K/V, even if its hash were cached);
      - at most ``max_blocks`` blocks when it is given (the engine passes
        ``(len(prompt) - 1) // block_size``: the last prompt token is always computed,
        so there are logits to sample from);
      - ``token_ids`` and ``cached`` are not modified.

    Example: block_size 2, tokens [5, 6, 7, 8, 9], cached holds the hashes of [5, 6] (in
    block 4) and of [5, 6] + [7, 8] (in block 1) -> [4, 1].

    Answer, after you try: ``minillm/block_manager.py``, ``longest_cached_prefix`` (and
    ``BlockManager.lookup_prefix``, which also compares the stored tokens).
    """
    raise NotImplementedError


def allocate_with_eviction(free_ids: list[int], evictable: list[int], n: int) -> tuple[list[int], list[int]]:
    """Hand out ``n`` blocks: never-cached free blocks first, then evict least recently used.

    ``free_ids``: free blocks that hold no cached prefix, in the order they were freed;
    ``evictable``: free blocks that still hold one, least recently freed first.

    Contract:
      - take blocks from the front of ``free_ids`` while there are any; only then from
        the front of ``evictable`` (the least recently used cached block: evicting it
        forgets its prefix);
      - return ``(blocks, evicted)``: the ``n`` block ids in the order they were taken,
        and the evicted ones among them (in order);
      - ``n`` larger than both lists together -> ``ValueError`` (and nothing is taken);
      - the input lists are not modified.

    Example: free [7], evictable [3, 5, 1], n 3 -> ([7, 3, 5], [3, 5]).

    Why this order: a never-cached block costs nothing to reuse; among cached ones, the
    prefix freed longest ago is the least likely to be asked for again.

    (Chapter 3's ``allocate_blocks`` is the plain free list; this is the allocator once
    the prefix cache has filled the evictable pool, hence the other name.)

    Answer, after you try: ``minillm/block_manager.py``, ``BlockAllocator.allocate`` and
    ``lru_victim``.
    """
    raise NotImplementedError


def admission_order(waiting: list[tuple[str, int, float]], now: float,
                    timeouts: dict[int, float]) -> list[str]:
    """The order in which the priority scheduler admits the waiting requests.

    ``waiting``: (request id, priority level, arrival time) in queue order; a lower
    level is served first. ``timeouts``: level -> queue timeout in seconds.

    Contract:
      - requests that have not arrived yet (arrival > now) are left out;
      - a request has *timed out* when ``now - arrival > timeouts[level]``;
      - every timed-out request comes before every other one;
      - within each of the two groups: lower level first, then queue order;
      - returns the request ids in admission order.

    Example, timeouts {0: 0.05, 1: 0.2, 2: 1.0}, now 2.0, waiting
    [("i_new", 0, 1.98), ("b_old", 2, 0.0), ("s_old", 1, 1.7)]:
    b_old and s_old timed out, i_new did not -> ["s_old", "b_old", "i_new"].

    Hints: ``sorted`` with a key tuple; ``enumerate`` keeps the queue position.

    Answer, after you try: ``minillm/scheduler/priority.py``, ``admission_order``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch06")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
