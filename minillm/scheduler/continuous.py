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

from .base import Scheduler, SchedulerOutput


class ContinuousScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for r in self.running:  # decodes first: one token each
            self.add_row(r, 1, out)
            budget -= 1
        now = self.clock()
        while self.waiting and self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            n = r.num_tokens - r.num_computed_tokens
            if n > budget or not self.can_admit(r, n):
                break  # FCFS: the head waits for a roomier step, nobody jumps the queue
            self.admit(r, n, out, now)
            budget -= n
        return out
