"""Paged KV memory: fixed-size blocks, a free list with reference counts, block tables.

The KV cache of every layer is one tensor ``[num_blocks, block_size, Hkv, D]``. Nothing
in it belongs to a request until this module says so. A request owns a *block table*,
the list ``request.block_ids``: logical block ``i`` (its token positions
``i * block_size .. (i + 1) * block_size - 1``) lives in physical block ``block_ids[i]``.
So a token at position ``p`` is stored in cache *slot*

    block_ids[p // block_size] * block_size + p % block_size

and the blocks of one request may sit anywhere, in any order. Memory is claimed one
block at a time as a sequence grows, so the waste per request is at most
``block_size - 1`` slots, instead of ``max_model_len - length`` with one contiguous
region per request.

Two layers, both plain Python (no tensors):

* ``BlockAllocator``: the free list and a reference count per block. ``incref`` lets
  two block tables share a block (a forked sequence, a shared prompt prefix); the block
  returns to the free list only when its last holder frees it.
* ``BlockManager``: block tables of requests. It grows a table to cover the tokens a
  step is about to write, answers "is there room?" before the scheduler commits, and
  frees a whole table when a request finishes, is aborted or is preempted (or only
  its trailing blocks: ``shrink``, after speculative tokens were rejected).

Prefix caching (chapter 6, ``enable_prefix_caching=True``). A *full* block is named by
a hash chained from the previous block's hash and its own token ids,

    h_0 = hash((ROOT_HASH, tokens[0:bs])),  h_i = hash((h_{i-1}, tokens[i*bs:(i+1)*bs]))

so two prompts that agree on their first ``i + 1`` blocks agree on ``h_i``, and only
then (the scheme vLLM uses). The manager keeps ``cached``: hash -> the block holding
those tokens. A request being admitted looks up its hashes in order and shares the
longest run of hits (``lookup_prefix`` then ``share_prefix``: reference counts go up);
it computes only the rest. A full block is registered when the step that writes it is
scheduled, so a request admitted right behind it in the same step already hits it
(every row's K/V is written before any row's attention reads, layer by layer).

A freed block that holds a registered hash is not forgotten: with reference count 0 it
moves to the *evictable* pool (``BlockAllocator.evictable``, least recently used
first). It still counts as free. An allocation takes never-cached free blocks first and
evicts from the evictable pool (LRU) only when those run out; eviction drops the hash.
A hit on an evictable block takes it back out of the pool.
"""
from __future__ import annotations

import itertools
import operator
import time
from collections import OrderedDict, deque
from types import MappingProxyType
from typing import Any, Callable, Iterable, Sequence

from minillm import seams
from minillm.kv_offload import HostHit, HostTier, KVCopies

ROOT_HASH = 0  # the "parent hash" of a prompt's first block (a fixed int: hash(None) varies by run)


class NoFreeBlocksError(RuntimeError):
    """The allocator was asked for more blocks than are free (ask ``can_allocate`` first)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    mine = seams.plugged("blocks_needed")  # a learner's version (chapter 3), when plugged in
    if mine is not None:
        return _checked_blocks_needed(mine(num_tokens, block_size), num_tokens, block_size)
    return -(-num_tokens // block_size)


def _checked_blocks_needed(got: Any, num_tokens: int, block_size: int) -> int:
    """A plugged ``blocks_needed``'s answer, checked before a table is sized by it: one block too
    few and a step writes K/V past the end of its table, one too many holds a block nobody fills."""
    call = f"blocks_needed({num_tokens}, {block_size})"
    try:
        if isinstance(got, bool):
            raise TypeError
        got = operator.index(got)
    except TypeError:
        raise seams.SeamContractError("blocks_needed", "the answer is an int",
                                      f"{call} returned {_short(got)}") from None
    if got * block_size < num_tokens or (got - 1) * block_size >= num_tokens:
        raise seams.SeamContractError(
            "blocks_needed", "the answer is the fewest blocks that hold the tokens, ceil(num_tokens / block_size)",
            f"{call} returned {got}, which holds {got * block_size} tokens")
    return got


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``start .. end-1`` of a request holding ``block_ids``.

    The model runner builds each step's slot_mapping tensor with it.
    """
    mine = seams.plugged("slot_mapping")  # a learner's version (chapter 3), when plugged in
    if mine is not None:
        return _checked_slots(mine(list(block_ids), block_size, start, end), block_ids, block_size, start, end)
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _checked_slots(got: Any, block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """A plugged ``slot_mapping``'s answer, checked before any K/V is written there: a slot outside
    the request's own blocks would overwrite another request's K/V (or a free block's)."""
    call = f"slot_mapping(block_table {_short(block_ids)}, block_size {block_size}, start {start}, end {end})"

    def broken(invariant: str, what: str) -> seams.SeamContractError:
        return seams.SeamContractError("slot_mapping", invariant, f"{call} returned {what}")

    try:
        slots = _block_ids(got)
    except TypeError:
        raise broken("the answer is a list of ints", _short(got)) from None
    if len(slots) != end - start:
        raise broken("one slot per position start .. end-1", f"{len(slots)} slots for {end - start} positions: "
                                                              f"{_short(slots)}")
    held = set(block_ids)
    for p, s in zip(range(start, end), slots):
        if s < 0 or s // block_size not in held:
            raise broken("every slot lies in a block of the request's table",
                         f"slot {s} for position {p}: block {s // block_size}, not in the table")
    if len(set(slots)) != len(slots):
        raise broken("two positions never share a slot", _short(slots))
    return slots


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The hash of one full block: chained from its parent block's hash and its own tokens.

    Python's hash of a tuple of ints is the same in every process (only str/bytes hashes
    are salted), so cached hashes are reproducible.
    """
    return hash((parent_hash, tuple(token_ids)))


def block_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (at most ``num_blocks`` of them)."""
    n = len(token_ids) // block_size if num_blocks is None else min(num_blocks, len(token_ids) // block_size)
    out, h = [], ROOT_HASH
    for i in range(n):
        h = hash_block_tokens(h, token_ids[i * block_size:(i + 1) * block_size])
        out.append(h)
    return out


