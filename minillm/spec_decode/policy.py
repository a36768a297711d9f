"""When to speculate and how far: small pure functions (no tensors, no engine).

Speculation trades compute for latency. A verification forward over k + 1 tokens per
request costs more than a one-token decode, and pays off only when enough drafts are
accepted, and only when the device has idle compute to spend on them:

* ``num_drafts_allowed``: never draft past what a request may still emit
  (``max_tokens``) or hold (``max_model_len``), nor past the step's token budget.
* ``next_num_speculative_tokens``: adaptive k per request, up by one when its recent
  acceptance is high (> 0.8: the drafts are good, draft further), down by one when it
  is low (< 0.5: most verification work is wasted).
* ``speculation_enabled``: the off switch under load. At a large batch the decode step
  is no longer bound by reading the weights: the k extra tokens per request cost
  nearly their full compute, and throughput drops. So speculate only while fewer than
  ``disable_by_batch_size`` requests are running.
"""
from __future__ import annotations

from typing import Sequence

ACCEPT_UP = 0.8  # recent acceptance above this: one more draft next time
ACCEPT_DOWN = 0.5  # below this: one fewer
HISTORY = 4  # verification steps that make up "recent"


def num_drafts_allowed(k: int, num_output_tokens: int, max_tokens: int, num_tokens: int,
                       max_model_len: int, budget: int) -> int:
    """How many tokens a decoding request may draft this step, at most k.

    A step emits up to drafts + 1 tokens, so drafts <= max_tokens - outputs - 1 and
    num_tokens + drafts + 1 <= max_model_len (the cache is sized for max_model_len).
    ``budget``: tokens left in the step's token budget (each draft is one more query token).
    """
    return max(0, min(k, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1, budget))


def recent_acceptance(history: Sequence[tuple[int, int]]) -> float | None:
    """Accepted / drafted over ``history``, a list of (num_drafts, num_accepted); None if empty."""
    drafted = sum(d for d, _ in history)
    return None if drafted == 0 else sum(a for _, a in history) / drafted


def next_num_speculative_tokens(k: int, acceptance: float | None, k_max: int, k_min: int = 1,
                                up: float = ACCEPT_UP, down: float = ACCEPT_DOWN) -> int:
    """Adaptive k: k + 1 if acceptance > up, k - 1 if acceptance < down, clamped to [k_min, k_max]."""
    if acceptance is None:
        return k
    if acceptance > up:
        k += 1
    elif acceptance < down:
        k -= 1
    return max(k_min, min(k, k_max))


def speculation_enabled(num_running: int, disable_by_batch_size: int | None) -> bool:
    """The off switch: speculate only while the batch is smaller than the threshold."""
    return disable_by_batch_size is None or num_running < disable_by_batch_size


def expected_speedup(alpha: float, k: int, verify_cost: float, draft_cost: float = 0.0,
                     fraction: float = 1.0) -> float:
    """Predicted speedup of speculative decoding over plain decoding, for one request.

    One speculative step costs k drafts (``draft_cost`` each, in units of one target
    decode step) plus one verification forward of k + 1 tokens (``verify_cost`` target
    decode steps), and emits (1 - alpha^(k+1)) / (1 - alpha) tokens on average (each
    draft accepted independently with probability alpha). Plain decoding emits one
    token per unit. So

        speedup = [(1 - alpha^(k+1)) / (1 - alpha)] / (k * draft_cost + verify_cost).

    ``fraction``: the share of steps that draft at all (prompt lookup finds nothing on
    some steps, which then cost and emit exactly one plain step):
    [f E + (1 - f)] / [f (k draft_cost + verify_cost) + (1 - f)].

    On a GPU at small batch verify_cost is ~1 (decode reads the weights once, however
    many tokens); on a CPU it grows with k, which is why speculation gains less there.
    """
    if not 0.0 <= alpha <= 1.0 or k < 0 or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"need 0 <= alpha <= 1, k >= 0, 0 <= fraction <= 1, got {alpha}, {k}, {fraction}")
    tokens = float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    f = fraction
    return (f * tokens + 1.0 - f) / (f * (k * draft_cost + verify_cost) + 1.0 - f)


__all__ = ["ACCEPT_UP", "ACCEPT_DOWN", "HISTORY", "num_drafts_allowed", "recent_acceptance",
           "next_num_speculative_tokens", "speculation_enabled", "expected_speedup"]
