"""A second KV tier: prefix-cache blocks kept in host memory after the device pool lets them go.

With prefix caching (chapter 6) a freed block keeps its K/V while it waits in the
device's evictable pool; when the pool is needed, the least recently used block is
evicted and its K/V is gone: a user who comes back for another turn recomputes the
whole conversation. The host tier keeps those blocks one level down:

* **offload**: a hashed block evicted under pressure, or left idle in the evictable
  pool for ``idle_s`` seconds, is copied to a host block (device -> host). The host
  pool is an LRU of its own: a full pool reuses its least recently used block.
* **restore**: a prefix lookup that misses on the device and hits on the host gets a
  fresh device block, registered under the same hash, and a host -> device copy
  instead of recomputing those tokens.

This module is the bookkeeping only (plain Python, like ``block_manager``): which host
block holds which hash, and the copies a step owes. The copies themselves are made by
the model runner (``host_kv.HostKVCache``) at the start of the next forward, all of a
step's in one batch: device -> host first, then host -> device, before any K/V is
written. Nothing writes K/V but a forward, so a block queued for offload still holds
its K/V when the copy runs, even if the device pool has handed it to someone else.

A host block with a copy pending this step is *pinned*: it is neither reused for
another offload nor dropped until the copies are taken (``take_copies``).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Sequence

from minillm.config import DEFAULT_IDLE_S, check_kv_offload

@dataclass(frozen=True, slots=True)
class HostHit:
    """A prefix block found in the host tier (``BlockManager.lookup_prefix`` lists it
    among the device block ids): admitting the request restores it into a new device block."""
    host_block: int


@dataclass(slots=True)
class KVCopies:
    """The copies one step owes, in the order they must run: ``outs`` (device block,
    host block) first, then ``ins`` (host block, device block)."""
    outs: list[tuple[int, int]] = field(default_factory=list)
    ins: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outs or self.ins)


class HostTier:
    """The host pool's bookkeeping: hash -> host block, LRU order, the copies pending."""

    def __init__(self, num_blocks: int, idle_s: float = DEFAULT_IDLE_S):
        check_kv_offload({"host_blocks": num_blocks, "idle_s": idle_s})
        self.num_blocks = num_blocks
        self.idle_s = float(idle_s)
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()  # host blocks holding a hash, least recently used first
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> host block
        self.pinned: set[int] = set()  # host blocks a pending copy reads or writes
        self._copies = KVCopies()
        # Run totals.
        self.blocks_out = 0  # device -> host copies
        self.blocks_in = 0  # host -> device copies (host hits)
        self.idle_offloads = 0  # of blocks_out: idle blocks (the rest were evicted under pressure)
        self.evictions = 0  # host blocks reused for another hash
        self.dropped = 0  # offloads refused: every host block was pinned

    @property
    def num_used(self) -> int:
        return len(self.lru)

    def lookup(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """The host block holding ``block_hash`` with exactly ``tokens`` (a collision is a miss)."""
        b = self.cached.get(block_hash)
        if b is None or self.block_tokens[b] != tuple(tokens):
            return None
        return b

    def holds(self, block_hash: int) -> bool:
        return block_hash in self.cached

    def offload(self, device_block: int, block_hash: int, tokens: Sequence[int], idle: bool = False) -> bool:
        """Queue a copy of ``device_block`` (holding ``block_hash``) into a host block.

        Nothing to copy when the host already holds the hash (it becomes the most
        recently used). A full pool reuses its least recently used unpinned block; with
        every block pinned the offload is dropped (counted). Returns whether a copy was queued.
        """
        held = self.cached.get(block_hash)
        if held is not None:
            self.lru.move_to_end(held)
            return False
        if self.free_ids:
            h = self.free_ids.popleft()
        else:
            h = next((b for b in self.lru if b not in self.pinned), None)
            if h is None:
                self.dropped += 1
                return False
            del self.lru[h]
            del self.cached[self.block_hash[h]]
            self.evictions += 1
        self.block_hash[h], self.block_tokens[h] = block_hash, tuple(tokens)
        self.cached[block_hash] = h
        self.lru[h] = None
        self.pinned.add(h)
        self._copies.outs.append((device_block, h))
        self.blocks_out += 1
        self.idle_offloads += idle
        return True

    def pin(self, host_block: int) -> None:
        """Keep ``host_block`` (holding a hash) until the copies are taken."""
        if self.block_hash[host_block] is None:
            raise ValueError(f"host block {host_block} holds no cached prefix")
        self.pinned.add(host_block)

    def restore(self, host_block: int, device_block: int) -> None:
        """Queue the copy of ``host_block`` into ``device_block`` (a host hit being admitted)."""
        if self.block_hash[host_block] is None:
            raise ValueError(f"host block {host_block} holds no cached prefix")
        self.lru.move_to_end(host_block)
        self.pinned.add(host_block)
        self._copies.ins.append((host_block, device_block))
        self.blocks_in += 1

    def cancel_restores_into(self, device_block: int) -> None:
        """``device_block`` was evicted before its restore ran: drop the copy (nobody reads it)."""
        self._copies.ins = [(h, d) for h, d in self._copies.ins if d != device_block]

    def pending(self) -> KVCopies:
        return self._copies

    def take_copies(self) -> KVCopies:
        """The copies owed so far, handed to whoever makes them now; unpins their host blocks."""
        copies, self._copies = self._copies, KVCopies()
        self.pinned.clear()
        return copies

    def check_invariants(self) -> None:
        """Assert the free list, the LRU, the hashes and the pins agree (used by the tests)."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "a host block is on the free list twice"
        assert not free & set(self.lru), "a host block is both free and holding a hash"
        assert free | set(self.lru) == set(range(self.num_blocks)), "a host block is lost"
        assert {h: b for b, h in enumerate(self.block_hash) if h is not None} == self.cached, \
            "the host hash table differs from the host blocks' hashes"
        assert all(self.block_hash[b] is not None for b in self.lru), "a host block in the LRU holds no hash"
        assert self.pinned <= set(self.lru), "a pinned host block holds no hash"
        for _, h in self._copies.outs:
            assert h in self.pinned, f"host block {h} has a pending copy but is not pinned"
        for h, _ in self._copies.ins:
            assert h in self.pinned, f"host block {h} has a pending restore but is not pinned"


__all__ = ["HostTier", "HostHit", "KVCopies"]