def longest_cached_prefix(token_ids: Sequence[int], block_size: int, cached: dict[int, int],
                          max_blocks: int | None = None) -> list[int]:
    """Block ids of the longest run of ``token_ids``' full blocks found in ``cached`` (hash -> block).

    The run stops at the first miss: a block further on cannot be used without the K/V
    of the blocks before it. ``max_blocks`` caps the run (the engine leaves at least the
    last prompt token to compute, so there are logits to sample from).
    """
    hit: list[int] = []
    for h in block_hashes(token_ids, block_size, max_blocks):
        b = cached.get(h)
        if b is None:
            break
        hit.append(b)
    return hit


def min_num_blocks(max_model_len: int, block_size: int) -> int:
    """The smallest cache that can hold one request of ``max_model_len`` tokens.

    Below this the engine could admit a request that can never finish even alone, so
    preemption could not save it: the cache must at least hold one full request.
    """
    return blocks_needed(max_model_len, block_size)


def num_blocks_from_budget(*, block_size: int, max_model_len: int, max_num_seqs: int,
                           kv_bytes_per_token: int, num_blocks: int | None = None,
                           kv_cache_bytes: int | None = None) -> int:
    """How many blocks the paged cache gets, from whichever budget the user gave.

    * ``num_blocks``: taken as is;
    * ``kv_cache_bytes``: as many whole blocks as fit (one block of one token costs
      ``kv_bytes_per_token`` in every layer, K and V);
    * neither: the bytes the contiguous engine reserves, one ``max_model_len`` region
      per batch slot, i.e. ceil(max_num_seqs * max_model_len / block_size) blocks. The
      same memory then serves as many sequences as their *actual* lengths allow.

    Raises ValueError when both are given, or when the cache cannot hold one request
    of ``max_model_len`` tokens.
    """
    if num_blocks is not None and kv_cache_bytes is not None:
        raise ValueError("give num_blocks or kv_cache_bytes, not both: each one sizes the paged KV cache")
    need = min_num_blocks(max_model_len, block_size)
    block_bytes = block_size * kv_bytes_per_token
    if kv_cache_bytes is not None:
        num_blocks = kv_cache_bytes // block_bytes
        if num_blocks < need:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds {num_blocks} blocks of {block_size} tokens "
                f"({block_bytes} bytes each) but one request of max_model_len={max_model_len} tokens needs "
                f"at least {need} blocks: give kv_cache_bytes >= {need * block_bytes} or lower max_model_len")
    elif num_blocks is None:
        num_blocks = blocks_needed(max_num_seqs * max_model_len, block_size)
    if num_blocks < need:
        raise ValueError(
            f"num_blocks={num_blocks} with block_size={block_size} holds {num_blocks * block_size} tokens, "
            f"but one request of max_model_len={max_model_len} tokens needs at least {need} blocks: "
            f"give num_blocks >= {need} or lower max_model_len")
    return num_blocks


