"""Static (request-level) batching: a group of requests runs as one unit.

The oldest way to batch, and what ``model.generate`` on a padded batch does:

    1. take up to B waiting requests, in arrival order        (the group)
    2. prefill them together, every prompt padded to the longest
    3. decode all of them, one token each per step, until the LAST one finishes
    4. only then release the group's slots and start the next group

A request that finishes early keeps its batch slot and its KV region until the whole
group is done: its row is idle from then on. That wait for the slowest member is the
*barrel effect* (a barrel holds only as much water as its shortest stave lets it:
here a group lasts as long as its longest request).

The forward itself is the same flat varlen forward as every engine: it skips the
padding and the finished rows instead of computing garbage, so the step *times* here
flatter static batching. The padding and the idle slots are still counted in each
step's record (``padded_width`` of the output), which is what slot utilization measures.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model_runner import ScheduledRequest
from ..request import Request, RequestStatus
from .base import Scheduler, SchedulerOutput


@dataclass(slots=True)
class StaticSchedulerOutput(SchedulerOutput):
    padded_width: int = 1  # the padded batch is [max_num_seqs, padded_width]


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free_slots = list(range(self.max_num_seqs - 1, -1, -1))  # a stack: lowest slot first
        self.group: list[Request] = []  # the batch in flight, finished members included

    @property
    def kv_holders(self) -> list[Request]:
        """Every request holding a KV region: the whole group until its last member ends."""
        return self.group

    def can_admit(self, request: Request) -> bool:
        return bool(self.free_slots) and len(self.group) < self.max_num_seqs

    def allocate(self, request: Request) -> None:
        request.block_ids = [self.free_slots.pop()]

    def free(self, request: Request) -> None:
        pass  # a finished member keeps its slot until the whole group is done (see _release_group)

    def abort(self, request: Request) -> None:
        super().abort(request)
        if request in self.group:
            self._give_back(request)
            self.group.remove(request)

    def _give_back(self, request: Request) -> None:
        if request.block_ids:
            self.free_slots.append(request.block_ids.pop())

    def _release_group(self) -> None:
        for r in self.group:
            self._give_back(r)
        self.group = []

    def update(self, out, sampled, now=None):
        finished = super().update(out, sampled, now)
        if self.group and not self.running:  # the last member finished: the barrel is empty
            self._release_group()
        return finished

    def schedule(self) -> StaticSchedulerOutput:
        out = StaticSchedulerOutput()
        if self.group and not self.running:  # (after an abort) nobody left to wait for
            self._release_group()
        if self.group:  # one decode token for each member still generating
            out.rows = [ScheduledRequest(r, 1) for r in self.running]
            return out
        # Form the next group: the oldest arrived requests, while their prompts fit the
        # token budget of one forward (the varlen forward computes real tokens only).
        now = self.clock()
        width = budget = 0
        while self.waiting and self.can_admit(self.waiting[0]) and self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            n = r.num_tokens - r.num_computed_tokens
            if budget + n > self.max_num_batched_tokens:
                break
            budget += n
            self.waiting.popleft()
            self.allocate(r)
            r.status = RequestStatus.RUNNING
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            self.group.append(r)
            self.running.append(r)
            out.rows.append(ScheduledRequest(r, n))
            width = max(width, n)
        out.padded_width = max(width, 1)
        return out
