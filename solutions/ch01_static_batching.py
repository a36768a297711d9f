"""Chapter 1 solutions: same names and signatures as ``exercises/ch01_static_batching.py``.

The answers run minillm's own code: the static scheduler, replayed by the simulator
(the real scheduler class on a virtual clock), and the accounting of metrics.py.
"""
from __future__ import annotations

from collections import deque

import torch

from minillm.bench import hf_baselines
from minillm.bench.cost_model import simulate
from minillm.bench.workload import workload_from_lengths
from minillm.request import Request, RequestStatus
from minillm.course import quiz


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``minillm/bench/hf_baselines.py``, ``left_pad``: how ``hf-generate`` batches a group."""
    return hf_baselines.left_pad(prompts, pad_id)


def _static_run(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int):
    wl = workload_from_lengths(prompt_lens, output_lens)
    # A budget as large as all prompts: groups are limited by max_num_seqs only.
    return simulate(wl, "static", max_num_seqs, max_num_batched_tokens=max(sum(prompt_lens), max_num_seqs))


def static_num_steps(output_lens: list[int], max_num_seqs: int) -> int:
    """Read ``minillm/scheduler/static.py``: a group runs until its longest member is done."""
    return len(_static_run([1] * len(output_lens), output_lens, max_num_seqs).steps)


def static_token_slots(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int) -> tuple[int, int]:
    """Read ``minillm/metrics.py``, ``slot_accounting``: padded steps are B x W rectangles."""
    steps = _static_run(prompt_lens, output_lens, max_num_seqs).steps
    return sum(s.num_tokens for s in steps), sum(s.token_slots for s in steps)


def static_schedule(group: list[Request], waiting: deque[Request], max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[Request, int]]:
    """The policy of ``minillm/scheduler/static.py``, ``StaticScheduler.schedule``, on plain queues."""
    live = [r for r in group if not r.is_finished]
    if live:
        return [(r, 1) for r in live]
    group.clear()
    rows, budget = [], max_num_batched_tokens
    while waiting and len(group) < max_num_seqs:
        r = waiting[0]
        n = r.num_tokens - r.num_computed_tokens
        if n > budget:
            break
        waiting.popleft()
        r.status = RequestStatus.RUNNING
        group.append(r)
        rows.append((r, n))
        budget -= n
    return rows


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: form the groups in arrival order; each runs as long as its longest
    member; q2: the tokens the requests needed over the token-slots of the steps they ran."""
    return quiz.sealed("ch01")
