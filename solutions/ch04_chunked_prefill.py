"""Chapter 4 solutions: same names and signatures as ``exercises/ch04_chunked_prefill.py``.

The scheduling answers spell out, on plain lists, what ``PagedScheduler`` does with
requests, KV blocks and batch slots (``minillm/scheduler/paged.py``); the mask is the
one ``minillm/attention.py`` builds for a chunk after cached context; the stall count is
``minillm/bench/summary.py``'s own.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from minillm.bench import summary
from minillm.course import quiz


def split_budget(num_decodes: int, prefill_tokens_left: list[int], budget: int) -> list[int]:
    """``PagedScheduler._schedule_decodes`` then ``_schedule_prefills``, without the KV blocks."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1 token, got {budget}")
    if num_decodes > budget:
        raise ValueError(f"{num_decodes} decodes need {num_decodes} tokens but the budget is {budget}: "
                         "the decodes alone would not fit")
    left = budget - num_decodes  # decodes first: one token each
    chunks = []
    for n in prefill_tokens_left:  # arrival order; a prompt that does not fit takes what is left
        take = min(n, left)
        chunks.append(take)
        left -= take
    return chunks


def early_step(num_decodes: int, waiting_prompt_lens: list[int], budget: int, free_seqs: int) -> list[int]:
    """``PagedScheduler.schedule`` with chunking off: prefills win whenever one can start."""
    admitted = []
    left = budget
    for n in waiting_prompt_lens:
        if len(admitted) == free_seqs or n > left:
            break  # FCFS: the head waits, nobody behind it jumps the queue
        admitted.append(n)
        left -= n
    return admitted if admitted else [1] * num_decodes


def chunk_causal_mask(num_new_tokens: int, context_len: int) -> torch.Tensor:
    """``minillm/attention.py``, ``torch_attention``: ``pos[None, :] <= qpos[:, None]``."""
    n, ctx = num_new_tokens, context_len
    if not 1 <= n <= ctx:
        raise ValueError(f"num_new_tokens must be in [1, context_len={ctx}], got {n}")
    qpos = torch.arange(ctx - n, ctx)  # [n] positions of the chunk's queries
    kpos = torch.arange(ctx)  # [ctx] positions of the keys
    return kpos[None, :] <= qpos[:, None]  # [n, ctx]


def chunked_prefill_latency(prompt_len: int, num_decodes: int, budget: int, overhead_s: float,
                            per_token_s: float) -> tuple[float, float]:
    """Step by step: each step pays the overhead again, and feeds at most ``budget`` tokens."""
    room = budget - num_decodes
    if room < 1:
        raise ValueError(f"budget {budget} leaves no room for the prompt next to {num_decodes} decodes")
    ttft = longest = 0.0
    left = prompt_len
    while left > 0:
        chunk = min(left, room)
        t = overhead_s + per_token_s * (num_decodes + chunk)
        ttft += t
        longest = max(longest, t)
        left -= chunk
    return ttft, longest


def decode_stall_steps(step_ends: list[float], token_times: list[list[float]]) -> int:
    """``minillm/bench/summary.py``, ``decode_stall_steps``: it reads only each step's ``end`` and
    each request's ``token_times``, so plain stand-ins for StepRecord and RequestMetrics do."""
    steps = [SimpleNamespace(end=end) for end in step_ends]
    requests = [SimpleNamespace(token_times=list(times)) for times in token_times]
    return summary.decode_stall_steps(steps, requests)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: the decodes take their tokens of the budget first; q2: how many
    chunks of that size the prompt needs."""
    return quiz.sealed("ch04")
