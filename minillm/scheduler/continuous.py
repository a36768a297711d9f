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


def apply_rows(sched: Scheduler, rows: list[tuple[Request, int]], out: SchedulerOutput, now: float,
               seam: str = "schedule_step") -> list[Request]:
    """Carry out the rows a plugged-in scheduling step chose (``seams``) with the scheduler's own bookkeeping:
    a running request gets its row, a waiting one is admitted (KV blocks, queues, metrics).
    Returns the admitted requests.

    The rows are checked against the contract first, before anything changes: each row feeds
    >= 1 token, no request has two rows, every running request decodes, the rows feed at
    most ``max_num_batched_tokens`` tokens, at most ``max_num_seqs`` requests run, and
    admissions take the oldest waiting requests in order. A broken rule is a
    ``seams.SeamContractError`` naming it and the step; the engine is left as it was."""
    step = sched.num_steps + 1

    def broken(invariant: str, got: str) -> seams.SeamContractError:
        return seams.SeamContractError(seam, invariant, got, step)

    shown = [(getattr(r, "request_id", r), n) for r, n in rows]
    seen: set[int] = set()
    admitted_ahead = list(sched.waiting)
    num_admitted = 0
    for r, n in rows:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise broken("every row feeds at least 1 token", f"request {r.request_id} got {n!r} in {shown}")
        if id(r) in seen:
            raise broken("a request has at most one row a step", f"request {r.request_id} has two in {shown}")
        seen.add(id(r))
        if r in sched.running:
            if n != 1:
                raise broken("a running request decodes one token a step", f"request {r.request_id} got {n} in {shown}")
            continue
        whole = r.num_tokens - r.num_computed_tokens
        if n != whole:
            raise broken("an admitted request feeds its whole prompt",
                         f"request {r.request_id} has {whole} tokens to feed, its row {n}")
        if num_admitted >= len(admitted_ahead) or admitted_ahead[num_admitted] is not r:
            raise broken("admissions take the oldest waiting requests, in order (first come, first served)",
                         f"request {r.request_id} was admitted ahead of "
                         f"{admitted_ahead[num_admitted].request_id if num_admitted < len(admitted_ahead) else 'nothing'}")
        num_admitted += 1
    missing = [r.request_id for r in sched.running if id(r) not in seen]
    if missing:
        raise broken("every running request decodes one token a step", f"no row for {missing} in {shown}")
    tokens = sum(n for _, n in rows)
    if tokens > sched.max_num_batched_tokens:
        raise broken(f"the rows feed at most max_num_batched_tokens={sched.max_num_batched_tokens} tokens",
                     f"they feed {tokens}: {shown}")
    if len(sched.running) + num_admitted > sched.max_num_seqs:
        raise broken(f"at most max_num_seqs={sched.max_num_seqs} requests run",
                     f"{len(sched.running)} running + {num_admitted} admitted")
    admitted = []
    for r, n in rows:
        if r in sched.running:
            sched.add_row(r, n, out)
            continue
        if not sched.can_admit(r, n):
            raise broken("a request is admitted only when the KV space for it is free",
                         f"request {r.request_id} ({n} tokens)")
        sched.admit(r, n, out, now)
        admitted.append(r)
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
