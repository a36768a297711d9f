"""Chapter 7 exercises: open-loop arrivals, goodput, and a controller that keeps an SLO.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch07          # or: .venv/bin/python tests/grade.py ch07

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file of ``minillm/`` named at the end of the docstring. Plain Python
(``random``, ``math``) is all you need; do not import the answers from ``minillm``.

The first three functions are also seams of the library (``minillm/seams.py``): plugged
in, yours make the arrival times of every open-loop run, count its goodput, and decide the
token budget of ``run_open_loop(..., slo_itl=...)``'s controller. The chapter's last part
runs them in the engine that way.
"""
from __future__ import annotations


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of ``n`` requests from independent users at ``rate`` per second.

    Contract:
      - returns ``n`` floats, the first 0.0, non-decreasing;
      - the gaps between consecutive arrivals are independent exponential draws with
        mean ``1 / rate`` (a Poisson process): the grader checks their mean, their spread
        (standard deviation = mean) and that about half of them are shorter than
        ``ln(2) / rate`` (the exponential's median);
      - the same ``seed`` gives the same list; another seed, another list;
      - ``rate`` must be a finite number > 0 and ``n`` an integer >= 1, else ``ValueError``
        (a negative rate is a mistake, never "offline").

    Hints: ``random.Random(seed)`` gives a generator of your own (do not reseed the global
    one); ``rng.expovariate(rate)`` draws one gap; so does ``-math.log(1 - rng.random()) / rate``.
    Drawn that way, gap after gap, your arrivals are the library's to the last bit, so the
    chapter's run with your function plugged in can be compared with the library's step by
    step; any other correct generator passes the grader but not that comparison.

    Answer, after you try: ``minillm/bench/loadgen.py``, ``poisson_arrivals``.
    """
    raise NotImplementedError


def goodput(ttfts: list[float | None], tpots: list[float | None], duration: float,
            slo_ttft: float = 1.0, slo_tpot: float = 0.2) -> float:
    """Requests per second that met the service-level objective.

    ``ttfts[i]`` and ``tpots[i]`` are request i's time to first token and mean time per
    output token after the first, in seconds. ``ttfts[i] is None``: the request failed
    (it never produced a token). ``tpots[i] is None``: it produced one token only, so it
    has no TPOT. ``duration``: seconds from the first arrival to the last request's end.

    Contract:
      - request i *meets the SLO* when its TTFT is not None and <= ``slo_ttft``, and its
        TPOT is None or <= ``slo_tpot`` (both bounds inclusive);
      - returns (number of requests that meet it) / ``duration``;
      - ``ttfts`` and ``tpots`` of different lengths, ``duration <= 0``, or an SLO <= 0
        -> ``ValueError``.

    Example: ttfts [0.5, 2.0, 0.3, None], tpots [0.1, 0.1, 0.5, None], duration 2 s,
    SLOs 1 s and 0.2 s -> only the first meets it -> 0.5 requests/s. Throughput would
    count 3 finished requests (1.5/s): goodput is what users got *in time*.

    Answer, after you try: ``minillm/bench/loadgen.py``, ``goodput`` and ``meets_slo``.
    """
    raise NotImplementedError


def next_token_budget(budget: int, itl_p95: float | None, target: float, min_budget: int, max_budget: int,
                      decrease: float = 0.5, increase: int = 16, headroom: float = 0.8) -> int:
    """One decision of a controller that keeps the p95 inter-token latency under ``target``.

    Every second or so the server measures the p95 ITL of the last interval and sets the
    scheduler's token budget (``max_num_batched_tokens``) for the next one. With chunked
    prefill, a smaller budget means smaller prompt chunks in each step: shorter steps, so
    the running decodes wait less (lower ITL), but prompts take more steps to prefill
    (higher TTFT). The rule is additive increase, multiplicative decrease (TCP's):

      - ``itl_p95 > target``: the SLO is broken, back off hard:
        ``floor(budget * decrease)``;
      - ``itl_p95 < headroom * target``: comfortably within it, probe upwards:
        ``budget + increase``;
      - otherwise (between ``headroom * target`` and ``target``), or ``itl_p95 is None``
        (no tokens in the interval): keep ``budget``;
      - the result is always clamped to ``[min_budget, max_budget]``.

    Invalid settings -> ``ValueError``: ``target <= 0``; ``min_budget < 1`` or
    ``min_budget > max_budget``; ``decrease`` not in (0, 1); ``headroom`` not in (0, 1];
    ``increase < 0``.

    Example: budget 256, target 0.2 s, bounds [8, 512]: p95 0.35 -> 128; p95 0.1 -> 272;
    p95 0.18 -> 256; p95 0.35 with budget 12 -> 8 (the floor).

    Answer, after you try: ``minillm/bench/sweep.py``, ``slo_token_budget`` (and
    ``run_open_loop(..., slo_itl=...)``, which applies it between engine steps).
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch07")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
