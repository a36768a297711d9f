"""Chapter 2 solutions: same names and signatures as ``exercises/ch02_continuous_batching.py``.

Both answers run minillm's ``ContinuousScheduler``: the first on the caller's queues,
the second through the simulator.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from minillm.lab.cost_model import simulate
from minillm.request import Request
from minillm.scheduler import ContinuousScheduler
from minillm.lab.workload import workload_from_lengths


def schedule_step(running: list[Request], waiting: deque[Request], max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[tuple[Request, int]]:
    """Read ``minillm/scheduler/continuous.py``, ``ContinuousScheduler.schedule``.

    In the engine, step 1 (removing finished requests) happens in ``Scheduler.update``
    right after the forward; here it is done first, then the scheduler runs on the
    caller's own queues. (It also hands each admitted request a KV slot in ``block_ids``.)
    """
    running[:] = [r for r in running if not r.is_finished]
    sched = ContinuousScheduler(max_num_seqs, max_num_batched_tokens, max_model_len=1 << 30, eos_token_id=-1)
    sched.running = running  # the same list objects: admissions land in the caller's queues
    sched.waiting = waiting
    for r in running:  # each holds a slot of an earlier call's scheduler: seat it in this one's
        r.block_ids = []
        sched.block_manager.grow(r, 1)
    sched.clock = lambda: float("inf")  # everything in ``waiting`` has arrived
    out = sched.schedule()
    return [(row.request, row.num_new_tokens) for row in out.rows]


def continuous_num_steps(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                         max_num_batched_tokens: int) -> int:
    """Read ``minillm/lab/cost_model.py``, ``simulate``: the engine on a virtual clock, no model."""
    wl = workload_from_lengths(prompt_lens, output_lens)
    return len(simulate(wl, "continuous", max_num_seqs, max_num_batched_tokens=max_num_batched_tokens).steps)


def predict_makespan(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, engine: str,
                     step_time: Callable[[list[int], list[int], int], float]) -> float:
    """The schedulers' rules in a few lines; ``minillm/lab/cost_model.py``'s ``simulate``
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
    """q1: the long request runs 4 steps while the four short ones pass through the other slot; q2: groups of 2 run 4 + 1 + 1 steps."""
    return {"q1": 4, "q2": 6, "q3": "a", "q4": "c"}
