"""Chapter 4 exercises: the token budget of a step, chunked prefill, and what it costs.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch04          # or: .venv/bin/python tests/grade.py ch04

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file named at the end of the docstring. Plain Python (and PyTorch for
the mask) is all you need; do not import the answers from ``minillm``.

The picture: every step feeds at most ``budget`` (``max_num_batched_tokens``) tokens
through ONE forward. A running request that is decoding feeds one token; a prompt
feeds many. With chunked prefill the decodes go first and prompts share what is left,
a long prompt in several chunks; without it a step is all-prefill or all-decode.
"""
from __future__ import annotations

import torch


def split_budget(num_decodes: int, prefill_tokens_left: list[int], budget: int) -> list[int]:
    """How one chunked-prefill step splits its budget: decodes first, then prompt chunks.

    ``num_decodes`` running requests are decoding: each feeds one token. The requests in
    ``prefill_tokens_left`` (arrival order) still have that many prompt tokens to feed.

    Contract:
      - the decodes take ``num_decodes`` tokens first;
      - what is left goes to the prefill requests in order: each takes
        min(its tokens left, what is still left of the budget); once the budget is
        spent, the rest get 0 (they wait for the next step);
      - returns one chunk size per entry of ``prefill_tokens_left``, in the same order
        (the input list is not modified);
      - ``budget < 1``, or ``num_decodes > budget`` (the decodes alone would not fit)
        -> ``ValueError`` whose message says why.

    Example: 3 decodes, prompts [30, 5], budget 16 -> [13, 0]; budget 40 -> [30, 5].

    Answer, after you try: ``minillm/scheduler/paged.py``, ``_schedule_decodes`` then
    ``_schedule_prefills`` (which also check KV blocks and batch slots).
    """
    raise NotImplementedError


def early_step(num_decodes: int, waiting_prompt_lens: list[int], budget: int, free_seqs: int) -> list[int]:
    """One step of the early, unchunked policy: all-prefill or all-decode.

    ``waiting_prompt_lens``: the prompts waiting to start, in arrival order;
    ``free_seqs``: batch slots left (``max_num_seqs`` minus the running requests).

    Contract:
      - admit waiting prompts in order while a batch slot is free and the WHOLE prompt
        fits what is left of the budget; stop at the first that does not (first come,
        first served: nobody jumps the queue);
      - if at least one is admitted, the step is a prefill step: return the admitted
        prompts' lengths (the running decodes get nothing this step: they stall);
      - otherwise it is a decode step: return ``[1] * num_decodes``;
      - the inputs are not modified.

    Example: 2 decodes, waiting [10, 50, 3], budget 32, 4 free slots -> [10];
    waiting [50] -> [1, 1].

    Answer, after you try: ``minillm/scheduler/paged.py``, ``schedule`` with
    ``enable_chunked_prefill=False``.
    """
    raise NotImplementedError


def chunk_causal_mask(num_new_tokens: int, context_len: int) -> torch.Tensor:
    """The attention mask of a prefill chunk that follows ``context_len - num_new_tokens`` cached tokens.

    The chunk's n = ``num_new_tokens`` queries sit at positions
    ``context_len - n .. context_len - 1``; the keys are positions ``0 .. context_len - 1``
    (the cached ones and the chunk's own, written to the cache before attention).

    Contract: a bool tensor [n, context_len], True where query j may attend key i: every
    key at or before the query's own position, none after it. With n == context_len (a
    whole prompt) it is the ordinary lower-triangular causal mask; with n == 1 (a decode)
    one row of all True.
    ``num_new_tokens`` must be in [1, context_len], else ``ValueError``.

    This mask is why chunked prefill is exact: each query sees exactly the keys it
    would have seen had the prompt been fed whole.

    Hints: ``torch.arange``; compare a column of query positions with a row of key
    positions and let broadcasting build the matrix.

    Answer, after you try: ``minillm/attention.py``, ``torch_attention`` (the branch
    "a chunk after cached context").
    """
    raise NotImplementedError


def chunked_prefill_latency(prompt_len: int, num_decodes: int, budget: int, overhead_s: float,
                            per_token_s: float) -> tuple[float, float]:
    """Napkin math of the trade-off: (TTFT of a long prompt, longest gap between decode tokens).

    A prompt of ``prompt_len`` tokens arrives while ``num_decodes`` requests are decoding,
    with chunked prefill at ``budget`` tokens per step. The cost model of a step: a fixed
    ``overhead_s`` for any forward, plus ``per_token_s`` for each token it feeds.

    Contract:
      - every step feeds the decodes first, then as much of the prompt as the rest of
        the budget holds (as ``split_budget`` does), until the prompt is done; the step
        that feeds its last token produces its first token;
      - the prompt arrives just as a step starts: TTFT is the time from then until the
        end of the step that produces its first token;
      - each decoding request gets one token per step; max_itl_s is the longest gap
        between two of its tokens while the prompt is being fed;
      - returns (ttft_s, max_itl_s); ``budget <= num_decodes`` (no room for the prompt:
        it would never start) -> ``ValueError``.

    Hints: walk the steps one by one (or count them), and mind the last chunk: it can be
    shorter than the others. Then try a few budgets: which way do the two numbers move,
    and what would the decoders wait for if the whole prompt went in one step?

    Answer, after you try: ``solutions/ch04_chunked_prefill.py`` (the chapter measures
    the same trade-off on the real model).
    """
    raise NotImplementedError


def decode_stall_steps(step_ends: list[float], token_times: list[list[float]]) -> int:
    """Count the steps in which a running, decoding request produced no token.

    ``step_ends[k]``: when step k ended (increasing). ``token_times[r]``: the times at
    which request r produced its tokens; a token produced by step k is stamped with
    exactly ``step_ends[k]``.

    Contract:
      - request r is decoding during step k when it produced its first token in an
        earlier step and its last token in step k or later:
        first token time < step_ends[k] <= last token time;
      - step k stalls when some request decoding during it has no token stamped
        ``step_ends[k]``; return the number of stalled steps (a step counts once,
        however many requests it stalled);
      - requests with no tokens never count.

    With chunking off every prefill step that runs while others decode is a stall;
    with chunked prefill the count is 0.

    Answer, after you try: ``minillm/bench/summary.py``, ``decode_stall_steps``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch04")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
