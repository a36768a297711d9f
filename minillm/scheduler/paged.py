"""Continuous batching over a paged KV cache, with preemption by recompute.

The step is the continuous scheduler's (FCFS, running requests first, then admitted
prefills within the token budget, all in one forward); what changes is KV space:

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
that, so a prefill may be split in chunks. Chunks are used for every prefill when
``enable_chunked_prefill`` is on, and always for a recompute longer than the budget
(its prompt fit the budget, prompt + outputs may not).
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

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running requests, oldest first: a decode token each (or the next chunk of
        #    an unfinished prefill). Victims come off the END of `running`, i.e. from
        #    the requests not yet scheduled this step, so no row is ever revoked.
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = self._new_tokens(r, budget, may_chunk=True)  # already running: never starve it
            while not bm.can_grow(r, r.num_computed_tokens + n):
                victim = self.running[-1]
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is r:
                    break
            if r.status is not RequestStatus.RUNNING:
                break  # r preempted itself: every request after it is already gone
            self.allocate(r, r.num_computed_tokens + n)
            out.rows.append(ScheduledRequest(r, n))
            budget -= n
            i += 1

        # 2. Admit waiting requests in arrival order. Not in a step that had to preempt:
        #    memory is short, and a preempted request would just be swapped for another.
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
            self.allocate(r, r.num_computed_tokens + n)
            r.status = RequestStatus.RUNNING
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            self.running.append(r)
            out.rows.append(ScheduledRequest(r, n))
            budget -= n
        return out
