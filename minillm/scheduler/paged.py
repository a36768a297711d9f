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

The continuous scheduler (chapter 2) has a third policy: decodes plus whole admitted
prompts in one forward, never chunked. Only this scheduler has the on/off switch.
"""
from __future__ import annotations

from ..block_manager import BlockManager, blocks_needed, min_num_blocks
from ..model_runner import ScheduledRequest
from ..request import Request, RequestStatus
from .base import Scheduler, SchedulerOutput


class PagedScheduler(Scheduler):
    """FCFS continuous batching; KV space in blocks of ``block_size`` tokens from a shared pool."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_id: int, num_blocks: int, block_size: int, watermark: float = 0.0,
                 enable_chunked_prefill: bool = False, stop_checker=None):
        super().__init__(max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_id, stop_checker)
        need = min_num_blocks(max_model_len, block_size)
        if num_blocks < need:  # else a lone request could outgrow the cache: no progress, ever
            raise ValueError(f"num_blocks={num_blocks} cannot hold one request of max_model_len={max_model_len} "
                             f"tokens in blocks of {block_size}: give at least {need} blocks")
        self.block_manager = BlockManager(num_blocks, block_size, watermark)
        self.block_size = block_size
        self.enable_chunked_prefill = enable_chunked_prefill

    def check_fits(self, num_prompt_tokens: int) -> None:
        # The prompt plus the first sampled token must fit the whole cache, or the
        # request would wait forever for blocks that do not exist.
        need = blocks_needed(num_prompt_tokens + 1, self.block_size)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens: with the first generated token it needs {need} blocks "
                f"of {self.block_size} tokens, but the whole KV cache has {self.block_manager.num_blocks}: "
                "shorten the prompt or give the engine more num_blocks / kv_cache_bytes")

    # -- KV space ----------------------------------------------------------------
    def can_admit(self, request: Request) -> bool:
        return len(self.running) < self.max_num_seqs

    def allocate(self, request: Request, num_tokens: int | None = None) -> None:
        """Grow ``request``'s block table to cover ``num_tokens`` tokens (default: all it knows)."""
        self.block_manager.grow(request, request.num_tokens if num_tokens is None else num_tokens)

    def free(self, request: Request) -> None:
        self.block_manager.free(request)

    def preempt(self, request: Request) -> None:
        """Recompute preemption: drop the request's K/V and requeue it at the front."""
        self.running.remove(request)
        self.free(request)
        request.num_computed_tokens = 0  # the outputs stay: they are re-fed as part of the prefill
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- one step ----------------------------------------------------------------
    def _new_tokens(self, request: Request, budget: int, may_chunk: bool) -> int:
        """Tokens ``request`` feeds this step: all it has not computed, a chunk, or 0 (wait)."""
        n = request.num_tokens - request.num_computed_tokens
        if n <= budget:
            return n
        return budget if may_chunk else 0

    @staticmethod
    def is_decode(request: Request) -> bool:
        """One token left to feed: the token it sampled last (or a prompt's last token)."""
        return request.num_tokens - request.num_computed_tokens == 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.enable_chunked_prefill:  # decodes first, prefill chunks in what is left
            budget = self._schedule_decodes(out, budget)
            self._schedule_prefills(out, budget)
        else:  # all-prefill or all-decode: prefills win whenever one can run
            self._schedule_prefills(out, budget)
            if not out.rows:
                self._schedule_decodes(out, budget)
        return out

    def _make_room(self, r: Request, num_tokens: int, out: SchedulerOutput, scheduled: set) -> bool:
        """Preempt from the END of ``running`` until ``r``'s table can cover ``num_tokens``.

        Victims are the newest requests without a row this step, so no row is ever
        revoked. False when ``r`` cannot grow: the next victim already has a row, or
        ``r`` was the newest and has just preempted itself.
        """
        while not self.block_manager.can_grow(r, num_tokens):
            victim = self.running[-1]
            if victim in scheduled:
                return False
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is r:
                return False
        return True

    def _add_row(self, out: SchedulerOutput, scheduled: set, r: Request, n: int) -> None:
        self.allocate(r, r.num_computed_tokens + n)
        out.rows.append(ScheduledRequest(r, n))
        scheduled.add(r)

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """One token for every running request that is decoding, oldest first. Returns the budget left."""
        scheduled = {row.request for row in out.rows}
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r not in scheduled and self.is_decode(r):
                if not self._make_room(r, r.num_computed_tokens + 1, out, scheduled):
                    if r.status is not RequestStatus.RUNNING:
                        break  # r preempted itself: every request after it is already gone
                    i += 1
                    continue
                self._add_row(out, scheduled, r, 1)
                budget -= 1
            i += 1
        return budget

    def _schedule_prefills(self, out: SchedulerOutput, budget: int) -> int:
        """Prefill work in arrival order within ``budget``. Returns the budget left.

        First the running requests part-way through a prompt (or a recompute): their
        next chunk. Then waiting requests are admitted, whole or (chunked prefill, or a
        recompute longer than the budget) in a chunk.
        """
        scheduled = {row.request for row in out.rows}
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r in scheduled or self.is_decode(r):
                i += 1
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)  # already running: always a chunk
            if not self._make_room(r, r.num_computed_tokens + n, out, scheduled):
                if r.status is not RequestStatus.RUNNING:
                    break
                # The requests after it all have rows: a shorter chunk in the blocks left, or none.
                room = (len(r.block_ids) + self.block_manager.num_free_blocks) * self.block_size
                n = max(min(n, room - r.num_computed_tokens), 0)
            if n:
                self._add_row(out, scheduled, r, n)
                budget -= n
            i += 1

        # Admit waiting requests in arrival order. Not in a step that had to preempt:
        # memory is short, and a preempted request would just be swapped for another.
        bm = self.block_manager
        now = self.clock()
        while (not out.preempted and budget > 0 and self.waiting and self.can_admit(self.waiting[0])
               and self.arrived(self.waiting[0], now)):
            r = self.waiting[0]
            # A resumed request may have to recompute more tokens than the whole budget
            # (its prompt fit, prompt + outputs need not): it is fed in chunks, or it
            # could never run again.
            too_long = r.num_tokens - r.num_computed_tokens > self.max_num_batched_tokens
            n = self._new_tokens(r, budget, may_chunk=self.enable_chunked_prefill or too_long)
            if n == 0:
                break  # FCFS: the head waits for a roomier step, nobody jumps the queue
            if not bm.can_grow(r, r.num_computed_tokens + n, admit=True):
                break
            self.waiting.popleft()
            r.status = RequestStatus.RUNNING
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            self.running.append(r)
            self._add_row(out, scheduled, r, n)
            budget -= n
        return budget
