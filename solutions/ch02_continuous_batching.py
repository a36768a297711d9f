"""Chapter 2 solutions: same names and signatures as ``exercises/ch02_continuous_batching.py``.

``schedule_step`` is the continuous policy on plain queues (the engine's seam);
the step counts and makespans come from, or are checked against, the simulator.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from minillm.bench.cost_model import simulate
from minillm.request import Request, RequestStatus
from minillm.bench.workload import workload_from_lengths
from minillm.course import quiz


def schedule_step(running: list[Request], waiting: deque[Request], max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[tuple[Request, int]]:
    """The policy of ``minillm/scheduler/continuous.py``, ``ContinuousScheduler.schedule``,
    on plain queues. (In the engine, step 1, removing finished requests, happens in
    ``Scheduler.update`` right after the forward; here it comes first.) This is the seam
    the engine calls, so it touches nothing but the two queues and the statuses."""
    running[:] = [r for r in running if not r.is_finished]
    rows = [(r, 1) for r in running]  # decodes first: one token each
    budget = max_num_batched_tokens - len(rows)
    while waiting and len(running) < max_num_seqs:
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            break  # FCFS: the head waits for a roomier step, nobody jumps the queue
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        running.append(r)
        rows.append((r, n))
        budget -= n
    return rows


def continuous_num_steps(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                         max_num_batched_tokens: int) -> int:
    """Read ``minillm/bench/cost_model.py``, ``simulate``: the engine on a virtual clock, no model."""
    wl = workload_from_lengths(prompt_lens, output_lens)
    return len(simulate(wl, "continuous", max_num_seqs, max_num_batched_tokens=max_num_batched_tokens).steps)


def predict_makespan(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, engine: str,
                     step_time: Callable[[list[int], list[int], int], float]) -> float:
    """The schedulers' rules in a few lines; ``minillm/bench/cost_model.py``'s ``simulate``
    runs the real schedulers on a virtual clock and agrees (the tests check it)."""
    if engine not in ("static", "continuous"):
        raise ValueError(f"engine must be 'static' or 'continuous', got {engine!r}")
    waiting = list(zip(prompt_lens, output_lens))
    running: list[list[int]] = []  # [prompt_len, output_len, generated]
    total = 0.0
    while waiting or running:
        new, ctx = [], []
        for r in running:  # decode rows for the unfinished
            r[2] += 1
            new.append(1)
            ctx.append(r[0] + r[2] - 1)
        if engine == "continuous" or not running:
            while waiting and len(running) < max_num_seqs:
                p, o = waiting.pop(0)
                running.append([p, o, 1])
                new.append(p)
                ctx.append(p)
        total += step_time(new, ctx, len(new))
        running = [r for r in running if r[2] < r[1]]
    return total


def pick_engine(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                step_time: Callable[[list[int], list[int], int], float]) -> str:
    """The smaller predicted makespan; ties (within 0.1%) go to static."""
    s = predict_makespan(prompt_lens, output_lens, max_num_seqs, "static", step_time)
    c = predict_makespan(prompt_lens, output_lens, max_num_seqs, "continuous", step_time)
    return "continuous" if c < s * 0.999 else "static"


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: follow the other slot while the long request decodes; q2: groups
    of two, each as long as its longest member."""
    return quiz.sealed("ch02")
