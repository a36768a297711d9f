"""What every scheduler shares: queues, the update after a step, stop checks.

A scheduler decides, each step, which requests run and how many new tokens each
feeds (``schedule``), then folds the sampled tokens back in (``update``). It holds no
tensors: only request counters and KV-space bookkeeping, so it is plain Python.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..model_runner import ScheduledRequest
from ..request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


class Scheduler:
    """Base class: FCFS waiting queue, running list, the common update step."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_token_id: int, stop_checker: Callable[[Request], bool] | None = None):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.stop_checker = stop_checker  # stop strings need the tokenizer: the engine supplies it
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.clock: Callable[[], float] = time.perf_counter
        self.num_preemptions = 0  # requests sent back to waiting to free KV space

    # -- queue ------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def arrived(self, request: Request, now: float) -> bool:
        return request.arrival_time <= now

    def check_fits(self, num_prompt_tokens: int) -> None:
        """Raise ValueError if a prompt this long could never be scheduled (it would stall
        the queue). The engine checks the token budget; a scheduler adds its KV limits."""

    # -- KV space: subclasses decide ------------------------------------------
    def can_admit(self, request: Request) -> bool:
        raise NotImplementedError

    def allocate(self, request: Request) -> None:
        raise NotImplementedError

    def free(self, request: Request) -> None:
        raise NotImplementedError

    def schedule(self) -> SchedulerOutput:
        raise NotImplementedError

    # -- after the forward ----------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[int, int], now: float | None = None) -> list[Request]:
        """Advance counters, append sampled tokens, finish and free. Returns finished requests.

        ``sampled`` maps a row index of ``out.rows`` to the token it sampled.
        """
        now = self.clock() if now is None else now
        finished = []
        for i, row in enumerate(out.rows):
            r = row.request
            r.num_computed_tokens += row.num_new_tokens
            if i not in sampled:
                continue
            if self.append_token(r, sampled[i], now):
                finished.append(r)
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
        reason = self.check_stop(r)
        if reason is not None:
            r.finish(reason, now)
        return reason is not None

    def check_stop(self, r: Request) -> FinishReason | None:
        p = r.sampling_params
        tok = r.output_token_ids[-1]
        if not p.ignore_eos and tok == self.eos_token_id:
            return FinishReason.STOP
        if tok in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and self.stop_checker is not None and self.stop_checker(r):
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
