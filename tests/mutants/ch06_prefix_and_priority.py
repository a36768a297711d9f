"""Wrong answers to exercises/ch06_prefix_and_priority.py, each a mistake the contract rules out."""
from __future__ import annotations

from mutants import mutant

ROOT_HASH = 0


def _full_blocks(token_ids, block_size, count):
    return [tuple(token_ids[i * block_size:(i + 1) * block_size]) for i in range(count)]


# ---------------------------------------------------------------- longest_cached_prefix


@mutant("longest_cached_prefix", "a miss is skipped, not the end of the run (the blocks are looked up as a set)")
def _lookup_skips_misses(token_ids, block_size, cached, max_blocks=None):
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hit, h = [], ROOT_HASH
    for block in _full_blocks(token_ids, block_size, n):
        h = hash((h, block))
        if h in cached:
            hit.append(cached[h])
    return hit


@mutant("longest_cached_prefix", "each block is hashed from ROOT_HASH, not chained from its parent's hash")
def _lookup_not_chained(token_ids, block_size, cached, max_blocks=None):
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hit = []
    for block in _full_blocks(token_ids, block_size, n):
        b = cached.get(hash((ROOT_HASH, block)))
        if b is None:
            break
        hit.append(b)
    return hit


@mutant("longest_cached_prefix", "max_blocks=0 is read as no cap (`if max_blocks:`)")
def _lookup_zero_cap_ignored(token_ids, block_size, cached, max_blocks=None):
    n = len(token_ids) // block_size
    if max_blocks:
        n = min(n, max_blocks)
    hit, h = [], ROOT_HASH
    for block in _full_blocks(token_ids, block_size, n):
        h = hash((h, block))
        if h not in cached:
            break
        hit.append(cached[h])
    return hit


@mutant("longest_cached_prefix", "the last full block is never looked up ((len - 1) // block_size blocks, even "
                                 "without max_blocks): a prompt ending on a block edge loses its last block",
        same_in_engine="the engine always passes max_blocks = (len(prompt) - 1) // block_size, the very cap this "
                       "mutant applies on its own")
def _lookup_drops_edge_block(token_ids, block_size, cached, max_blocks=None):
    n = max(len(token_ids) - 1, 0) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    hit, h = [], ROOT_HASH
    for block in _full_blocks(token_ids, block_size, n):
        h = hash((h, block))
        if h not in cached:
            break
        hit.append(cached[h])
    return hit


# ---------------------------------------------------------------- allocate_with_eviction


def _check_enough(free_ids, evictable, n):
    if n > len(free_ids) + len(evictable):
        raise ValueError(f"asked for {n} blocks, {len(free_ids) + len(evictable)} are free")


@mutant("allocate_with_eviction", "the most recently used cached block is evicted first (the pool read from its back)")
def _allocate_mru(free_ids, evictable, n):
    _check_enough(free_ids, evictable, n)
    blocks = (list(free_ids) + list(reversed(evictable)))[:n]
    return blocks, blocks[len(free_ids):]


@mutant("allocate_with_eviction", "cached blocks are evicted before the never-cached free blocks are used")
def _allocate_evicts_first(free_ids, evictable, n):
    _check_enough(free_ids, evictable, n)
    blocks = (list(evictable) + list(free_ids))[:n]
    return blocks, [b for b in blocks if b in evictable]


@mutant("allocate_with_eviction",
         "free blocks are taken from the back of free_ids (list.pop()), the most recently freed first")
def _allocate_pops_back(free_ids, evictable, n):
    _check_enough(free_ids, evictable, n)
    free, pool = list(free_ids), list(evictable)
    blocks, evicted = [], []
    for _ in range(n):
        if free:
            blocks.append(free.pop())
        else:
            b = pool.pop(0)
            blocks.append(b)
            evicted.append(b)
    return blocks, evicted


@mutant("allocate_with_eviction",
         "evicted reports the whole evictable pool once any block is evicted, not the ones taken")
def _allocate_reports_pool(free_ids, evictable, n):
    _check_enough(free_ids, evictable, n)
    blocks = (list(free_ids) + list(evictable))[:n]
    return blocks, list(evictable) if n > len(free_ids) else []


@mutant("allocate_with_eviction", "n larger than both lists hands out what there is instead of raising ValueError",
        same_in_engine="BlockAllocator.allocate raises NoFreeBlocksError before it asks the seam for more blocks "
                       "than are free")
def _allocate_no_error(free_ids, evictable, n):
    blocks = (list(free_ids) + list(evictable))[:n]
    return blocks, blocks[len(free_ids):]


# ---------------------------------------------------------------- admission_order


def _order(waiting, now, timed_out, key):
    arrived = [(i, rid, level, t) for i, (rid, level, t) in enumerate(waiting) if t <= now]
    return [rid for i, rid, level, t in sorted(arrived, key=lambda x: (0 if timed_out(x) else 1, *key(x)))]


@mutant("admission_order", "a request that waited exactly its timeout counts as timed out (>= instead of >)")
def _admission_timeout_inclusive(waiting, now, timeouts):
    return _order(waiting, now, lambda x: now - x[3] >= timeouts[x[2]], lambda x: (x[2], x[0]))


@mutant("admission_order", "the timed-out requests keep queue order, without their levels")
def _admission_timed_out_by_queue(waiting, now, timeouts):
    def late(x):
        return now - x[3] > timeouts[x[2]]
    return _order(waiting, now, late, lambda x: (0 if late(x) else x[2], x[0]))


@mutant("admission_order", "requests that have not arrived yet are not left out")
def _admission_future_kept(waiting, now, timeouts):
    keyed = [(0 if now - t > timeouts[level] else 1, level, i, rid) for i, (rid, level, t) in enumerate(waiting)]
    return [k[-1] for k in sorted(keyed)]


@mutant("admission_order", "the timeouts are ignored: level first, then queue order")
def _admission_no_timeouts(waiting, now, timeouts):
    return _order(waiting, now, lambda x: False, lambda x: (x[2], x[0]))


@mutant("admission_order", "within a level the earliest arrival goes first, not the queue's order")
def _admission_by_arrival(waiting, now, timeouts):
    return _order(waiting, now, lambda x: now - x[3] > timeouts[x[2]], lambda x: (x[2], x[3], x[0]))
