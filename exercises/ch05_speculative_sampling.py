"""Chapter 5 exercises: the rejection-sampling rule, the n-gram drafter, the speedup, the strategy.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch05          # or: .venv/bin/python tests/grade.py ch05

Each docstring gives the shapes, the contract the tests check, and hints. Once you
have tried, compare with the file of ``minillm/`` named at the end of the docstring.
Plain PyTorch and Python are all you need; do not import the answers from ``minillm``.

Notation: the drafter proposes x_0 .. x_{k-1}, x_i sampled from q_i; the target model
gives p_0 .. p_k (p_i for the slot of x_i, p_k for the slot after the last draft).
"""
from __future__ import annotations

from typing import Callable

import torch


def accept_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """The probability of keeping a drafted token x: min(1, p(x) / q(x)).

    Shapes: p_x and q_x, any shape (the same, or broadcastable) -> that shape.
    p_x holds the target's probability of each drafted token, q_x the drafter's;
    every q_x is > 0 (x was sampled from q).

    Contract: elementwise min(1, p_x / q_x). A token the target likes at least as much
    as the drafter (p >= q) is always kept; one the target never picks (p = 0) never is.

    Hints: one division and ``clamp(max=1.0)`` (or ``torch.minimum``).

    Answer, after you try: ``minillm/spec_decode/rejection_sampler.py``, ``acceptance_probability``.
    """
    raise NotImplementedError


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where a rejected draft is replaced from: norm(max(0, p - q)).

    Shapes: p, q [..., V] (probability distributions over the last dim) -> [..., V].

    Contract, for each row:
      - r = max(0, p - q) elementwise, divided by its sum, so the row sums to 1;
      - tokens where q >= p get probability 0: the drafter already proposes them at
        least as often as the target wants, so a resample must not add more;
      - if r sums to 0 (p == q), return p for that row. (That row can never be
        reached -- with p == q every draft is accepted -- but it must not be nan.)

    Hints: ``(p - q).clamp(min=0)``, ``sum(dim=-1, keepdim=True)``, ``torch.where``.
    Divide by ``mass.clamp(min=tiny)`` so the all-zero rows do not make nan.

    Answer, after you try: ``minillm/spec_decode/rejection_sampler.py``, ``residual_distribution``.
    """
    raise NotImplementedError


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha: the probability that one draft x ~ q is accepted against p.

    Shapes: p, q [..., V] -> [...].

    Contract: alpha = E_{x ~ q}[min(1, p(x) / q(x))], computed exactly (no sampling), one
    value per row: 1 when the drafter is the target, 0 when they share no token.

    Hints: write out the expectation as a sum over the vocabulary and simplify each term
    q(x) * min(1, p(x)/q(x)); it needs no division.

    Answer, after you try: ``minillm/spec_decode/rejection_sampler.py``, ``acceptance_rate``.
    """
    raise NotImplementedError


