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
"""
from __future__ import annotations

from collections import deque
from typing import Any, Iterable


class NoFreeBlocksError(RuntimeError):
    """The allocator was asked for more blocks than are free (ask ``can_allocate`` first)."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


def slots_for(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``start .. end-1`` of a request holding ``block_ids``.

    The model runner builds each step's slot_mapping tensor with it.
    """
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


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
    """A free list of block ids and a reference count per block.

    Invariant: a block is on the free list exactly when its count is 0. Freed blocks
    go to the back of the list and allocation takes from the front, so a block just
    released is the last to be reused: its K/V stays intact the longest, which is what
    a prefix cache will want.
    """

    def __init__(self, num_blocks: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_ids)

    def allocate(self, n: int = 1) -> list[int]:
        """``n`` fresh blocks, each with reference count 1. All or nothing."""
        if n > len(self.free_ids):
            raise NoFreeBlocksError(f"asked for {n} blocks but only {len(self.free_ids)} of "
                                    f"{self.num_blocks} are free")
        ids = [self.free_ids.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

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
        """Drop one holder; the block is free again when nobody holds it."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"double free of block {block_id}: it is already free")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_ids.append(block_id)

    def _check_id(self, block_id: int) -> None:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id must be an integer in [0, {self.num_blocks}), got {block_id!r}")

    def check_invariants(self) -> None:
        """Assert the free list and the counts agree (used by the tests)."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        for b, c in enumerate(self.ref_counts):
            assert c >= 0, f"block {b} has a negative reference count {c}"
            assert (c == 0) == (b in free), f"block {b}: count {c} but on free list: {b in free}"


class BlockManager:
    """Block tables of requests on top of a ``BlockAllocator``.

    A request's table is ``request.block_ids`` (what the model runner reads to build
    ``block_tables`` and ``slot_mapping``); the manager also indexes the tables by
    request so it can tell who holds what.

    ``watermark`` (a fraction of all blocks) is kept free when *admitting* a request,
    as vLLM does: a request admitted into a nearly full cache would only force a
    preemption a few steps later. Growing a running request ignores it.
    """

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be a fraction in [0, 1), got {watermark!r}")
        self.allocator = BlockAllocator(num_blocks)
        self.block_size = block_size
        self.watermark_blocks = int(watermark * num_blocks)
        self.tables: dict[Any, list[int]] = {}  # request -> its block_ids (the same list object)

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
        new = self.allocator.allocate(self.blocks_to_grow(request, num_tokens))
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
        keep = blocks_needed(num_tokens, self.block_size)
        freed = table[keep:]
        del table[keep:]  # in place: request.block_ids is the same list object
        for b in reversed(freed):
            self.allocator.free(b)
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
