"""A request and its state machine: WAITING -> RUNNING -> (PREEMPTED ->) FINISHED.

Plain Python, no tensors: the scheduler reasons about requests only through the
counters kept here. The one number that drives every engine is
``num_computed_tokens``: how many of ``all_token_ids`` already have K/V in the cache.
A step processes some of the rest; when it reaches the end, the model samples.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only a type here: the request stays torch-free plain Python
    from .sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock timestamps of one request (time.perf_counter seconds)."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    num_preemptions: int = 0
    priority_class: str = "standard"  # SamplingParams.priority's class name, for per-class metrics
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at the first admission

    @property
    def queue_wait(self) -> float | None:
        """Arrival -> first scheduled: time spent waiting in the queue."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (mean ITL)."""
        t = self.token_times
        return None if len(t) < 2 else (t[-1] - t[0]) / (len(t) - 1)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    block_ids: list[int] = field(default_factory=list)  # the KV blocks this request holds
    seed: int | None = None  # sampling seed (params.seed or one the engine derives): noise of position p = f(seed, p)
    generator: Any = None  # torch.Generator, set by the engine: scratch space, re-seeded for each position's noise
    detokenizer: Any = None  # IncrementalDetokenizer, set by the engine when it has a tokenizer
    output_text: str = ""
    num_speculative_tokens: int | None = None  # this request's k (adaptive speculation), None = the config's
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time,
                                      priority_class=getattr(self.sampling_params, "priority_class", "standard"))

    @property
    def priority(self) -> int:
        """The priority level (lower is served first): ``sampling_params.priority``'s."""
        return getattr(self.sampling_params, "priority_level", 1)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        """Still feeding tokens that are not the last one (prompt, or recompute after preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def max_total_tokens(self) -> int:
        """Prompt plus the most tokens it may generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    def finish(self, reason: FinishReason, now: float | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = time.perf_counter() if now is None else now
