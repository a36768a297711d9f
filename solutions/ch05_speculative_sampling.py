"""Chapter 5 solutions: same names and signatures as ``exercises/ch05_speculative_sampling.py``.

The answers are the code ``minillm/spec_decode`` runs; each wrapper says where to read it.
"""
from __future__ import annotations

from typing import Callable

import torch

from minillm.spec_decode import rejection_sampler
from minillm.spec_decode.ngram import NgramProposer
from minillm.course import quiz


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Read ``minillm/spec_decode/rejection_sampler.py``, ``acceptance_probability``."""
    return rejection_sampler.acceptance_probability(p_x, q_x)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Read ``minillm/spec_decode/rejection_sampler.py``, ``residual_distribution``: clamp, normalize, p if empty."""
    return rejection_sampler.residual_distribution(p, q)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Read ``minillm/spec_decode/rejection_sampler.py``, ``acceptance_rate``: sum of min(p, q)."""
    return rejection_sampler.acceptance_rate(p, q)


def rejection_sample_one(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                         uniforms: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Read ``minillm/spec_decode/rejection_sampler.py``: ``verify_probs`` gives every acceptance
    probability and the distribution for each stopping point; ``emit_tokens`` walks them
    with ``u < accept``. Here the walk uses the uniforms we are given."""
    ids = torch.tensor(draft_tokens, dtype=torch.long).reshape(1, -1)  # a batch of one row
    accept, emit = rejection_sampler.verify_probs(ids, q[None], p[None])  # [1, k], [1, k+1, V]
    num_accepted = 0
    while num_accepted < len(draft_tokens) and uniforms[num_accepted] < accept[0, num_accepted]:
        num_accepted += 1
    return list(draft_tokens[:num_accepted]), emit[0, num_accepted]


def ngram_propose(tokens: list[int], n: int, k: int) -> list[int]:
    """Read ``minillm/spec_decode/ngram.py``, ``NgramProposer.propose``, here with n_min = n_max = n."""
    return NgramProposer(n_max=n, n_min=n, k=k).propose(tokens)


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """Read ``minillm/spec_decode/rejection_sampler.py``, ``expected_num_emitted``: a geometric sum."""
    return rejection_sampler.expected_num_emitted(alpha, k)


def speculative_speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    """Read ``minillm/spec_decode/policy.py``, ``expected_speedup`` (every step drafts: fraction 1)."""
    from minillm.spec_decode import policy

    if not (0.0 <= alpha <= 1.0) or k < 1 or c_draft < 0 or c_verify <= 0:
        raise ValueError(f"need 0 <= alpha <= 1, k >= 1, c_draft >= 0, c_verify > 0; "
                         f"got alpha={alpha}, k={k}, c_draft={c_draft}, c_verify={c_verify}")
    return policy.expected_speedup(alpha, k, c_verify, c_draft)


def rollback_blocks(block_ids: list[int], num_tokens: int, block_size: int) -> list[int]:
    """``minillm/block_manager.py``, ``BlockManager.shrink``: keep ceil(num_tokens / block_size) blocks."""
    keep = -(-num_tokens // block_size)
    freed = block_ids[keep:]
    del block_ids[keep:]
    return freed


def next_num_speculative_tokens(k: int, acceptance: float | None, k_max: int, k_min: int = 1,
                                up: float = 0.8, down: float = 0.5) -> int:
    """Read ``minillm/spec_decode/policy.py``, ``next_num_speculative_tokens``."""
    from minillm.spec_decode import policy

    return policy.next_num_speculative_tokens(k, acceptance, k_max, k_min, up, down)


def pick_strategy(num_requests: int, alpha: float, k: int, step_time: Callable[[int, int], float]) -> str:
    """Rate x acceptance. Batching serves n rows for the price of one step of n rows;
    speculation multiplies each row's tokens per step by the expected emitted tokens for the
    price of a verification step, which is ``policy.expected_speedup`` with the verify cost
    at that batch size (``minillm/spec_decode/policy.py``). "Both" is the product of
    the two gains, taken at n rows: it shrinks once a step of n * (k + 1) tokens is compute-bound."""
    from minillm.spec_decode import policy

    if num_requests < 1 or not 0.0 <= alpha <= 1.0 or k < 1:
        raise ValueError(f"need num_requests >= 1, 0 <= alpha <= 1, k >= 1; "
                         f"got num_requests={num_requests}, alpha={alpha}, k={k}")
    n = num_requests

    def speculation_gain(rows: int) -> float:  # tokens/s with k drafts per row over without, at this many rows
        return policy.expected_speedup(alpha, k, step_time(rows, k + 1) / step_time(rows, 1))

    throughput = {"continuous": n / step_time(n, 1),
                  "speculative": speculation_gain(1) / step_time(1, 1),
                  "both": n / step_time(n, 1) * speculation_gain(n)}
    pick = "continuous"
    for name in ("speculative", "both"):
        if throughput[name] > 1.01 * throughput[pick]:
            pick = name
    return pick


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: the expected tokens per verification, a geometric sum over the
    accepted drafts plus the bonus token; q2: the overlap of the two distributions, sum of min(p, q); q3: tokens
    per verification over the cost of k drafts and one verification."""
    return quiz.sealed("ch05")
