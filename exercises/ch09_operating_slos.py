"""Chapter 9 exercises: a host tier for idle KV blocks, a two-target SLO controller, and an A/B verdict.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch09          # or: .venv/bin/python tests/grade.py ch09

Each docstring gives the contract the tests check and hints. Once you have tried,
compare with the file of ``minillm/`` named at the end of the docstring. Plain Python
(``math``) and numpy are all you need; do not import the answers from ``minillm``.

The three functions are also seams of the library (``minillm/seams.py``): plugged in, yours
choose the idle prefix blocks the paged engine copies to its host tier
(``LLM(kv_offload=...)``), decide the token budget of the engine's SLO controller
(``LLM(slo=...)``), and give the intervals of the A/B table (``minillm.bench.ab``).
"""
from __future__ import annotations


def blocks_to_offload(evictable: list[tuple[int, float]], on_host: set[int], now: float,
                      idle_s: float) -> list[int]:
    """The idle prefix blocks to copy from the device to the host tier now.

    With prefix caching (chapter 6) a freed block keeps its K/V in the device's *evictable*
    pool until an allocation reuses it. The host tier keeps a copy of the blocks that have
    sat there a while, so a user who comes back later is served from host memory (a copy)
    instead of recomputing the conversation.

    ``evictable``: the pool in LRU order (least recently freed first), as
    ``(block id, freed_at)`` with ``freed_at`` the engine's clock (seconds) when the block
    was freed. ``on_host``: the blocks whose K/V the host tier already holds. ``now``: the
    clock now; ``idle_s``: how long a block must have waited.

    Contract:
      - a block is *idle* when ``now - freed_at >= idle_s`` (inclusive);
      - return the idle blocks that are not in ``on_host``, in the pool's (LRU) order;
      - the pool is in the order the blocks were freed, so the idle ones lead it: you may
        stop at the first block that is not idle (every later one was freed later);
      - ``evictable`` and ``on_host`` are not modified.

    Example: now 10.0, idle_s 2.0, evictable [(4, 5.0), (9, 7.5), (2, 8.0), (6, 9.5)],
    on_host {9} -> [4, 2] (9 is on the host already; 6 has waited only 0.5 s).

    Answer, after you try: ``minillm/block_manager.py``, ``blocks_to_offload`` (and
    ``BlockManager.offload_idle``, which the paged scheduler calls every step).
    """
    raise NotImplementedError


def slo_decision(budget: int, ttft_p95: float | None, itl_p95: float | None, ttft_target: float | None,
                 itl_target: float | None, *, min_budget: int, max_budget: int, decrease: float = 0.5,
                 increase: int = 16, headroom: float = 0.8) -> int:
    """The next token budget of a controller that keeps two p95 latencies on target.

    Chapter 7's controller watched the inter-token latency (ITL) only. A smaller token
    budget (``max_num_batched_tokens``) means shorter steps, so lower ITL, but prompts take
    more steps to prefill, so a higher time to first token (TTFT): the two targets pull
    the budget apart. Every interval the engine measures both p95s and asks this rule.

    A metric is *watched* when both its p95 and its target are given (not None: None means
    no target, or no measurement in the interval). Write ``itl_next`` for chapter 7's rule
    on the ITL alone (when the ITL is watched), clamped to the bounds:
    ``floor(budget * decrease)`` if ``itl_p95 > itl_target``; ``budget + increase`` if
    ``itl_p95 < headroom * itl_target``; else ``budget``.

    Contract, in this order (the first case that applies decides):
      1. the ITL is watched and ``itl_p95 > itl_target`` (streams stutter): ``itl_next``,
         a cut, whatever the TTFT says;
      2. the TTFT is watched and ``ttft_p95 > ttft_target`` (prompts wait): give budget
         back, ``ceil(budget / decrease)`` (undoing one cut), but only if the ITL has
         room: it is not watched, or ``itl_next > budget`` (chapter 7's rule would grow
         it); otherwise keep ``budget``;
      3. the TTFT is watched and ``ttft_p95 >= headroom * ttft_target`` (between
         headroom and target): keep ``budget``. This band is the *hysteresis*: a p95 just
         under its target does not invite a raise that would break it again next time;
      4. the ITL is watched: ``itl_next`` (the TTFT is under its headroom or not watched);
      5. the TTFT is watched (under its headroom, no ITL): ``budget + increase``;
      6. nothing watched: keep ``budget``.
    The result is always clamped to ``[min_budget, max_budget]`` and is an ``int``.

    Examples, bounds [16, 512], decrease 0.5, increase 16, headroom 0.8, targets TTFT 2.0 s
    and ITL 0.1 s, budget 128: ITL 0.15 -> 64 (case 1, whatever the TTFT); TTFT 3.0 and
    ITL 0.05 -> 256 (case 2); TTFT 3.0 and ITL 0.09 -> 128 (case 2, no room: ITL in its
    band); TTFT 1.8 and ITL 0.05 -> 128 (case 3); TTFT 1.0 and ITL 0.05 -> 144 (case 4);
    TTFT 1.0, no ITL measured -> 144 (case 5); nothing measured -> 128.

    (The engine's controller also remembers the budget at which the ITL last broke and
    caps a TTFT raise near it; that refinement is the library's, applied to your answer.)

    Answer, after you try: ``minillm/slo.py``, ``slo_decision`` (its ``_base_decision``)
    and ``slo_token_budget`` (chapter 7's rule).
    """
    raise NotImplementedError


def bootstrap_ci(a: list[float], b: list[float], q: float, n_boot: int = 2000, seed: int = 0,
                 conf: float = 0.95) -> tuple[float, tuple[float, float]]:
    """B's q-th percentile minus A's, and its percentile-bootstrap confidence interval.

    ``a`` and ``b``: one latency per request from server A and from server B (say TTFTs).
    Is B's p95 lower than A's, or is the difference noise? The bootstrap answers without
    assuming a distribution: draw each side's requests again, with replacement, and see
    how much the difference moves.

    Contract:
      - ``diff = percentile(b, q) - percentile(a, q)``, with numpy's default (linear)
        interpolation: ``np.percentile``;
      - the interval: ``n_boot`` times, resample ``a`` and ``b`` independently with
        replacement (each to its own size) and compute the difference of their q-th
        percentiles; the interval is the ``(1 - conf) / 2`` and ``1 - (1 - conf) / 2``
        quantiles of those ``n_boot`` differences (``np.percentile`` again, in percent);
      - returns ``(diff, (low, high))`` as floats;
      - the same inputs and ``seed`` give the same answer; use a generator of your own
        seeded with ``seed`` (``np.random.default_rng(seed)``), never the global one;
      - ``ValueError`` when ``a`` or ``b`` is empty, ``q`` is outside [0, 100],
        ``n_boot < 1``, or ``conf`` is not in (0, 1).

    The grader cannot know your random draws, so it checks what any correct bootstrap
    does: the diff exactly; a 95% interval that covers the true difference for most of
    60 synthetic data sets; an interval that narrows as the samples grow; an interval
    above 0 for clearly slower B; a point interval when there is no spread.

    Reading it: an interval entirely below 0 says B's percentile is lower (at confidence
    ``conf``); one that holds 0 says no difference was *detected*, not that there is none.

    Hints: ``rng.integers(0, n, size=(n_boot, n))`` draws every resample's indices at once,
    and ``np.percentile(x, q, axis=1)`` takes each row's percentile.

    Answer, after you try: ``minillm/bench/ab.py``, ``bootstrap_diff`` (which also draws
    requests with all their ITLs, and whole replays).
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch09")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
