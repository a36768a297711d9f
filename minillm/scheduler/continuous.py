"""Continuous (iteration-level) batching over contiguous per-request KV regions.

Each step: every running request decodes one token; then waiting requests are
admitted in arrival order while a batch slot is free and their whole prompt fits the
token budget; all of it goes through ONE forward. A request that finishes leaves at
the end of the step, and its slot is free for the next step's admission.

KV space is the pre-paging design: each batch slot reserves a contiguous region of
``max_model_len`` tokens, used or not (one "block" of max_model_len tokens). With
``max_num_seqs=1`` this is the simple one-request-at-a-time engine.
"""
from __future__ import annotations

from ..model_runner import ScheduledRequest
from ..request import Request, RequestStatus
from .base import Scheduler, SchedulerOutput


class ContinuousScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))  # a stack: lowest slot first

    def can_admit(self, request: Request) -> bool:
        return bool(self.free_slots) and len(self.running) < self.max_num_seqs

    def allocate(self, request: Request) -> None:
        request.block_ids = [self.free_slots.pop()]

    def free(self, request: Request) -> None:
        self.free_slots.append(request.block_ids.pop())

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for r in self.running:  # decodes first: one token each
            out.rows.append(ScheduledRequest(r, 1))
            budget -= 1
        now = self.clock()
        while self.waiting and self.can_admit(self.waiting[0]) and self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            n = r.num_tokens - r.num_computed_tokens
            if n > budget:
                break  # FCFS: the head waits for a roomier step, nobody jumps the queue
            self.waiting.popleft()
            self.allocate(r)
            r.status = RequestStatus.RUNNING
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            self.running.append(r)
            out.rows.append(ScheduledRequest(r, n))
            budget -= n
        return out
