"""Continuous batching over a paged KV cache, with preemption by recompute.

The queues are the continuous scheduler's (first come, first served, every step one
forward); what changes is KV space, and how a step spends its token budget (below):

* a request is admitted when there are free blocks for the tokens it is about to
  feed, not for ``max_model_len`` tokens it may never reach;
* a running request takes one more block when its next token crosses a block
  boundary;
* when no block is left for a running request, the most recently admitted request
  is *preempted*: its blocks are freed, its ``num_computed_tokens`` goes back to 0
  (its output tokens are kept) and it goes back to the FRONT of the waiting queue.
  When it is admitted again it recomputes the K/V of prompt + outputs in one prefill
  and continues as if nothing happened: greedy outputs are unchanged.

Why the newest request: it has the least work to redo, and the oldest ones, which
hold the most KV, keep making progress. The oldest running request can always grow
(the cache holds at least one request of ``max_model_len`` tokens), so the engine
never deadlocks: at worst requests run one at a time.

Rows are planned in tokens, not whole prompts: each row feeds
``num_computed_tokens .. num_computed_tokens + n`` and blocks are grown for exactly
that, so a prefill may be split in chunks that end anywhere, mid-block included.

How a step spends its token budget (``max_num_batched_tokens``) is the switch
``enable_chunked_prefill``:

* on (chunked prefill, chapter 4): decodes first, every running request whose prompt
  is done feeds its one token; then prefill work fills what is left of the budget in
  arrival order: first the running requests part-way through a prompt, then waiting
  requests. A prompt that fits what is left goes in whole; a longer one takes what is
  left and continues next step. Decodes and chunks share ONE forward, so a long prompt
  never stalls a running request: the budget caps every step's time.
* off (the early design, vLLM before chunked prefill): a step is all-prefill or
  all-decode. If a waiting request can be admitted (a batch slot, blocks, its whole
  prompt within the budget), the step runs prefills only, as many as fit; otherwise it
  runs the decodes. Every arriving prompt stalls every running request for one step as
  long as that prompt's prefill.

A recompute longer than the whole budget (its prompt fit the budget, prompt + outputs
may not) is fed in chunks in both modes, or it could never run again.

Speculative decoding (chapter 5) asks one more thing of the scheduler: after the
rows are planned, each decoding row may get a *lookahead* of up to k drafted tokens
(``ScheduledRequest.max_drafts``), within what is left of the token budget and only
in free blocks (drafts never preempt anyone). The blocks are reserved here, before
anyone drafts; ``update`` gives back those of rejected drafts (``rollback``).

The continuous scheduler (chapter 2) has a third policy: decodes plus whole admitted
prompts in one forward, never chunked. Only this scheduler has the on/off switch.

Chapter 6 adds two options:

* ``enable_prefix_caching``: a request being admitted first shares the longest run of
  its prompt's full blocks that the cache holds (``BlockManager.lookup_prefix``), starts
  with ``num_computed_tokens`` past them, and feeds only the rest. A preempted request's
  blocks stay cached while free, so its recompute is mostly hits.
* ``scheduling_policy="priority"``: waiting requests are admitted by class, a request
  past its class's queue timeout first, preempting the lowest-class running request if
  it must (``scheduler/priority.py``); decodes and prompt chunks are also planned by
  class, and memory pressure preempts the lowest class first. ``"fcfs"`` (the default)
  is everything above, unchanged.
"""
from __future__ import annotations

import operator
from typing import Sequence

from .. import seams
from ..block_manager import blocks_needed, min_num_blocks
from ..config import SCHEDULING_POLICIES, SpeculativeConfig, check_queue_timeouts, queue_timeout
from ..kv_offload import HostHit, HostTier, check_kv_offload
from ..request import Request, RequestStatus
from ..spec_decode import policy
from . import priority as prio
from .base import Scheduler, SchedulerOutput


