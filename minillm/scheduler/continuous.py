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

from collections import deque

from .. import seams
from ..request import Request
from .base import Scheduler, SchedulerOutput


def apply_rows(sched: Scheduler, rows: list[tuple[Request, int]], out: SchedulerOutput, now: float) -> list[Request]:
    """Carry out the rows a plugged-in scheduling step chose (``seams``) with the scheduler's own bookkeeping:
    a running request gets its row, a waiting one is admitted (KV blocks, queues, metrics).
    Returns the admitted requests. A decision the engine cannot carry out is a ValueError
    that names it, before anything changes for that row."""
    admitted = []
    for r, n in rows:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"the plugged scheduling step gave request {r.request_id} a row of {n!r} tokens; rows feed >= 1 token")
        if r in sched.running:
            sched.add_row(r, n, out)
            continue
        if not sched.waiting or sched.waiting[0] is not r:
            raise ValueError(f"the plugged scheduling step admitted request {r.request_id}, which is not the oldest waiting request "
                             f"(admission is first come, first served)")
        if not sched.can_admit(r, n):
            raise ValueError(f"the plugged scheduling step admitted request {r.request_id} with no batch slot or KV space left for it")
        sched.admit(r, n, out, now)
        admitted.append(r)
    if sum(row.num_new_tokens for row in out.rows) > sched.max_num_batched_tokens:
        raise ValueError(f"the plugged scheduling step fed {sum(row.num_new_tokens for row in out.rows)} tokens in one step, over the "
                         f"token budget max_num_batched_tokens={sched.max_num_batched_tokens}")
    return admitted


def arrived_waiting(sched: Scheduler, now: float) -> deque[Request]:
    """The waiting requests a plugged scheduling step may see: those that have arrived, oldest first."""
    out: deque[Request] = deque()
    for r in sched.waiting:
        if not sched.arrived(r, now):
            break
        out.append(r)
    return out


class ContinuousScheduler(Scheduler):
    def schedule(self) -> SchedulerOutput:
        plugged_step = seams.plugged("schedule_step")  # a learner's scheduling step (chapter 2)
        if plugged_step is not None:
            return self._schedule_with(plugged_step)
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

    def _schedule_with(self, schedule_step) -> SchedulerOutput:
        """``schedule_step(running, waiting, B, T)`` on copies of the queues, then carried out."""
        out = SchedulerOutput()
        now = self.clock()
        rows = list(schedule_step(list(self.running), arrived_waiting(self, now), self.max_num_seqs,
                           self.max_num_batched_tokens))
        apply_rows(self, rows, out, now)
        return out
