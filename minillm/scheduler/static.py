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

from .. import seams
from ..request import Request
from .base import Scheduler, SchedulerOutput
from .continuous import apply_rows, arrived_waiting


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group: list[Request] = []  # the batch in flight, finished members included

    @property
    def kv_holders(self) -> list[Request]:
        """Every request holding a KV region: the whole group until its last member ends."""
        return self.group

    def free(self, request: Request) -> None:
        pass  # a finished member keeps its slot until the whole group is done (see _release_group)

    def abort(self, request: Request) -> None:
        super().abort(request)
        if request in self.group:
            self.group.remove(request)
            self._give_back(request)

    def _give_back(self, request: Request) -> None:
        if self.block_manager.holds(request):
            self.block_manager.free(request)

    def _release_group(self) -> None:
        for r in self.group:
            self._give_back(r)
        self.group = []

    def update(self, out, emitted, now=None):
        finished = super().update(out, emitted, now)
        if self.group and not self.running:  # the last member finished: the barrel is empty
            self._release_group()
        return finished

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.group and not self.running:  # (after an abort) nobody left to wait for
            self._release_group()
        plugged_step = seams.plugged("static_schedule")  # a learner's static scheduling step (chapter 1)
        if plugged_step is not None:
            return self._schedule_with(plugged_step, out)
        if self.group:  # one decode token for each member still generating
            for r in self.running:
                self.add_row(r, 1, out)
            out.padded_width = 1
            return out
        # Form the next group: the oldest arrived requests, while their prompts fit the
        # token budget of one forward (the varlen forward computes real tokens only).
        now = self.clock()
        budget = self.max_num_batched_tokens
        while self.waiting and self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            n = r.num_tokens - r.num_computed_tokens
            if n > budget or not self.can_admit(r, n):
                break
            self.admit(r, n, out, now)
            self.group.append(r)
            budget -= n
        out.padded_width = max((row.num_new_tokens for row in out.rows), default=1)
        return out

    def _schedule_with(self, static_schedule, out: SchedulerOutput) -> SchedulerOutput:
        """``static_schedule(group, waiting, B, T)`` on copies of the queues, then carried out."""
        now = self.clock()
        rows = list(static_schedule(list(self.group), arrived_waiting(self, now), self.max_num_seqs,
                           self.max_num_batched_tokens))
        if self.group:
            self._check_group_closed(rows)
        self.group.extend(apply_rows(self, rows, out, now, seam="static_schedule"))
        out.padded_width = max((row.num_new_tokens for row in out.rows), default=1)
        return out

    def _check_group_closed(self, rows: list) -> None:
        """While a member of the group still runs, a plugged step's rows may name only its
        unfinished members (``apply_rows`` then checks that each of them decodes one token):
        a finished member's row would feed a request that is done, and an admission would
        break the barrel. Raised before anything changes."""
        for r, _ in rows:
            if r in self.running:
                continue
            still = [m.request_id for m in self.running]
            if r in self.group:
                raise seams.SeamContractError(
                    "static_schedule", "a finished member of the group gets no row",
                    f"request {getattr(r, 'request_id', r)} has finished and has a row while {still} still run",
                    self.num_steps + 1)
            raise seams.SeamContractError(
                "static_schedule", "a static group is closed until its last member finishes",
                f"it admitted request {getattr(r, 'request_id', r)} while {still} still run", self.num_steps + 1)
