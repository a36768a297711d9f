"""Chapter 2 solutions: same names and signatures as ``exercises/ch02_continuous_batching.py``.

Both answers run minillm's ``ContinuousScheduler``: the first on the caller's queues,
the second through the simulator.
"""
from __future__ import annotations

from collections import deque

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
