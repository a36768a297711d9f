"""Step records: what each engine step did, written by the engine after every step; and
the engine's snapshot: its state between two steps, as plain numbers.

The numbers built from step records (slot utilization, KV waste, latency percentiles) and
their definitions are in ``minillm/bench/summary.py``. ``EngineSnapshot`` is what every
reader of the live engine gets (``LLMEngine.snapshot()``): ``AsyncLLM``, the server's
``/metrics`` and the dashboard's ``EngineSource``. A leaf: nothing here imports torch or
any other part of minillm.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence


@dataclass(slots=True)
class StepRecord:
    """What one engine step did: the raw material of every chart."""

    step: int
    start: float
    end: float
    request_ids: list[str]
    num_new_tokens: list[int]
    num_sampled: int
    num_running: int
    num_waiting: int
    num_slots: int = 0  # B, the batch slots of the engine
    token_slots: int = 0  # total token-slots of the step (see the module docstring)
    padded_tokens: int = 0  # positions of a padded rectangle that carry no token
    idle_slots: int = 0  # batch slots that did no useful work this step
    context_tokens: int = 0  # sum of the rows' context lengths: the K/V attention reads
    max_context: int = 0  # the longest row's context length
    kv_reserved_bytes: int = 0  # KV memory held by requests after the step
    kv_used_bytes: int = 0  # ... of which holds real tokens
    held_ids: list[str] = field(default_factory=list)  # hold a slot without running (static)
    # Prefix caching (chapter 6): the K/V tokens this step's admissions needed and how many
    # the cache held; blocks holding a cached prefix after the step, and of those the free
    # (evictable) ones.
    prefill_tokens_requested: int = 0
    prefix_hit_tokens: int = 0
    num_cached_blocks: int = 0
    num_evictable_blocks: int = 0
    # The host KV tier (chapter 9): of prefix_hit_tokens, those restored from host memory;
    # blocks copied device -> host and host -> device before this step's forward.
    host_hit_tokens: int = 0
    kv_blocks_offloaded: int = 0
    kv_blocks_restored: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def num_rows(self) -> int:
        return len(self.num_new_tokens)

    @property
    def utilization(self) -> float:
        return self.num_tokens / self.token_slots if self.token_slots else 0.0


@dataclass(frozen=True, slots=True)
class OffloadSnapshot:
    """The host KV tier's counters (``kv_offload``), cumulative over the engine's life."""

    host_blocks_total: int
    host_blocks_used: int  # holding a cached prefix
    blocks_out: int  # device -> host copies
    blocks_in: int  # host -> device copies (host hits)
    bytes_out: int
    bytes_in: int
    copy_seconds: float  # host time spent making the copies
    device_hit_tokens: int  # prefix-cache hits found on the device
    host_hit_tokens: int  # ... and restored from the host


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state at one moment, as plain numbers (``LLMEngine.snapshot()``).

    Taken between two steps by the thread that steps the engine, or from another thread
    while it steps (then a state during a step: each number is read once, not all at one
    instant). Counters are cumulative over the life of the object that holds them; the
    ``*_owner`` fields say which object that is (its ``id``), so a reader can tell a
    counter that restarted from zero (another engine, ``Speculator.reset_stats``) from one
    that stood still.
    """

    time: float  # the engine's clock when taken
    num_steps: int  # step records kept (AsyncLLM trims them in a long-running server)
    num_running: int
    num_waiting: int  # queued, arrived or not
    running_by_class: dict[str, int]  # priority class -> requests (chapter 6: "standard" without priorities)
    waiting_by_class: dict[str, int]
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_cached: int  # holding a cached prefix, in use or evictable (0 without prefix caching)
    num_preemptions: int
    preemptions_owner: int  # id() of the scheduler counting them
    last_step_rows: int  # rows of the latest step that ran (0 before the first)
    last_step_end: float | None  # when it ended (engine clock), None before the first
    spec_num_drafts: int | None = None  # drafted tokens sent to verification; None: no speculation
    spec_num_accepted: int | None = None
    spec_acceptance_rate: float | None = None  # None also before the first verification
    spec_owner: int | None = None  # id() of the SpecStats counting them
    slo: Any = None  # the SLO controller's SloSnapshot (minillm/slo.py): budget, targets, p95s; None: off
    kv_offload: OffloadSnapshot | None = None  # the host KV tier's counters; None: no host tier

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks in use."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def count_classes(requests: Iterable[Any]) -> dict[str, int]:
    """Priority class -> how many of ``requests`` (``Request.metrics.priority_class``)."""
    counts: dict[str, int] = {}
    for r in requests:
        c = r.metrics.priority_class
        counts[c] = counts.get(c, 0) + 1
    return counts