class BlockAllocator:
    """A free list of block ids and a reference count per block, with an evictable pool.

    Invariant: a block is free (``free_ids`` or ``evictable``) exactly when its count is 0.
    Freed blocks go to the back of the list and allocation takes from the front, so a
    block just released is the last to be reused: its K/V stays intact the longest.

    Prefix caching adds ``evictable``: free blocks that still hold a registered hash
    (``block_hash[b]`` is not None), least recently freed first. They count as free;
    ``allocate`` takes them only when ``free_ids`` is empty, evicting (forgetting the
    hash) the least recently used first. ``cached`` maps hash -> block for every block
    that holds one, in use or evictable. Without prefix caching nothing is ever hashed,
    ``evictable`` stays empty and the allocator is the plain free list.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks
        self.evictable: OrderedDict[int, float] = OrderedDict()  # cached, count 0, LRU first -> when freed
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks  # what a hashed block holds
        self.cached: dict[int, int] = {}  # hash -> block id
        self.num_evictions = 0
        self.clock: Callable[[], float] = time.perf_counter  # stamps a block entering the evictable pool
        # Called as on_evict(block, hash, tokens) before an evicted block forgets its hash (the host tier).
        self.on_evict: Callable[[int, int, tuple[int, ...]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered hash, in use or evictable."""
        return len(self.cached)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` fresh blocks, each with reference count 1. All or nothing.

        Never-cached free blocks first; then the least recently used evictable ones,
        whose hashes are forgotten (evicted).

        Seams: while the evictable pool is empty this is chapter 3's plain free list
        (``allocate_blocks``); once it holds cached blocks, chapter 6's choice between the
        free list and eviction (``allocate_with_eviction``). One lookup either way.
        """
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks but only {self.num_free} of "
                                    f"{self.num_blocks} are free")
        if self.evictable:
            mine = seams.plugged("allocate_with_eviction")  # a learner's eviction order (chapter 6)
            if mine is not None:
                return self._allocate_plugged(mine, n) if n else []
        else:
            mine = seams.plugged("allocate_blocks")  # a learner's free list (chapter 3); no cached blocks
            if mine is not None:
                return self._allocate_blocks_plugged(mine, n)
        ids = []
        for _ in range(n):
            if self.free_ids:
                b = self.free_ids.popleft()
            else:
                b = lru_victim(self.evictable)
                del self.evictable[b]
                self.evict(b)
            self.ref_counts[b] = 1
            ids.append(b)
        return ids

    def _allocate_plugged(self, mine: Callable, n: int) -> list[int]:
        """``allocate`` through a plugged ``allocate_with_eviction(free_ids, evictable, n)``.

        The function gets copies of the free list and of the evictable pool (least
        recently used first) and returns ``(blocks, evicted)``. Its answer is checked
        before anything changes: ``n`` distinct blocks, each one offered, ``evicted``
        exactly the ones taken from the pool, in order. A wrong answer is a
        ``seams.SeamContractError`` and the allocator is left as it was (no block lost,
        none handed out twice).
        """
        free, pool = list(self.free_ids), list(self.evictable)
        got = mine(list(free), list(pool), n)

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("allocate_with_eviction", invariant, what)

        try:
            blocks, evicted = got
            blocks, evicted = _block_ids(blocks), _block_ids(evicted)
        except (TypeError, ValueError):
            raise broken("it must return (blocks, evicted), two lists of block ids", f"got {_short(got)}") from None
        offered = f"free_ids {_short(free)}, evictable {_short(pool)}"
        if len(blocks) != n:
            raise broken(f"it hands out exactly n={n} blocks", f"returned {len(blocks)} blocks for n={n}: "
                                                                f"{_short(blocks)}")
        free_set, pool_set, seen = set(free), set(pool), set()
        for b in blocks:
            if b in seen:
                raise broken("no block is handed out twice", f"returned block {b} twice: {_short(blocks)}")
            if b not in free_set and b not in pool_set:
                raise broken("every block handed out was free (in free_ids or evictable)",
                             f"returned block {b}, which it was not offered (not free): {offered}")
            seen.add(b)
        want = [b for b in blocks if b in pool_set]
        if evicted != want:
            raise broken("evicted lists exactly the blocks taken from the evictable pool, in the order taken",
                         f"returned evicted={_short(evicted)}, but the blocks it took from the evictable pool "
                         f"are {_short(want)}")
        if len(want) < n:  # some came from the free list
            self.free_ids = deque(b for b in self.free_ids if b not in seen)
        for b in blocks:
            if b in pool_set:
                del self.evictable[b]
                self.evict(b)
            self.ref_counts[b] = 1
        return blocks

    def register(self, block_id: int, block_hash: int, token_ids: Sequence[int]) -> bool:
        """Name an allocated, full block by ``block_hash``. False (nothing changes) when
        another block already holds that hash, or this block already holds one."""
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only an allocated block can be cached")
        if block_hash in self.cached or self.block_hash[block_id] is not None:
            return False
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash
        self.block_tokens[block_id] = tuple(token_ids)
        return True

    def evict(self, block_id: int) -> None:
        """A block taken from the evictable pool for reuse: its hash is forgotten (after
        ``on_evict`` has seen it: the host tier copies the K/V down)."""
        h = self.block_hash[block_id]
        if self.on_evict is not None and h is not None:
            self.on_evict(block_id, h, self.block_tokens[block_id])
        self.forget(block_id)
        self.num_evictions += 1

    def forget(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            del self.cached[h]
            self.block_hash[block_id] = None
            self.block_tokens[block_id] = None

    def touch(self, block_id: int) -> None:
        """One more holder of a cached block, free (evictable) or not: a prefix-cache hit."""
        self._check_id(block_id)
        if self.block_hash[block_id] is None:
            raise ValueError(f"block {block_id} holds no cached prefix")
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def incref(self, block_id: int) -> None:
        """One more holder of an allocated block (it is shared, not copied)."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only an allocated block can be shared")
        self.ref_counts[block_id] += 1

    def fork(self, block_ids: Iterable[int]) -> list[int]:
        """A second block table sharing every block of ``block_ids`` (copy-on-write style)."""
        ids = list(block_ids)
        for b in ids:
            self.incref(b)
        return ids

    def free(self, block_id: int) -> None:
        """Drop one holder; the block is free again when nobody holds it (evictable if cached)."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"double free of block {block_id}: it is already free")
        mine = seams.plugged("free_blocks")  # a learner's free list (chapter 3); not for cached blocks
        if mine is not None and self.block_hash[block_id] is None:
            return self._free_blocks_plugged(mine, block_id)
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hash[block_id] is not None:
                self.evictable[block_id] = self.clock()  # most recently used: evicted last
            else:
                self.free_ids.append(block_id)

    def _allocate_blocks_plugged(self, mine: Callable, n: int) -> list[int]:
        """``allocate`` through a plugged ``allocate_blocks(free_list, ref_counts, n)``, run on copies
        of both lists. Its answer is checked before anything changes: ``n`` distinct blocks, each one
        free, each now held once, taken off the free list with the others left in their order. A
        wrong answer is a ``seams.SeamContractError``: no block is lost or handed out twice."""
        free, counts = list(self.free_ids), list(self.ref_counts)
        got = mine(free, counts, n)
        call = f"allocate_blocks(free list {_short(list(self.free_ids))}, n={n})"

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("allocate_blocks", invariant, f"{call} {what}")

        try:
            ids = _block_ids(got)
        except TypeError:
            raise broken("it returns a list of block ids", f"returned {_short(got)}") from None
        if len(ids) != n:
            raise broken(f"it hands out exactly n={n} blocks", f"returned {len(ids)}: {_short(ids)}")
        offered, taken = set(self.free_ids), set(ids)
        if len(taken) != n:
            raise broken("no block is handed out twice", f"returned {_short(ids)}")
        if not taken <= offered:
            raise broken("every block handed out was free (on the free list)",
                         f"returned {_short(ids)}: {_short(sorted(taken - offered))} not free")
        rest = [b for b in self.free_ids if b not in taken]
        if free != rest:
            raise broken("the blocks handed out leave the free list, the others stay in their order",
                         f"returned {_short(ids)} and left the free list {_short(free)}")
        if any(counts[b] != 1 for b in ids):
            raise broken("each block handed out has reference count 1",
                         f"returned {_short(ids)} with counts {[counts[b] for b in ids]}")
        if any(counts[b] != c for b, c in enumerate(self.ref_counts) if b not in taken):
            changed = [b for b, c in enumerate(self.ref_counts) if b not in taken and counts[b] != c]
            raise broken("no other block's reference count changes", f"changed the counts of blocks {changed}")
        self.free_ids = deque(free)
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def _free_blocks_plugged(self, mine: Callable, block_id: int) -> None:
        """``free`` through a plugged ``free_blocks(free_list, ref_counts, [block_id])``, run on copies
        of both lists and checked before anything changes: the block's count drops by one, no other
        count moves, and the free list gains the block exactly when its count reaches 0 (and loses
        none). A wrong answer is a ``seams.SeamContractError``: no block leaks or is handed out twice."""
        free, counts = list(self.free_ids), list(self.ref_counts)
        mine(free, counts, [block_id])
        before = self.ref_counts[block_id]
        call = f"free_blocks(free list {_short(list(self.free_ids))}, blocks [{block_id}] of count {before})"

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("free_blocks", invariant, f"{call} {what}")

        if counts[block_id] != before - 1:
            raise broken("freeing drops one reference to the block", f"left its count at {counts[block_id]}")
        if counts != self.ref_counts[:block_id] + [before - 1] + self.ref_counts[block_id + 1:]:
            changed = [b for b, c in enumerate(self.ref_counts) if b != block_id and counts[b] != c]
            raise broken("no other block's reference count changes", f"changed the counts of blocks {changed}")
        want = list(self.free_ids) + ([block_id] if before == 1 else [])
        if sorted(free) != sorted(want):
            rule = ("a block whose count reaches 0 goes back on the free list" if before == 1 else
                    "a block still held by another table stays off the free list")
            raise broken(f"{rule}; the other free blocks stay", f"left the free list {_short(free)}")
        self.free_ids = deque(free)
        self.ref_counts[block_id] = before - 1

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be an integer in [0, {self.num_blocks}), got {block_id!r}")

    def check_invariants(self) -> None:
        """Assert the free list, the evictable pool, the counts and the cache agree (used by the tests)."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        assert not free & set(self.evictable), "a block is both free and evictable"
        for b, c in enumerate(self.ref_counts):
            assert c >= 0, f"block {b} has a negative reference count {c}"
            assert (c == 0) == (b in free or b in self.evictable), \
                f"block {b}: count {c} but free: {b in free}, evictable: {b in self.evictable}"
            if b in self.evictable:
                assert self.block_hash[b] is not None, f"evictable block {b} holds no hash"
            if b in free:
                assert self.block_hash[b] is None, f"free block {b} still holds a hash"
        assert {h: b for b, h in enumerate(self.block_hash) if h is not None} == self.cached, \
            "the hash table differs from the blocks' hashes"


def _block_ids(values: Any) -> list[int]:
    """``values`` as a list of int block ids (numpy ints too); TypeError for anything else."""
    if isinstance(values, (str, bytes)):
        raise TypeError("a string is not a list of block ids")
    out = []
    for v in values:
        if isinstance(v, bool):
            raise TypeError("a bool is not a block id")
        out.append(operator.index(v))
    return out


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...]"


def blocks_to_offload(evictable: Sequence[tuple[int, float]], on_host: set[int], now: float,
                      idle_s: float) -> list[int]:
    """The evictable blocks to copy to the host tier now: idle for ``idle_s`` seconds or
    more (``now - freed_at >= idle_s``) and not already held there, least recently freed first.

    ``evictable`` is the pool in LRU order, ``(block, freed_at)``: the idle blocks lead it,
    so the scan stops at the first block that is not idle yet.
    """
    chosen = []
    for b, freed_at in evictable:
        if now - freed_at < idle_s:
            break
        if b not in on_host:
            chosen.append(b)
    return chosen


def lru_victim(evictable: "OrderedDict[int, float]") -> int:
    """The evictable block to reuse next: the least recently freed (the front of the pool).

    A block freed last is the likeliest to be asked for again (the prompt of a
    conversation that just finished a turn), so it is evicted last. A request frees its
    blocks tail first (``BlockManager.free``), so a prompt's first blocks, shared by the
    most prompts, outlive its tail.
    """
    if not evictable:
        raise NoFreeBlocksError("no evictable block")
    return next(iter(evictable))


class BlockManager:
    """Block tables of requests on top of a ``BlockAllocator``.

    A request's table is ``request.block_ids`` (what the model runner reads to build
    ``block_tables`` and ``slot_mapping``); the manager also indexes the tables by
    request so it can tell who holds what.

    ``watermark`` (a fraction of all blocks) is kept free when *admitting* a request,
    as vLLM does: a request admitted into a nearly full cache would only force a
    preemption a few steps later. Growing a running request ignores it.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0,
                 enable_prefix_caching: bool = False):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[Any, list[int]] = {}  # request -> its block_ids (the same list object)
        self.enable_prefix_caching = enable_prefix_caching
        self._hashes: dict[Any, list[int]] = {}  # request -> chained hashes of its full blocks so far
        self._num_registered: dict[Any, int] = {}  # request -> leading blocks already offered to the cache
        self.host: HostTier | None = None  # the host KV tier (kv_offload), set by enable_host_tier

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return self.allocator.num_used / self.allocator.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a cached prefix (in use or evictable); 0 without prefix caching."""
        return self.allocator.num_cached

    @property
    def num_evictable_blocks(self) -> int:
        """Free blocks that still hold a cached prefix: reusable by a hit until evicted."""
        return len(self.allocator.evictable)

    @property
    def num_evictions(self) -> int:
        return self.allocator.num_evictions

    # -- the host tier (kv_offload, chapter 9) ---------------------------------------
    def enable_host_tier(self, host: HostTier) -> None:
        """Keep evicted and idle prefix blocks in ``host`` (needs prefix caching)."""
        if not self.enable_prefix_caching:
            raise ValueError("a host KV tier keeps prefix-cache blocks: enable prefix caching "
                             "(enable_prefix_caching=True) to use kv_offload")
        self.host = host
        self.allocator.on_evict = self._offload_evicted

    def _offload_evicted(self, block: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        self.host.cancel_restores_into(block)  # reused before its restore ran: nobody will read it
        self.host.offload(block, block_hash, tokens)

    def offload_idle(self, now: float) -> int:
        """Queue host copies of the evictable blocks idle since ``now - idle_s`` or longer
        (those the host does not hold yet). Returns how many copies were queued."""
        host = self.host
        if host is None:
            return 0
        a = self.allocator
        mine = seams.plugged("blocks_to_offload")  # a learner's choice (chapter 9), when plugged in
        if mine is None:  # the idle blocks lead the pool: scan up to the first one that is not
            idle = itertools.takewhile(lambda item: now - item[1] >= host.idle_s, a.evictable.items())
            chosen = [b for b, _ in idle if not host.holds(a.block_hash[b])]
        else:
            pool = list(a.evictable.items())  # LRU first
            on_host = {b for b, _ in pool if host.holds(a.block_hash[b])}
            chosen = self._checked_offload_choice(mine(list(pool), set(on_host), now, host.idle_s), pool, on_host,
                                                  now, host.idle_s)
        return sum(host.offload(b, a.block_hash[b], a.block_tokens[b], idle=True) for b in chosen)

    @staticmethod
    def _checked_offload_choice(got: Any, pool: list[tuple[int, float]], on_host: set[int], now: float,
                                idle_s: float) -> list[int]:
        """What a plugged ``blocks_to_offload`` returned, checked before any copy is queued: evictable blocks
        the host lacks, each once, each idle for ``idle_s`` or more, in the pool's (LRU) order. A wrong answer
        is a ``seams.SeamContractError``."""

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("blocks_to_offload", invariant, what)

        try:
            chosen = _block_ids(got)
        except TypeError:
            raise broken("it must return a list of block ids", f"got {_short(got)}") from None
        freed_at = dict(pool)
        position = {b: i for i, (b, _) in enumerate(pool)}
        seen: set[int] = set()
        for k, b in enumerate(chosen):
            if b not in freed_at:
                raise broken("every block is in the evictable pool",
                             f"returned block {b}, which is not in the evictable pool {_short([x for x, _ in pool])}")
            if b in on_host:
                raise broken("copy only blocks the host tier lacks",
                             f"returned block {b}, whose K/V the host tier already holds")
            if b in seen:
                raise broken("each block is copied once", f"returned block {b} twice: {_short(chosen)}")
            if now - freed_at[b] < idle_s:
                raise broken(f"a block is copied once it is idle (now - freed_at >= idle_s = {idle_s:g} s)",
                             f"returned block {b}, freed at {freed_at[b]:.6g}, idle {now - freed_at[b]:.6g} s at "
                             f"now {now:.6g}")
            if k and position[b] < position[chosen[k - 1]]:
                raise broken("the blocks come in the pool's order (least recently freed first)",
                             f"returned block {b} after block {chosen[k - 1]}, which was freed later: "
                             f"{_short(chosen)}")
            seen.add(b)
        return chosen

    def take_kv_copies(self) -> KVCopies:
        """The copies between the tiers owed so far (to make before the next forward writes K/V)."""
        return KVCopies() if self.host is None else self.host.take_copies()

    # -- prefix caching -------------------------------------------------------------
    def _request_hashes(self, request: Any, num_blocks: int) -> list[int]:
        """The chained hashes of ``request``'s first ``num_blocks`` full blocks (extended lazily)."""
        hashes = self._hashes.setdefault(request, [])
        tokens, bs = request.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else ROOT_HASH, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def lookup_prefix(self, request: Any) -> list[int]:
        """Cached blocks for the longest run of ``request``'s leading full blocks (no side effect).

        At most ``(num_tokens - 1) // block_size`` blocks: the last token is always
        computed, so the step that finishes the prompt has logits to sample from.
        Empty without prefix caching, or when the request already holds blocks.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        mine = seams.plugged("longest_cached_prefix")  # a learner's lookup (chapter 6), when plugged in
        if mine is not None:
            return self._lookup_plugged(mine, request, max_blocks)
        a, bs, tokens = self.allocator, self.block_size, request.all_token_ids
        hit, parent = [], ROOT_HASH
        for i in range(max_blocks):
            block = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block_tokens(parent, block)
            b = a.cached.get(h)
            # The stored tokens are compared too: a hash collision is a miss, never wrong K/V.
            if b is None or a.block_tokens[b] != block:
                break
            hit.append(b)
            parent = h
        return self._extend_from_host(request, hit, max_blocks, parent)

    def _extend_from_host(self, request: Any, hit: list, max_blocks: int, parent: int) -> list:
        """``hit`` (device blocks; ``parent`` the hash of its last) continued past its end by the
        blocks either tier holds: a device block where the device has it, else a ``HostHit``
        (restored on admission)."""
        host = self.host
        if host is None or len(hit) >= max_blocks:
            return hit
        a, bs, tokens = self.allocator, self.block_size, request.all_token_ids
        for i in range(len(hit), max_blocks):
            block = tuple(tokens[i * bs:(i + 1) * bs])
            h = parent = hash_block_tokens(parent, block)
            b = a.cached.get(h)
            if b is not None and a.block_tokens[b] == block:
                hit.append(b)
                continue
            hb = host.lookup(h, block)
            if hb is None:
                break
            hit.append(HostHit(hb))
        return hit

    def _lookup_plugged(self, mine: Callable, request: Any, max_blocks: int) -> list[int]:
        """``lookup_prefix`` through a plugged ``longest_cached_prefix(token_ids, block_size, cached, max_blocks)``.

        The function gets a copy of the tokens and a read-only view of the hash table.
        Every block it returns is checked against the table before the request may share
        it: at most ``max_blocks`` blocks, block ``i`` holding the hash of the prompt's
        block ``i`` (so the run is chained from the first block and stops at a miss). A
        wrong answer is a ``seams.SeamContractError`` (never wrong K/V). A block whose
        hash matches but whose stored tokens differ (a hash collision) ends the run
        there, a miss, as in the library's lookup.
        """
        a, bs = self.allocator, self.block_size
        tokens = list(request.all_token_ids)
        got = mine(list(tokens), bs, MappingProxyType(a.cached), max_blocks)
        rid = getattr(request, "request_id", request)

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("longest_cached_prefix", invariant, what)

        try:
            hit = _block_ids(got)
        except TypeError:
            raise broken("it must return a list of block ids", f"got {_short(got)}") from None
        if len(hit) > max_blocks:
            raise broken(f"at most max_blocks = {max_blocks} blocks for request {rid!r} of {request.num_tokens} "
                         f"tokens (the last prompt token is always computed)",
                         f"returned {len(hit)} blocks: {_short(hit)}")
        parent = ROOT_HASH
        for i, h in enumerate(block_hashes(tokens, bs, len(hit))):
            b = hit[i]
            if not 0 <= b < a.num_blocks or a.block_hash[b] != h:
                holder = a.cached.get(h)
                truth = "is not cached: the run stops there" if holder is None else f"is cached in block {holder}"
                raise broken("block i of the answer holds the prompt's block i, chained from the blocks before it",
                             f"returned block {b} at position {i} for request {rid!r}, but that block does not "
                             f"hold the prompt's block {i} (which {truth}); got {_short(hit)}")
            if a.block_tokens[b] != tuple(tokens[i * bs:(i + 1) * bs]):
                return hit[:i]  # a hash collision: a miss, never wrong K/V
            parent = h
        return self._extend_from_host(request, hit, max_blocks, parent)

    def can_share_prefix(self, request: Any, hit: list[int], num_tokens: int, admit: bool = True) -> bool:
        """``can_grow`` for a request about to share the cached blocks ``hit``: the hits it
        takes out of the evictable pool leave the free blocks as surely as new ones."""
        on_device = [b for b in hit if not isinstance(b, HostHit)]  # a host hit takes a fresh block
        need = max(blocks_needed(num_tokens, self.block_size) - len(on_device), 0)
        from_pool = sum(1 for b in on_device if self.allocator.ref_counts[b] == 0)
        reserve = self.watermark_blocks if admit and self.tables else 0
        return need + from_pool + reserve <= self.allocator.num_free

    def share_prefix(self, request: Any, hit: list[int]) -> None:
        """Start ``request``'s table with the cached blocks ``hit`` (from ``lookup_prefix``)."""
        if request in self.tables or request.block_ids:
            raise ValueError(f"request {getattr(request, 'request_id', request)!r} already holds blocks")
        a = self.allocator
        for b in hit:
            if not isinstance(b, HostHit):
                a.touch(b)  # first: a device hit must not be evicted by the restores' allocations
        restored = [i for i, b in enumerate(hit) if isinstance(b, HostHit)]
        if restored:
            if self.host is None:
                raise ValueError("a HostHit without a host tier")
            for i in restored:  # else the allocation below could offload into the very host block
                self.host.pin(hit[i].host_block)
            hashes = self._request_hashes(request, restored[-1] + 1)
            tokens, bs = request.all_token_ids, self.block_size
            hit = list(hit)
            for i, b in zip(restored, a.allocate(len(restored))):
                a.register(b, hashes[i], tokens[i * bs:(i + 1) * bs])
                self.host.restore(hit[i].host_block, b)
                hit[i] = b
        request.block_ids.extend(hit)
        self.tables[request] = request.block_ids
        self._num_registered[request] = len(hit)

    def cache_blocks(self, request: Any, num_tokens: int) -> int:
        """Offer ``request``'s full blocks among its first ``num_tokens`` tokens to the cache.

        Called when a step that writes them is scheduled. A block whose hash another
        block already holds stays uncached (the K/V is the same; one copy is enough).
        Returns how many blocks were newly registered.
        """
        if not self.enable_prefix_caching:
            return 0
        table = self.tables.get(request)
        if table is None:
            return 0
        n = min(num_tokens, request.num_tokens) // self.block_size
        n = min(n, len(table))
        start = self._num_registered.get(request, 0)
        if n <= start:
            return 0
        hashes = self._request_hashes(request, n)
        tokens, bs = request.all_token_ids, self.block_size
        added = 0
        for i in range(start, n):
            added += self.allocator.register(table[i], hashes[i], tokens[i * bs:(i + 1) * bs])
        self._num_registered[request] = n
        return added

    def blocks_to_grow(self, request: Any, num_tokens: int) -> int:
        """New blocks ``request`` needs so its table covers ``num_tokens`` tokens."""
        return max(blocks_needed(num_tokens, self.block_size) - len(request.block_ids), 0)

    def can_grow(self, request: Any, num_tokens: int, admit: bool = False) -> bool:
        """Is there room to cover ``num_tokens`` tokens of ``request``?

        ``admit=True`` is the check for a request not yet running: it also keeps the
        watermark free, unless no other request holds a block (then the watermark would
        only keep the cache idle, and could stall a request that fits the cache).
        """
        need = self.blocks_to_grow(request, num_tokens)
        reserve = self.watermark_blocks if admit and self.tables else 0
        return need + reserve <= self.allocator.num_free

    def grow(self, request: Any, num_tokens: int) -> list[int]:
        """Append blocks to ``request.block_ids`` until it covers ``num_tokens`` tokens.

        Returns the new blocks. Raises NoFreeBlocksError (and changes nothing) when
        there are not enough free blocks: ask ``can_grow`` first.
        """
        table = self.tables.get(request)
        if table is None and request.block_ids:
            raise ValueError(f"request {getattr(request, 'request_id', request)!r} holds blocks "
                             f"{request.block_ids} that this manager did not give it")
        try:
            new = self.allocator.allocate(self.blocks_to_grow(request, num_tokens))
        except seams.SeamContractError:
            # A plugged allocator broke its contract while a request was being admitted: it holds
            # an empty table, so aborting it (engine.run does) frees nothing and raises nothing new.
            if table is None:
                self.tables[request] = request.block_ids
            raise
        if table is None:
            self.tables[request] = table = request.block_ids
        table.extend(new)
        return new

    def free(self, request: Any) -> None:
        """Return every block of ``request`` and empty its table. Freeing twice is an error."""
        table = self.tables.pop(request, None)
        if table is None:
            raise ValueError(f"request {getattr(request, 'request_id', request)!r} holds no blocks "
                             "of this manager (freed twice?)")
        # Reverse order: the tail of a sequence goes back first, so its first blocks
        # (the prompt, the likeliest to be shared later) are the last to be reused.
        for b in reversed(table):
            self.allocator.free(b)
        table.clear()
        self._hashes.pop(request, None)
        self._num_registered.pop(request, None)

    def shrink(self, request: Any, num_tokens: int) -> list[int]:
        """Free the trailing blocks of ``request`` beyond those that cover ``num_tokens`` tokens.

        Speculative decoding grows a table for k drafted tokens, then keeps the K/V of
        the accepted ones only: the blocks past them go back to the free list (last block
        first, as in ``free``). The table stays registered, even if it becomes empty.
        Returns the freed blocks.
        """
        table = self.tables.get(request)
        if table is None:
            raise ValueError(f"request {getattr(request, 'request_id', request)!r} holds no blocks "
                             "of this manager")
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an integer >= 0, got {num_tokens!r}")
        mine = seams.plugged("rollback_blocks")  # a learner's roll-back (chapter 5), when plugged in
        if mine is not None:
            freed = self._shrink_plugged(mine, request, table, num_tokens)
        else:
            keep = blocks_needed(num_tokens, self.block_size)
            freed = table[keep:]
            del table[keep:]  # in place: request.block_ids is the same list object
        if request in self._num_registered:
            self._num_registered[request] = min(self._num_registered[request], len(table))
        for b in reversed(freed):
            self.allocator.free(b)
        return freed

    def _shrink_plugged(self, mine: Callable, request: Any, table: list[int], num_tokens: int) -> list[int]:
        """A learner's roll-back, run on a copy of the table and checked before any block goes back:
        the kept tokens' K/V stays, and what is freed is exactly the tail past it, each block once."""

        def broken(invariant: str, got: str) -> seams.SeamContractError:
            return seams.SeamContractError("rollback_blocks", invariant, got)

        keep = -(-num_tokens // self.block_size)  # arithmetic, not blocks_needed: that may be a plugged seam too
        trimmed = list(table)
        freed = [int(b) for b in mine(trimmed, num_tokens, self.block_size)]
        where = (f"request {getattr(request, 'request_id', request)!r} keeps {num_tokens} tokens "
                 f"(block size {self.block_size}) of its table {table}")
        if trimmed != table[:keep]:
            raise broken(f"the table is trimmed in place to the {keep} blocks the kept tokens need",
                         f"{where}: the table becomes {trimmed}")
        if freed != table[keep:]:
            raise broken("the blocks returned are the ones removed from the end, in table order",
                         f"{where}: it returns {freed}, removed {table[keep:]}")
        del table[keep:]  # in place: request.block_ids is the same list object
        return freed

    def holds(self, request: Any) -> bool:
        return request in self.tables

    def slot_mapping(self, request: Any, start: int, end: int) -> list[int]:
        """Cache slots of positions ``start .. end-1`` of ``request``."""
        return slots_for(request.block_ids, self.block_size, start, end)

    def check_invariants(self) -> None:
        """Assert every block is either free or held, with counts matching the tables."""
        self.allocator.check_invariants()
        counts = [0] * self.num_blocks
        for table in self.tables.values():
            for b in table:
                counts[b] += 1
        assert counts == self.allocator.ref_counts, "reference counts differ from the block tables"
        assert set(self._num_registered) <= set(self.tables), "cache bookkeeping of a request without blocks"
        if self.host is not None:
            self.host.check_invariants()
            for d, _ in self.host.pending().ins:
                assert self.allocator.block_hash[d] is not None, f"a restore into block {d}, which holds no hash"
