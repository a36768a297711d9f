"""What every scheduler shares: queues, KV accounting, admission, the update after a step.

A scheduler decides, each step, which requests run and how many new tokens each
feeds (``schedule``), then folds the sampled tokens back in (``update``). It holds no
tensors: only request counters and KV-space bookkeeping, so it is plain Python.

Every scheduler keeps its KV space in a ``BlockManager``. The contiguous engines
(static, continuous) are the special case of one block of ``max_model_len`` tokens per
batch slot: admitting a request takes a whole region, used or not. The paged engine
uses small blocks and grows a request's table as it writes (chapter 3).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ..block_manager import BlockManager
from ..request import FinishReason, Request, RequestStatus
from .output import ScheduledRequest, SchedulerOutput


class Scheduler:
    """Base class: FCFS waiting queue, running list, KV blocks, one admission, one update."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_id: int, num_blocks: int | None = None, block_size: int | None = None,
                 watermark: float = 0.0):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        # Default: the contiguous layout, one max_model_len region per batch slot.
        self.block_manager = BlockManager(num_blocks or max_num_seqs, block_size or max_model_len, watermark)
        self.block_size = self.block_manager.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.clock: Callable[[], float] = time.perf_counter
        self.num_preemptions = 0  # requests sent back to waiting to free KV space
        self.num_steps = 0  # steps updated so far: the one being scheduled is num_steps + 1

    # -- queue ------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_by_class(self) -> dict[str, int]:
        """Queue depth per priority class (class name -> waiting requests), e.g. for a dashboard."""
        counts: dict[str, int] = {}
        for r in self.waiting:
            c = r.metrics.priority_class
            counts[c] = counts.get(c, 0) + 1
        return counts

    def arrived(self, request: Request, now: float) -> bool:
        return request.arrival_time <= now

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError if a prompt this long could never be scheduled (it would stall
        the queue). The engine checks the token budget; a scheduler adds its KV limits."""

    @property
    def kv_holders(self) -> list[Request]:
        """The requests holding KV space (metrics read this): the running ones, by default."""
        return self.running

    # -- KV space and admission -------------------------------------------------
    def can_admit(self, request: Request, num_new_tokens: int) -> bool:
        """A batch slot, and KV blocks for the tokens ``request`` would feed now."""
        return (len(self.kv_holders) < self.max_num_seqs and
                self.block_manager.can_grow(request, request.num_computed_tokens + num_new_tokens, admit=True))

    def admit(self, request: Request, num_new_tokens: int, out: SchedulerOutput, now: float) -> ScheduledRequest:
        """The one way into the batch: the head of the queue starts running and gets a row."""
        assert self.waiting[0] is request, "admission is first come, first served"
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = now
        self.running.append(request)
        return self.add_row(request, num_new_tokens, out)

    def add_row(self, request: Request, num_new_tokens: int, out: SchedulerOutput) -> ScheduledRequest:
        """Give ``request`` a row of ``num_new_tokens`` tokens, growing its blocks to cover them.

        With prefix caching, the full blocks this row completes are registered now: the
        forward writes them before anyone reads them, so a request admitted later in this
        same step may already share them."""
        self.block_manager.grow(request, request.num_computed_tokens + num_new_tokens)
        self.block_manager.cache_blocks(request, request.num_computed_tokens + num_new_tokens)
        row = ScheduledRequest(request, num_new_tokens)
        out.rows.append(row)
        return row

    def free(self, request: Request) -> None:
        self.block_manager.free(request)

    def rollback(self, request: Request) -> None:
        """Give back the KV blocks past what ``request`` has computed: the rejected drafts'."""
        self.block_manager.shrink(request, request.num_computed_tokens)

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    # -- after the forward ----------------------------------------------------
    def update(self, out: SchedulerOutput, emitted: dict[int, list[int]], now: float | None = None) -> list[Request]:
        """Advance counters, append emitted tokens, finish and free. Returns finished requests.

        ``emitted`` maps a row index of ``out.rows`` to the tokens that row produced:
        one for a plain step; 1..k+1 after verifying k drafts (the accepted drafts, then
        the target's own token). A row that emitted m tokens has K/V for its known
        tokens and m - 1 accepted drafts: the last token is new, as after any sampling
        step. Stops are checked on every token; the first one drops what follows.
        """
        now = self.clock() if now is None else now
        self.num_steps += 1
        finished = []
        for i, row in enumerate(out.rows):
            r = row.request
            tokens = emitted.get(i, [])  # none: a prefill chunk short of the prompt's end
            r.num_computed_tokens += row.num_known_tokens + max(len(tokens) - 1, 0)
            for t in tokens:
                if self.append_token(r, t, now):
                    finished.append(r)
                    break
            if row.max_drafts and not r.is_finished:
                self.rollback(r)
        for r in finished:
            self.running.remove(r)
            self.free(r)
        return finished

    def append_token(self, r: Request, token: int, now: float) -> bool:
        """Append one sampled token, time it, and finish ``r`` if it stops. True if it finished."""
        r.output_token_ids.append(token)
        m = r.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        # The detokenizer sees every token (it builds the text), and says if a stop string appeared.
        stop_string = r.detokenizer is not None and r.detokenizer.add_token(token)
        reason = self.check_stop(r, stop_string)
        if reason is not None:
            r.finish(reason, now)
        return reason is not None

    def check_stop(self, r: Request, stop_string: bool = False) -> FinishReason | None:
        p = r.sampling_params
        tok = r.output_token_ids[-1]
        if not p.ignore_eos and tok == self.eos_token_id:
            return FinishReason.STOP
        if tok in p.stop_token_ids or stop_string:
            return FinishReason.STOP
        if r.num_output_tokens >= p.max_tokens or r.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is, returning its KV space."""
        if request in self.running:
            self.running.remove(request)
            self.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not request.is_finished:
            request.finish(FinishReason.ABORT)