class PagedScheduler(Scheduler):
    """Continuous batching (FCFS or by priority); KV space in blocks of ``block_size`` tokens from a shared pool."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_id: int, num_blocks: int, block_size: int, watermark: float = 0.0,
                 enable_chunked_prefill: bool = False, speculative: SpeculativeConfig | None = None,
                 enable_prefix_caching: bool = False, scheduling_policy: str = "fcfs",
                 queue_timeouts: dict | None = None, kv_offload: dict | None = None):
        need = min_num_blocks(max_model_len, block_size)
        if num_blocks < need:  # else a lone request could outgrow the cache: no progress, ever
            raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_model_len={max_model_len} "
                             f"tokens in blocks of {block_size}: give at least {need} blocks")
        super().__init__(max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_id, num_blocks,
                         block_size, watermark)
        self.enable_chunked_prefill = enable_chunked_prefill
        self.speculative = speculative
        self.overcommitted = False  # a preemption happened: admit nobody until a request finishes
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling_policy {scheduling_policy!r}; valid policies: "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        self.scheduling_policy = scheduling_policy
        self.queue_timeouts = check_queue_timeouts(queue_timeouts)
        self.block_manager.enable_prefix_caching = enable_prefix_caching
        # Run totals of the admissions (per step: SchedulerOutput): K/V tokens needed, found cached.
        self.prefill_tokens_requested = 0
        self.prefix_hit_tokens = 0
        self.host_hit_tokens = 0  # of prefix_hit_tokens: restored from the host tier
        if kv_offload is not None:
            opts = check_kv_offload(kv_offload)
            self.block_manager.enable_host_tier(HostTier(opts["host_blocks"], opts["idle_s"]))
            self.block_manager.allocator.clock = lambda: self.clock()  # idle time on the engine's clock

    @property
    def enable_prefix_caching(self) -> bool:
        return self.block_manager.enable_prefix_caching

    def timeout_of(self, level: int) -> float:
        """The queue timeout (seconds) of priority ``level``."""
        return queue_timeout(self.queue_timeouts, level)

    def check_fits(self, num_prompt_tokens: int) -> None:
        # The prompt plus the first sampled token must fit the whole cache, or the
        # request would wait forever for blocks that do not exist.
        need = blocks_needed(num_prompt_tokens + 1, self.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens: with the first generated token it needs {need} blocks "
                f"of {self.block_size} tokens, but the whole KV cache has {self.block_manager.num_blocks}: "
                "shorten the prompt or give the engine more num_blocks / kv_cache_bytes")

    def preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's K/V and requeue it at the front."""
        self.running.remove(request)
        self.free(request)
        request.num_computed_tokens = 0  # the outputs stay: they are re-fed as part of the prefill
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.overcommitted = True

    def update(self, out, emitted, now=None):
        finished = super().update(out, emitted, now)
        if finished or not self.running:  # blocks came back: admissions may resume
            self.overcommitted = False
        return finished

    # -- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.block_manager.host is not None:
            self.block_manager.offload_idle(self.clock())
        if self.scheduling_policy == "priority":  # before any row: a running request's row is never revoked
            self._make_room_for_timed_out(out)
        if self.enable_chunked_prefill:  # decodes first, prefill chunks in what is left
            budget = self._schedule_decodes(out, budget)
            budget = self._schedule_prefills(out, budget)
        else:  # all-prefill or all-decode: prefills win whenever one can run
            budget = self._schedule_prefills(out, budget)
            if not out.rows:
                budget = self._schedule_decodes(out, budget)
        if self.speculative is not None:
            self._reserve_lookahead(out, budget)
        if out.rows and self.block_manager.host is not None:  # made before this step's forward
            out.kv_copies = self.block_manager.take_kv_copies()
        return out

    def _make_room(self, r: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt from the END of ``running`` until ``r``'s table can cover ``num_tokens``.

        Victims are the newest requests without a row this step, so no row is ever
        revoked. False when ``r`` cannot grow: the next victim already has a row, or
        ``r`` was the newest and has just preempted itself.
        """
        while not self.block_manager.can_grow(r, num_tokens):
            if self.scheduling_policy == "priority":  # the lowest class without a row, newest first
                victim = self._victim_by_class(exclude=[row.request for row in out.rows])
                if victim is None:
                    return False
            else:
                choose = seams.plugged("choose_victim")  # a learner's choice (chapter 3), when plugged in
                victim = self.running[-1] if choose is None else self._chosen_victim(choose, self.running)
                if any(row.request is victim for row in out.rows):
                    return False
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is r:
                return False
        return True

    def _fit_chunk(self, r: Request, n: int, out: SchedulerOutput) -> int | None:
        """The chunk of ``n`` prompt tokens that running request ``r`` can feed this step,
        after preempting (``_make_room``) for it: ``n``, or a shorter chunk in the blocks left
        when the requests after it all have rows (possibly 0). None: ``r`` preempted itself."""
        if self._make_room(r, r.num_computed_tokens + n, out):
            return n
        if r.status is not RequestStatus.RUNNING:
            return None
        room = (len(r.block_ids) + self.block_manager.num_free_blocks) * self.block_size
        return max(min(n, room - r.num_computed_tokens), 0)

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """One token for every running request that is decoding, oldest first. Returns the budget left."""
        if self.scheduling_policy == "priority":
            return self._schedule_decodes_by_class(out, budget)
        scheduled = {row.request for row in out.rows}
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r not in scheduled and not r.is_prefill:
                if not self._make_room(r, r.num_computed_tokens + 1, out):
                    if r.status is not RequestStatus.RUNNING:
                        break  # r preempted itself: every request after it is already gone
                    i += 1
                    continue
                self.add_row(r, 1, out)
                budget -= 1
            i += 1
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Prefill work in arrival order within ``budget``. Returns the budget left.

        First the running requests part-way through a prompt (or a recompute): their
        next chunk. Then waiting requests are admitted, whole or (chunked prefill, or a
        recompute longer than the budget) in a chunk.
        """
        if self.scheduling_policy == "priority":
            budget = self._schedule_chunks_by_class(out, budget)
            return self._admit_by_priority(out, budget)
        scheduled = {row.request for row in out.rows}
        plan = self._planned_chunks(out, budget, scheduled)  # a learner's split_budget (chapter 4), or None
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r in scheduled or not r.is_prefill:
                i += 1
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)  # already running: always a chunk
            if plan is not None:
                n = self._checked_chunk(plan, r, n)
            n = self._fit_chunk(r, n, out)
            if n is None:  # r preempted itself: every request after it is already gone
                break
            if n:
                self.add_row(r, n, out)
                budget -= n
            i += 1

        # Admit waiting requests in arrival order. Not after a preemption until a request
        # has finished (or nothing runs): memory is overcommitted, and a request admitted
        # now would only be preempted again a few steps later, its prefill wasted (thrash).
        now = self.clock()
        while not (self.overcommitted and self.running) and budget > 0 and self.waiting and self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            hit = self.block_manager.lookup_prefix(r)  # [] without prefix caching
            n = self._admission_tokens(r, hit, budget)
            if plan is not None:
                n = self._checked_chunk(plan, r, n)
            if n == 0 or not self._can_admit(r, n, hit):
                break  # FCFS: the head waits for a roomier step, nobody jumps the queue
            self._admit(r, hit, n, out, now)
            budget -= n
        return budget

    # -- the chunked-prefill budget as a seam (chapter 4's split_budget) ----------
    def _left(self, r: Request, hit: list[int]) -> int:
        return r.num_tokens - r.num_computed_tokens - len(hit) * self.block_size

    def _planned_chunks(self, out: SchedulerOutput, budget: int, scheduled) -> dict | None:
        """With chunked prefill and a plugged ``split_budget``: the chunk it gives each
        prefill this step (running ones part-way through a prompt, then arrived waiting
        ones, in order). None: the library's own split runs."""
        split = seams.plugged("split_budget") if self.enable_chunked_prefill else None
        if split is None:
            return None
        now = self.clock()
        cands = [r for r in self.running if r not in scheduled and r.is_prefill]
        for r in self.waiting:
            if not self.arrived(r, now):
                break
            cands.append(r)
        lefts = [self._left(r, self.block_manager.lookup_prefix(r)) for r in cands]
        chunks = self._checked_split(split, len(out.rows), lefts, budget, cands)
        return dict(zip(cands, chunks))

    def _checked_split(self, split, num_decodes: int, lefts: list[int], room: int,
                       cands: Sequence[Request]) -> list[int]:
        """A plugged ``split_budget``'s chunks for the prefills ``cands`` (``lefts`` tokens left each;
        ``room``: what the decodes leave of the budget), checked before any row is planned from
        them: one chunk per prefill, each within its prompt's tokens left, all within ``room``, and
        first come, first served (after a prefill that gets 0 tokens, every later one gets 0: the
        admissions stop at the first that cannot start). How the budget is shared within those
        rules is the policy, which the chapter's edge cases compare with the library's."""
        got = split(num_decodes, list(lefts), num_decodes + room)
        decodes = f"{num_decodes} decode{'' if num_decodes == 1 else 's'}"
        call = (f"split_budget({decodes}, prefill_tokens_left {lefts} (requests "
                f"{[r.request_id for r in cands]}), budget {num_decodes + room})")

        def broken(invariant: str, what: str) -> seams.SeamContractError:
            return seams.SeamContractError("split_budget", invariant, f"{call} returned {what}", self.num_steps + 1)

        try:
            chunks = [operator.index(c) if not isinstance(c, bool) else None for c in got]
        except TypeError:
            chunks = [None]
        if None in chunks:
            raise broken("one int chunk size per prefill", repr(got)[:120])
        if len(chunks) != len(lefts):
            raise broken("one chunk size per prefill, in the same order", f"{len(chunks)} sizes: {chunks}")
        for c, left in zip(chunks, lefts):
            if not 0 <= c <= left:
                raise broken("each chunk is between 0 and its prompt's tokens left", f"{chunks}")
        if sum(chunks) > room:
            raise broken(f"the chunks fit what the {decodes} leave of the budget, {room} tokens",
                         f"{chunks}: {sum(chunks)} tokens")
        for i, (c, left) in enumerate(zip(chunks, lefts)):
            if c == 0 < left and any(chunks[i + 1:]):
                raise broken("the budget goes to the prefills in arrival order: once one gets 0 tokens, every "
                             "one after it gets 0 (nobody jumps the queue)", f"{chunks}")
        return chunks

    def _checked_chunk(self, plan: dict, r: Request, most: int) -> int:
        n = plan.get(r, 0)
        if not 0 <= n <= most:
            raise seams.SeamContractError(
                "split_budget", "a prefill's chunk is at most its tokens left, within the budget left",
                f"request {r.request_id} got {n} tokens; it may take 0 .. {most}", self.num_steps + 1)
        return n

    # -- admission, with the prefix cache -----------------------------------------
    def _admission_tokens(self, r: Request, hit: list[int], budget: int) -> int:
        """Tokens ``r`` feeds if admitted now, after the ``hit`` blocks it finds cached (0: it cannot start)."""
        left = r.num_tokens - r.num_computed_tokens - len(hit) * self.block_size
        # A resumed request may have to recompute more tokens than the whole budget
        # (its prompt fit, prompt + outputs need not): it is fed in chunks, or it
        # could never run again.
        may_chunk = self.enable_chunked_prefill or left > self.max_num_batched_tokens
        return left if left <= budget else (budget if may_chunk else 0)

    def _can_admit(self, r: Request, n: int, hit: list[int]) -> bool:
        if not hit:
            return self.can_admit(r, n)
        return (len(self.kv_holders) < self.max_num_seqs and
                self.block_manager.can_share_prefix(r, hit, len(hit) * self.block_size + n))

    def _admit(self, r: Request, hit: list[int], n: int, out: SchedulerOutput, now: float) -> None:
        """Admit the head of the queue: share its cached prefix blocks, then a row of ``n`` tokens."""
        cached = len(hit) * self.block_size
        from_host = sum(isinstance(b, HostHit) for b in hit) * self.block_size
        if hit:
            self.block_manager.share_prefix(r, hit)
            r.num_computed_tokens = cached
        out.prefill_tokens_requested += r.num_tokens
        out.prefix_hit_tokens += cached
        out.host_hit_tokens += from_host
        self.prefill_tokens_requested += r.num_tokens
        self.prefix_hit_tokens += cached
        self.host_hit_tokens += from_host
        if r.metrics.first_scheduled_time is None:
            r.metrics.num_cached_tokens = cached
        self.admit(r, n, out, now)

    # -- the priority policy (scheduler/priority.py) ---------------------------------
    def _by_class(self) -> list[Request]:
        """The running requests, highest class first, admission order within a class."""
        return sorted(self.running, key=lambda r: r.priority)

    def _schedule_decodes_by_class(self, out: SchedulerOutput, budget: int) -> int:
        scheduled = {row.request for row in out.rows}
        for r in self._by_class():
            if budget <= 0:
                break
            if r.status is not RequestStatus.RUNNING or r in scheduled or r.is_prefill:
                continue  # preempted above to make room, or not decoding
            if self._make_room(r, r.num_computed_tokens + 1, out):
                self.add_row(r, 1, out)
                budget -= 1
        return budget

    def _schedule_chunks_by_class(self, out: SchedulerOutput, budget: int) -> int:
        scheduled = {row.request for row in out.rows}
        for r in self._by_class():
            if budget <= 0:
                break
            if r.status is not RequestStatus.RUNNING or r in scheduled or not r.is_prefill:
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if self.enable_chunked_prefill and seams.plugged("split_budget") is not None:
                n = self._chunk_by_class(r, n, out, budget, [x for x in self._by_class() if x is not r
                                                             and x.status is RequestStatus.RUNNING
                                                             and x not in scheduled and x.is_prefill])
            n = self._fit_chunk(r, n, out)
            if n is None:
                continue
            if n:
                self.add_row(r, n, out)
                budget -= n
        return budget

    def _victim_by_class(self, below_level: int | None = None, exclude: Sequence[Request] = ()) -> Request | None:
        """``prio.pick_victim``: the lowest class, newest first. A plugged ``choose_victim``
        (chapter 3) picks among the running requests of that lowest class."""
        choose = seams.plugged("choose_victim")
        if choose is None:
            return prio.pick_victim(self.running, below_level, exclude)
        skip = {id(r) for r in exclude}
        cands = [r for r in self.running if id(r) not in skip and (below_level is None or r.priority > below_level)]
        if not cands:
            return None
        lowest = max(r.priority for r in cands)
        cands = [r for r in cands if r.priority == lowest]
        return self._chosen_victim(choose, cands)

    def _chosen_victim(self, choose, cands: list[Request]) -> Request:
        """A plugged ``choose_victim``'s pick among ``cands`` (it gets a copy), checked before anyone is
        preempted: it must be one of them, or the engine would free blocks nobody holds."""
        victim = choose(list(cands))
        if not any(victim is r for r in cands):
            shown = getattr(victim, "request_id", None)
            raise seams.SeamContractError(
                "choose_victim", "the victim is one of the running requests it was given",
                f"it returned {repr(victim)[:80] if shown is None else f'request {shown}'} from running "
                f"{[r.request_id for r in cands]}", self.num_steps + 1)
        return victim

    def _chunk_by_class(self, r: Request, most: int, out: SchedulerOutput, budget: int,
                        after: Sequence[Request], hit: list[int] | None = None) -> int:
        """With the priority policy and a plugged ``split_budget`` (chapter 4): ``r``'s chunk
        this step, asked of it with ``r`` first and the prefills that would come after it
        (``after``, in the policy's order) behind, in the budget still left."""
        num_decodes = sum(1 for row in out.rows if row.num_new_tokens == 1 and not row.request.is_prefill)
        lefts = [self._left(r, hit or [])] + [self._left(x, self.block_manager.lookup_prefix(x)) for x in after]
        chunks = self._checked_split(seams.plugged("split_budget"), num_decodes, lefts, budget, [r, *after])
        return self._checked_chunk({r: chunks[0]}, r, most)

    def _make_room_for_timed_out(self, out: SchedulerOutput) -> None:
        """If the request first in the admission order has waited past its timeout and there
        is no batch slot or no blocks for it, preempt lower-class running requests now,
        before the step's rows are planned (with chunked prefill every running request gets
        its decode row first, and a row is never revoked). Its admission comes later in the
        step, in ``_admit_by_priority``."""
        now = self.clock()
        order = prio.admission_order(self.waiting, now, self.timeout_of)
        if not order or not prio.is_timed_out(order[0], now, self.timeout_of):
            return
        r = order[0]
        hit = self.block_manager.lookup_prefix(r)
        decodes = sum(1 for x in self.running if not x.is_prefill) if self.enable_chunked_prefill else 0
        n = self._admission_tokens(r, hit, max(self.max_num_batched_tokens - decodes, 1))
        while n and not self._can_admit(r, n, hit):
            victim = self._victim_by_class(below_level=r.priority)
            if victim is None:
                return
            self.preempt(victim)
            out.preempted.append(victim)
            hit = self.block_manager.lookup_prefix(r)
            n = self._admission_tokens(r, hit, max(self.max_num_batched_tokens - decodes, 1))

    def _admit_by_priority(self, out: SchedulerOutput, budget: int) -> int:
        """Admit by class; a request past its queue timeout first, preempting a lower class if it must."""
        now = self.clock()
        while budget > 0 and self.waiting:
            # (a request preempted in this step stays out until the next one)
            order = [r for r in prio.admission_order(self.waiting, now, self.timeout_of) if r not in out.preempted]
            if not order:
                break  # nobody has arrived yet
            r = order[0]
            # Past its timeout, with a lower class running that it may push out.
            may_push = (prio.is_timed_out(r, now, self.timeout_of)
                        and any(x.priority > r.priority for x in self.running))
            if self.overcommitted and self.running and not may_push:
                break  # memory is short (a preemption happened): no admission that could thrash
            hit = self.block_manager.lookup_prefix(r)
            n = self._admission_tokens(r, hit, budget)
            while n and may_push and not self._can_admit(r, n, hit):
                victim = self._victim_by_class(below_level=r.priority, exclude=[row.request for row in out.rows])
                if victim is None:
                    break
                self.preempt(victim)
                out.preempted.append(victim)
                hit = self.block_manager.lookup_prefix(r)  # the victim's blocks may now be cached hits
                n = self._admission_tokens(r, hit, budget)
            if n and self.enable_chunked_prefill and seams.plugged("split_budget") is not None:
                n = self._chunk_by_class(r, n, out, budget, order[1:], hit)
            if n == 0 or not self._can_admit(r, n, hit):
                break  # the request picked waits for room; nobody behind it jumps ahead
            self.waiting.remove(r)
            self.waiting.appendleft(r)  # admission takes the head of the queue
            self._admit(r, hit, n, out, now)
            budget -= n
        return budget

    def _reserve_lookahead(self, out: SchedulerOutput, budget: int) -> None:
        """Speculative decoding: how many drafts each decoding row may carry, blocks included.

        Drafts fill what is left of the token budget, and only free blocks: they never
        preempt anyone. Nobody drafts while the batch is at the off switch's size.
        """
        spec = self.speculative
        decoding = [row for row in out.rows if row.samples and row.num_known_tokens == 1]
        if not decoding or not policy.speculation_enabled(len(self.running), spec.disable_by_batch_size):
            return
        for row in decoding:
            r = row.request
            k = spec.num_speculative_tokens if r.num_speculative_tokens is None else r.num_speculative_tokens
            k = policy.num_drafts_allowed(k, r.num_output_tokens, r.sampling_params.max_tokens, r.num_tokens,
                                          self.max_model_len, budget)
            while k > 0 and not self.block_manager.can_grow(r, r.num_tokens + k):
                k -= 1
            self.block_manager.grow(r, r.num_tokens + k)
            row.max_drafts = k
            budget -= k
