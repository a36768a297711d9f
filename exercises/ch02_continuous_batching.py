"""Chapter 2 exercises: iteration-level scheduling (continuous batching).

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch02          # or: .venv/bin/python tests/grade.py ch02

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file of ``minillm/`` named at the end of the docstring. Plain Python
is all you need; do not import the answers from ``minillm`` (reading its ``Request``
class in ``minillm/request.py`` is expected: the scheduler works on those).
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from minillm.request import Request


def schedule_step(running: list[Request], waiting: deque[Request], max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[tuple[Request, int]]:
    """One scheduling step of continuous batching. Returns the rows of the next forward.

    ``running``: the requests in the batch, in admission order; some may have just
    finished (``r.is_finished``). ``waiting``: requests that have arrived, oldest first.
    ``max_num_seqs``: batch slots (B). ``max_num_batched_tokens``: the token budget of
    one forward (T).

    Contract, in this order (both lists are updated IN PLACE):
      1. remove finished requests from ``running`` (their slot frees at once);
      2. every request left in ``running`` decodes: a row ``(request, 1)``, one
         token of the budget each;
      3. admit from the head of ``waiting`` while fewer than B requests run and the
         head's whole prompt, ``r.num_tokens - r.num_computed_tokens`` tokens, fits
         in what is left of the budget: pop it, set ``r.status = RequestStatus.RUNNING``,
         append it to ``running`` and add the row ``(request, that many tokens)``;
      4. stop at the first request that does not fit, even if a later, shorter one
         would (first come, first served: nobody overtakes the head of the queue).
    Return the rows: decodes first (in ``running`` order), then admissions.

    Hints: ``waiting.popleft()``; ``from minillm.request import RequestStatus``;
    keep a running budget counter.

    Answer, after you try: ``minillm/scheduler/continuous.py``, ``ContinuousScheduler.schedule``.
    """
    raise NotImplementedError


def continuous_num_steps(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                         max_num_batched_tokens: int) -> int:
    """Forward passes continuous batching needs for an offline workload (all at t=0).

    ``prompt_lens[i]``, ``output_lens[i]``: prompt tokens and new tokens of request i
    (both >= 1, every prompt <= max_num_batched_tokens), in arrival order.

    Contract: run steps with the rule of ``schedule_step`` until every request is done.
    In a step, an admitted request feeds its whole prompt and gets its first token; a
    running request feeds one token and gets one more. A request that has all its
    tokens finishes at the end of that step and leaves before the next one is scheduled.
    Return the number of steps.

    Example: outputs [20, 20, 800, 20], prompts of 4 tokens, B = 2, T = 64: requests 0
    and 1 run steps 1-20, 2 and 3 are admitted in step 21, the short one is done at
    step 40, the long one at step 820 -> 820. With B = 4 all four start together -> 800.

    Hint: you do not need a model. Count, per request, tokens computed and tokens
    generated (or build ``Request`` objects and reuse ``schedule_step``).

    Answer, after you try: ``minillm/bench/cost_model.py``, ``simulate`` (the real scheduler
    on a virtual clock).
    """
    raise NotImplementedError


def predict_makespan(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int, engine: str,
                     step_time: Callable[[list[int], list[int], int], float]) -> float:
    """Seconds until the last of these requests finishes, all of them waiting at time 0.

    ``engine``: "static" or "continuous". ``step_time(new_tokens, context_lens,
    num_sampled)`` is what one forward costs on some machine (``CostModel.step_time``):
    ``new_tokens[i]`` tokens fed for row i, ``context_lens[i]`` that row's context after
    this step (tokens already computed + new ones), ``num_sampled`` rows that sample. The
    token budget and the KV cache are never short here. Requests ignore EOS: request i
    generates exactly ``output_lens[i]`` tokens.

    Contract (the engine's rules, read ``minillm/scheduler/``):
      - a request's prefill is one row of its whole prompt; it samples the first output
        token. Each later step gives it a decode row (1 new token, which samples) until it
        has ``output_lens[i]`` tokens;
      - "static": a group is the next ``max_num_seqs`` requests in order; its members'
        prefills share one step, then decode steps run until the group's last member is
        done (finished members get no rows); the next group starts at the following step;
      - "continuous": each step, every unfinished running request gets a decode row, then
        waiting requests are admitted in order while fewer than ``max_num_seqs`` are
        running (their prefill row is in the same step); a request that finishes frees
        its slot for the next step.
    The makespan is the sum of the step times.

    Hints: keep, per running request, its prompt length and tokens generated; a decode
    row's context is prompt + generated so far.

    Answer, after you try: the simulator runs the real schedulers on a virtual clock,
    ``minillm/bench/cost_model.py``, ``simulate``.
    """
    raise NotImplementedError


def pick_engine(prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                step_time: Callable[[list[int], list[int], int], float]) -> str:
    """"static" or "continuous": the engine that finishes these requests first (by
    ``predict_makespan``); "static" when they tie to within 0.1%.

    Answer, after you try: compare with ``simulate`` of both engines.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch02")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