def rejection_sample_one(draft_tokens: list[int], q: torch.Tensor, p: torch.Tensor,
                         uniforms: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """Verify one request's k drafts, with the random numbers given to you.

    Shapes: draft_tokens, k ints; q [k, V] (q[i] is what draft_tokens[i] was sampled
    from); p [k+1, V]; uniforms [k], each in [0, 1).
    Returns (accepted, last_probs): the accepted drafts (a prefix of draft_tokens) and
    the distribution [V] the one extra token is sampled from.

    Contract (Leviathan et al. 2023; Chen et al. 2023):
      - walk i = 0, 1, ...: accept draft_tokens[i] iff uniforms[i] < min(1, p_i(x) / q_i(x))
        (so it is accepted with exactly that probability);
      - at the first rejection, stop: last_probs = norm(max(0, p_i - q_i));
      - if all k are accepted: last_probs = p[k] (the "bonus" token).
    The caller then emits accepted + [a sample of last_probs]: between 1 and k + 1
    tokens, and every one of them has exactly the target's distribution.

    Hints: a plain loop over i; reuse your two functions above.

    Answer, after you try: ``minillm/spec_decode/rejection_sampler.py``, ``verify_probs`` (the
    probabilities, batched) and ``emit_tokens`` (the walk); ``rejection_sample_ref`` is
    the same algorithm as a loop.
    """
    raise NotImplementedError


def ngram_propose(tokens: list[int], n: int, k: int) -> list[int]:
    """Prompt lookup: guess the next tokens by copying from earlier in the sequence.

    tokens: prompt + output so far. Returns up to k proposed tokens.

    Contract:
      - take the last n tokens (the suffix); find the most recent earlier position j
        where they occur, tokens[j:j+n] == suffix, with at least one token after the
        occurrence (j + n < len(tokens), which also keeps the suffix from matching itself);
      - propose tokens[j+n : j+n+k] -- what followed it, at most k tokens, cut at the
        end of the sequence;
      - [] if the suffix did not occur earlier, if len(tokens) <= n, or if k == 0.
    Only this n: no fallback to shorter suffixes.

    Hints: loop j from len(tokens) - n - 1 down to 0 and compare slices.

    Answer, after you try: ``minillm/spec_decode/ngram.py``, ``NgramProposer.propose`` (which
    also tries n_max down to n_min).
    """
    raise NotImplementedError


def expected_tokens_per_forward(alpha: float, k: int) -> float:
    """Mean tokens one verification step emits, if each draft is accepted with probability alpha.

    Contract: drafts are accepted independently with probability alpha and the walk
    stops at the first rejection; the step emits the accepted drafts plus one token.
    Return the expected number of tokens emitted: 1 when alpha == 0, k + 1 when
    alpha == 1, always 1 <= E <= k + 1, growing with alpha and with k.

    Hints: the expected number of accepted drafts is a sum over i = 1..k of
    P(at least i drafts accepted); if you use a closed form, watch out for alpha == 1.

    Answer, after you try: ``minillm/spec_decode/rejection_sampler.py``, ``expected_num_emitted``.
    """
    raise NotImplementedError


def speculative_speedup(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    """Predicted speedup of speculative decoding over plain decoding, for one request.

    Units: one plain decode step of the target costs 1. A speculative step drafts k
    tokens (each draft forward costs ``c_draft``) and verifies them in one target forward
    over k + 1 tokens (costs ``c_verify``); each draft is accepted independently with
    probability ``alpha`` and the walk stops at the first rejection.

    Contract: return the tokens per unit of cost of speculative decoding, relative to
    plain decoding's (which gets 1 token per unit).
    ``speculative_speedup(0.0, k, 0.0, 1.0) == 1.0`` (no draft ever accepted, verification
    as cheap as a decode step: exactly plain decoding). Raise ValueError unless
    0 <= alpha <= 1, k >= 1, c_draft >= 0 and c_verify > 0.

    Hints: reuse ``expected_tokens_per_forward``. The chapter's section 5 measured
    alpha, c_draft and c_verify on this machine: the cell after the exercises puts your
    function next to the measured speedups.

    Answer, after you try: ``minillm/spec_decode/policy.py``, ``expected_speedup``.
    """
    raise NotImplementedError


def rollback_blocks(block_ids: list[int], num_tokens: int, block_size: int) -> list[int]:
    """After verification: give back the KV blocks of rejected drafts.

    ``block_ids``: the request's block table, grown before the step to hold every draft;
    ``num_tokens``: how many tokens of K/V the request keeps (prompt + accepted output).
    Contract: remove from the END of ``block_ids`` (in place) every block past the ones
    the kept tokens need, and return the removed ids in table order (the caller frees
    them). A block that still holds a kept token stays, even if rejected drafts also
    wrote into it: their slots are simply overwritten later.

    Answer, after you try: ``minillm/block_manager.py``, ``BlockManager.shrink``.
    """
    raise NotImplementedError


def next_num_speculative_tokens(k: int, acceptance: float | None, k_max: int, k_min: int = 1,
                                up: float = 0.8, down: float = 0.5) -> int:
    """Adaptive k: how many tokens a request drafts at its next step.

    ``acceptance``: its recent accepted / drafted (None: no drafts judged yet).
    Contract: None -> k unchanged; above ``up`` -> k + 1; below ``down`` -> k - 1; else k;
    the result clamped to [k_min, k_max].

    Answer, after you try: ``minillm/spec_decode/policy.py``, ``next_num_speculative_tokens``.
    """
    raise NotImplementedError


def pick_strategy(num_requests: int, alpha: float, k: int, step_time: Callable[[int, int], float]) -> str:
    """Continuous batching, speculative decoding, or both: which one serves these requests fastest.

    The scenario: ``num_requests`` requests are in flight at once, each still wanting many
    tokens (steady decoding: leave out prefills and the end of the run). A drafter that
    costs nothing (prompt lookup) proposes ``k`` tokens for a request at every step; each
    draft is accepted independently with probability ``alpha`` and verification stops at
    the first rejection, as in ``expected_tokens_per_forward``.
    ``step_time(num_rows, tokens_per_row)`` is the seconds of one target forward in which
    ``num_rows`` requests each feed ``tokens_per_row`` tokens: 1 for a plain decode step,
    k + 1 (the known token and k drafts) for a step that verifies drafts.

    The three strategies, returned as these strings:
      - "continuous": continuous batching without speculation; every step runs all
        ``num_requests`` requests, one token each (with one request: plain decoding);
      - "speculative": speculation without batching; one request at a time (the others
        wait), every step verifying its k drafts;
      - "both": every step runs all ``num_requests`` requests, each verifying its k drafts.

    Contract: compare the strategies by throughput, the expected output tokens per second
    of all the requests together. Go through them in the order "continuous",
    "speculative", "both": a strategy replaces the current pick only when its throughput
    is more than 1% higher than the pick's (so a tie keeps the simpler strategy; with one
    request, "both" is the same as "speculative"). Raise ValueError unless
    num_requests >= 1, 0 <= alpha <= 1 and k >= 1.

    Hints: for each strategy, ask what one step emits on average and what that step
    costs; reuse ``expected_tokens_per_forward``. Section 7 of the chapter measured the
    three strategies on this machine; its cell "Your pick_strategy against the measured
    grid" puts your picks next to those measurements.

    Answer, after you try: ``solutions/ch05_speculative_sampling.py``, which builds it from
    ``minillm/spec_decode/policy.py``, ``expected_speedup``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch05")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
