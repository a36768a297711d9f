"""Chapter 7 solutions: same names and signatures as ``exercises/ch07_serving_online.py``.

The arrivals and the goodput are the load generator's own (``minillm/bench/loadgen.py``);
the controller is ``minillm/bench/sweep.py``'s ``slo_token_budget``.
"""
from __future__ import annotations

from minillm.bench.sweep import slo_token_budget
from minillm.bench import loadgen
from minillm.course import quiz


def poisson_arrivals(rate: float, n: int, seed: int = 0) -> list[float]:
    """``loadgen.poisson_arrivals``: exponential gaps of mean 1 / rate from a seeded generator."""
    return loadgen.poisson_arrivals(rate, n, seed)


def goodput(ttfts: list[float | None], tpots: list[float | None], duration: float,
            slo_ttft: float = 1.0, slo_tpot: float = 0.2) -> float:
    """``loadgen.goodput`` on records built from the two lists (a failed request has no TTFT)."""
    if len(ttfts) != len(tpots):
        raise ValueError(f"got {len(ttfts)} TTFTs and {len(tpots)} TPOTs: give one of each per request")
    if not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration!r}")
    if not (slo_ttft > 0 and slo_tpot > 0):
        raise ValueError(f"the SLOs must be > 0 seconds, got slo_ttft={slo_ttft!r}, slo_tpot={slo_tpot!r}")
    records = [{"ok": ttft is not None, "ttft": ttft, "tpot": tpot} for ttft, tpot in zip(ttfts, tpots)]
    return loadgen.goodput(records, slo_ttft, slo_tpot, duration)


def next_token_budget(budget: int, itl_p95: float | None, target: float, min_budget: int, max_budget: int,
                      decrease: float = 0.5, increase: int = 16, headroom: float = 0.8) -> int:
    """``slo_token_budget``: additive increase, multiplicative decrease, clamped."""
    return slo_token_budget(budget, itl_p95, target, min_budget=min_budget, max_budget=max_budget,
                            decrease=decrease, increase=increase, headroom=headroom)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q2: the first rate whose p99 breaks the SLO; q3: goodput counts the
    requests within both SLOs, per second of the run."""
    return quiz.sealed("ch07")