def slot_accounting(num_new_tokens: Sequence[int], num_slots: int,
                    padded_width: int | None = None) -> tuple[int, int, int]:
    """(token_slots, padded_tokens, idle_slots) of one step.

    ``num_new_tokens``: the useful tokens of each active row. ``padded_width`` is None
    for a varlen step, else the width W of the padded [B, W] rectangle.
    """
    rows = len(num_new_tokens)
    idle = max(num_slots - rows, 0)
    if padded_width is None:
        return sum(num_new_tokens) + idle, 0, idle
    width = max([padded_width, *num_new_tokens])
    padded = sum(width - n for n in num_new_tokens)
    return max(num_slots, rows) * width, padded, idle


def kv_usage(holders: Iterable[Any], block_size: int, bytes_per_token: int) -> tuple[int, int]:
    """(reserved, used) KV bytes of the requests in ``holders``.

    Reserved: every block a request holds, full or not. Used: the tokens whose K/V are
    in the cache (``num_computed_tokens``).
    """
    reserved = used = 0
    for r in holders:
        reserved += len(r.block_ids) * block_size
        used += r.num_computed_tokens
    return reserved * bytes_per_token, used * bytes_per_token


def record_step(step: int, start: float, end: float, out: Any, num_sampled: int, scheduler: Any,
                block_size: int, kv_bytes_per_token: int) -> StepRecord:
    """The StepRecord of a step whose ``scheduler.update`` has run.

    ``out`` is the SchedulerOutput (``padded_width`` set by a padded scheduler: static).
    The requests holding KV space are the scheduler's ``kv_holders``: the running ones,
    or, in static batching, the whole group until its last member finishes.
    """
    rows = out.rows
    new = [row.num_new_tokens for row in rows]
    slots, padded, idle = slot_accounting(new, scheduler.max_num_seqs, out.padded_width)
    holders = list(scheduler.kv_holders)
    reserved, used = kv_usage(holders, block_size, kv_bytes_per_token)
    bm = scheduler.block_manager
    running_ids = {row.request.request_id for row in rows}
    ctx = [row.request.num_computed_tokens for row in rows]  # after update: this step's tokens included
    return StepRecord(
        step, start, end, [row.request.request_id for row in rows], new, num_sampled,
        len(scheduler.running), len(scheduler.waiting),
        num_slots=scheduler.max_num_seqs, token_slots=slots, padded_tokens=padded, idle_slots=idle,
        context_tokens=sum(ctx), max_context=max(ctx, default=0),
        kv_reserved_bytes=reserved, kv_used_bytes=used,
        held_ids=[r.request_id for r in holders if r.request_id not in running_ids and r.is_finished],
        prefill_tokens_requested=out.prefill_tokens_requested, prefix_hit_tokens=out.prefix_hit_tokens,
        num_cached_blocks=bm.num_cached_blocks, num_evictable_blocks=bm.num_evictable_blocks,
        host_hit_tokens=out.host_hit_tokens,
        kv_blocks_offloaded=len(out.kv_copies.outs) if out.kv_copies else 0,
        kv_blocks_restored=len(out.kv_copies.ins) if out.kv_copies else 0,
    )


__all__ = ["StepRecord", "EngineSnapshot", "OffloadSnapshot", "count_classes", "slot_accounting", "kv_usage", "record_step"]
