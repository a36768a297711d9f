"""Chapter 9 solutions: same names and signatures as ``exercises/ch09_operating_slos.py``.

Each answer is the library's own code: the idle-block choice of ``minillm/block_manager.py``,
the SLO controller's rule of ``minillm/slo.py`` (without its ``itl_break`` refinement,
which the controller applies around the seam), and the bootstrap of ``minillm/bench/ab.py``.
"""
from __future__ import annotations

from minillm import block_manager
from minillm.bench import ab
from minillm.slo import SloConfig, slo_decision as _slo_decision
from minillm.course import quiz


def blocks_to_offload(evictable: list[tuple[int, float]], on_host: set[int], now: float,
                      idle_s: float) -> list[int]:
    """``minillm/block_manager.py``, ``blocks_to_offload``: the leading idle run, less what the host holds."""
    return block_manager.blocks_to_offload(evictable, on_host, now, idle_s)


def slo_decision(budget: int, ttft_p95: float | None, itl_p95: float | None, ttft_target: float | None,
                 itl_target: float | None, *, min_budget: int, max_budget: int, decrease: float = 0.5,
                 increase: int = 16, headroom: float = 0.8) -> int:
    """``minillm/slo.py``, ``slo_decision`` with no ``itl_break``: the base rule, clamped to the bounds.

    ``SloConfig`` needs a target and a window; the window plays no part in one decision."""
    both_off = ttft_target is None and itl_target is None
    config = SloConfig(ttft_p95=ttft_target, itl_p95=1.0 if both_off else itl_target, window_s=1.0,
                       decrease=decrease, increase=increase, headroom=headroom)
    nxt, _ = _slo_decision(budget, ttft_p95, None if both_off else itl_p95, config,
                           min_budget=min_budget, max_budget=max_budget)
    return nxt


def bootstrap_ci(a: list[float], b: list[float], q: float, n_boot: int = 2000, seed: int = 0,
                 conf: float = 0.95) -> tuple[float, tuple[float, float]]:
    """``minillm/bench/ab.py``, ``bootstrap_diff`` on one number per request."""
    return ab.bootstrap_diff(list(a), list(b), q, n_boot, seed, conf)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: K and V, in every layer, for every token of a block and every KV
    head, head_dim values of 2 bytes; q2: what a copy costs against what recomputing runs; q3: what a controller
    without a band does near its threshold; q4: what an interval that holds 0 does and does not say."""
    return quiz.sealed("ch09")
