"""Chapter 1 exercises: static (request-level) batching and what its padding costs.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch01          # or: .venv/bin/python tests/grade.py ch01

Each docstring gives the shapes, the contract the tests check, and hints. Once you
have tried, compare with the file of ``minillm/`` named at the end of the docstring.
Plain Python and PyTorch are all you need; do not import the answers from ``minillm``.

Static batching, as the chapter runs it: requests are cut into groups of
``max_num_seqs`` (B) in arrival order (the last group may be smaller). A group
prefills in one step, padded to its longest prompt, then decodes one token per member
per step until its LONGEST member has all its tokens; only then does the next group
start. A request that wants n tokens gets its first token from the prefill step and
the other n - 1 from decode steps.
"""
from __future__ import annotations

from collections import deque

import torch

from minillm.request import Request, RequestStatus


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn prompts of different lengths into one padded batch, padding on the left.

    Shapes: ``prompts`` is a list of B lists of token ids (each non-empty) ->
    (input_ids [B, W], attention_mask [B, W]), both torch.long, W = the longest prompt.

    Contract:
      - row i holds ``W - len(prompts[i])`` copies of ``pad_id``, then the prompt;
      - attention_mask is 0 on padding and 1 on real tokens;
      - the inputs are not modified.

    Why left: the next token of every row is read from the last column, so each
    row's last real token must sit there. (Right padding would put pad tokens there
    for every row shorter than the longest.)

    Hints: build Python lists row by row, then one ``torch.tensor(..., dtype=torch.long)``.

    Answer, after you try: ``minillm/bench/hf_baselines.py``, ``left_pad``.
    """
    raise NotImplementedError


def static_num_steps(output_lens: list[int], max_num_seqs: int) -> int:
    """Forward passes static batching needs: the barrel effect in one number.

    ``output_lens[i]``: new tokens request i wants (>= 1), in arrival order;
    ``max_num_seqs``: B, the group size (>= 1).

    Contract: groups of B consecutive requests (the last may be smaller); a group
    takes as many steps as its longest member wants tokens (1 prefill + n - 1
    decodes); groups run one after the other. Return the total number of steps.

    Example: output_lens [20, 20, 800, 20], B = 2 -> groups (20, 20) and (800, 20)
    -> 20 + 800 = 820 steps, although three of the four requests are short.

    Hint: slice the list in steps of B.

    Answer, after you try: ``minillm/scheduler/static.py`` (run it with
    ``minillm.bench.cost_model.simulate(..., engine="static")`` and count the steps).
    """
    raise NotImplementedError


def static_token_slots(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int) -> tuple[int, int]:
    """(useful, total) token-slots of a static batching run: the padding waste.

    ``prompt_lens[i]``, ``output_lens[i]``: prompt tokens and new tokens of request i
    (both >= 1), in arrival order; ``max_num_seqs``: B.

    Contract (the definition of ``minillm/metrics.py``): every step is a rectangle
    of B rows, even for a last group smaller than B.
      - A group's prefill step is B x W token-slots, W = the group's longest prompt;
        the useful ones are the real prompt tokens.
      - Each of the group's M - 1 decode steps (M = its longest output) is B x 1
        token-slots; a member is useful in decode step k (k = 1 .. M-1) while it still
        needs a token, i.e. while k < its output length.
    Return (sum of useful token-slots, sum of total token-slots) over all steps.
    ``useful / total`` is the slot utilization.

    Example: prompts [3, 5], outputs [1, 3], B = 2: prefill 2 x 5 = 10 slots, 8 useful;
    2 decode steps of 2 slots, 2 useful -> (10, 14).

    Answer, after you try: ``minillm/metrics.py``, ``slot_accounting``, applied to the
    steps of ``minillm/scheduler/static.py``.
    """
    raise NotImplementedError


def static_schedule(group: list[Request], waiting: deque[Request], max_num_seqs: int,
                    max_num_batched_tokens: int) -> list[tuple[Request, int]]:
    """One step of the static scheduler: the rows of the next forward, as (request, tokens).

    ``group``: the batch in flight, finished members included (``r.is_finished``), in
    admission order; ``waiting``: requests that have arrived, oldest first. Both are
    updated IN PLACE. This is the seam the engine calls: the cell after the exercise runs
    the real model with your policy.

    Contract:
      - if any member of ``group`` is unfinished: one decode row ``(r, 1)`` for each
        unfinished member, in group order; nobody is admitted (the barrel);
      - otherwise the group is done: empty ``group``, then form the next one from the
        front of ``waiting``: while fewer than ``max_num_seqs`` are in the group and the
        request's whole prompt (``r.num_tokens - r.num_computed_tokens``) fits what is left
        of ``max_num_batched_tokens``, move it from ``waiting`` to ``group``, set
        ``r.status = RequestStatus.RUNNING``, and give it the row ``(r, prompt tokens)``;
        stop at the first request that does not fit (first come, first served);
      - no rows if nothing runs and nothing waits.

    Answer, after you try: ``minillm/scheduler/static.py``, ``StaticScheduler.schedule``
    (printed at the end of the chapter).
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch01")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
