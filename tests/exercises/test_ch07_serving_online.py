"""Grades exercises/ch07_serving_online.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python), never taken from minillm, so the tests stay
meaningful for the solutions. The statistical checks of the arrivals use 20000 gaps and
bounds of about six standard errors: a correct generator fails them about once in a
hundred million runs, a wrong distribution (uniform gaps, a fixed gap, gaps of mean
rate instead of 1 / rate) fails them every time. The whole file runs in about a second.
Every failure is one line: what was checked, what was expected, what came back.
"""
from __future__ import annotations

import math
import random

import pytest

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch07_serving_online"
poisson_arrivals = adapters.function(CHAPTER, "poisson_arrivals")
goodput = adapters.function(CHAPTER, "goodput")
next_token_budget = adapters.function(CHAPTER, "next_token_budget")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _short(value, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 5] + " ...)"


def _call(args, kwargs) -> str:
    parts = [_short(a, 60) for a in args] + [f"{k}={_short(v, 60)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _expect_value_error(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` must raise ValueError; fail with one line saying what happened instead."""
    __tracebackhide__ = True
    call = f"{fn.__name__}({_call(args, kwargs)})"
    try:
        got = fn(*args, **kwargs)
    except ValueError:
        return
    except Exception as e:  # noqa: BLE001 -- reported, not raised: the line says which error came instead
        pytest.fail(f"{call}: expected ValueError, got {type(e).__name__}: {e}", pytrace=False)
    pytest.fail(f"{call}: expected ValueError, got the return value {_short(got)}", pytrace=False)


# ---------------------------------------------------------------- poisson_arrivals


def test_arrivals_shape():
    """Contract: returns n floats, the first 0.0, non-decreasing."""
    times = poisson_arrivals(2.0, 50, seed=1)
    assert isinstance(times, list), f"poisson_arrivals(2.0, 50, seed=1): expected a list, got {type(times).__name__}"
    adapters.expect(len(times), 50, "poisson_arrivals(2.0, 50, seed=1): number of arrival times")
    adapters.expect(["float" if isinstance(t, float) else type(t).__name__ for t in times], ["float"] * 50,
                    "poisson_arrivals(2.0, 50, seed=1): type of each arrival time")
    adapters.expect(times[0], 0.0, "poisson_arrivals(2.0, 50, seed=1): the first arrival (the first request "
                                   "arrives at 0)")
    back = next((i for i in range(1, len(times)) if times[i] < times[i - 1]), None)
    if back is not None:
        pytest.fail(f"poisson_arrivals(2.0, 50, seed=1): arrival times never go back; expected arrival [{back}] >= "
                    f"arrival [{back - 1}] = {times[back - 1]!r}, got {times[back]!r}", pytrace=False)
    adapters.expect(poisson_arrivals(3.0, 1), [0.0], "poisson_arrivals(3.0, 1): one request, arriving at 0")


def test_arrivals_are_seeded():
    """Contract: the same seed gives the same list; another seed, another list (a generator of your own)."""
    first = poisson_arrivals(2.0, 30, seed=7)
    adapters.expect(poisson_arrivals(2.0, 30, seed=7), first,
                    "poisson_arrivals(2.0, 30, seed=7) called twice: same seed, same arrivals; second call")
    assert poisson_arrivals(2.0, 30, seed=8) != first, (
        "poisson_arrivals(2.0, 30, seed=8): expected other arrivals than seed=7's, got the same list "
        "(seed your own generator with the seed argument)")
    state = random.getstate()
    poisson_arrivals(2.0, 10, seed=3)
    assert random.getstate() == state, ("poisson_arrivals(2.0, 10, seed=3): expected Python's global random state "
                                        "unchanged, got it changed: use random.Random(seed), do not reseed or draw "
                                        "from the global generator")


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_gaps_are_exponential_with_mean_one_over_rate(rate):
    """Contract: the gaps are independent exponential draws with mean 1 / rate (sd = mean, median ln(2) / rate)."""
    n = 20001
    times = poisson_arrivals(rate, n, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    m = len(gaps)
    mean = sum(gaps) / m
    # Exponential(rate): mean 1/rate, sd 1/rate; the sample mean has sd (1/rate)/sqrt(m).
    adapters.expect_that(abs(mean - 1 / rate) < 6 / rate / math.sqrt(m), f"poisson_arrivals({rate}, {n}): mean gap",
                         f"1/rate = {1 / rate:.4f} s (within {6 / rate / math.sqrt(m):.4f}; the rate is requests "
                         f"per second)", f"{mean:.4f} s")
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (m - 1))
    # sd of the sample sd of an exponential ~ sqrt(2)/rate / sqrt(m) (its kurtosis is 9): 6 of those
    adapters.expect_that(abs(sd / mean - 1) < 6 * math.sqrt(2) / math.sqrt(m),
                         f"poisson_arrivals({rate}, {n}): gap sd / mean",
                         f"1 (within {6 * math.sqrt(2) / math.sqrt(m):.3f}: exponential gaps have sd = mean; a fixed "
                         f"or uniform gap does not)", f"{sd / mean:.3f}")
    short = sum(g < math.log(2) / rate for g in gaps) / m
    adapters.expect_that(abs(short - 0.5) < 6 * 0.5 / math.sqrt(m),
                         f"poisson_arrivals({rate}, {n}): the fraction of gaps shorter than ln(2)/rate, the "
                         f"exponential's median", f"0.5 (within {6 * 0.5 / math.sqrt(m):.3f})", f"{short:.3f}")


@pytest.mark.parametrize("rate, n", [(0, 5), (-1.0, 5), (float("inf"), 5), (float("nan"), 5), (1.0, 0), (1.0, 2.5)])
def test_arrivals_reject_bad_input(rate, n):
    """Contract: rate must be a finite number > 0 and n an integer >= 1, else ValueError."""
    _expect_value_error(poisson_arrivals, rate, n)


# ---------------------------------------------------------------- goodput


def _goodput_oracle(ttfts, tpots, duration, slo_ttft, slo_tpot):
    good = 0
    for ttft, tpot in zip(ttfts, tpots):
        if ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):
            good += 1
    return good / duration


def test_goodput_example():
    """Contract: returns (number of requests that meet the SLO) / duration."""
    got = goodput([0.5, 2.0, 0.3, None], [0.1, 0.1, 0.5, None], 2.0, 1.0, 0.2)
    assert got == pytest.approx(0.5), (
        f"goodput of the docstring's example: only the first request meets TTFT <= 1 s and TPOT <= 0.2 s, "
        f"1 request / 2 s: expected 0.5, got {got!r}")


def test_goodput_edges():
    """Contract: TTFT not None and <= slo_ttft, TPOT None or <= slo_tpot (both bounds inclusive)."""
    adapters.expect(goodput([1.0], [0.2], 1.0, 1.0, 0.2), pytest.approx(1.0),
                    "goodput([1.0], [0.2], 1.0, 1.0, 0.2): both bounds are inclusive")
    adapters.expect(goodput([0.1], [None], 4.0, 1.0, 0.2), pytest.approx(0.25),
                    "goodput([0.1], [None], 4.0, 1.0, 0.2): a one-token answer, only its TTFT counts")
    adapters.expect(goodput([None], [None], 1.0), 0.0,
                    "goodput([None], [None], 1.0): a failed request never meets the SLO")
    adapters.expect(goodput([], [], 3.0), 0.0, "goodput([], [], 3.0): no requests, no goodput")


def test_goodput_random():
    """Contract: requests within both SLOs per second of duration (random runs, fewest requests first)."""
    rng = random.Random(0)
    cases = []
    for _ in range(200):
        n = rng.randint(0, 20)
        ttfts = [None if rng.random() < 0.1 else rng.uniform(0, 2) for _ in range(n)]
        tpots = [None if rng.random() < 0.2 else rng.uniform(0, 0.4) for _ in range(n)]
        cases.append((ttfts, tpots, rng.uniform(0.5, 30), rng.uniform(0.1, 2), rng.uniform(0.05, 0.4)))
    for ttfts, tpots, duration, st, sp in sorted(cases, key=lambda c: len(c[0])):
        n = len(ttfts)
        want = _goodput_oracle(ttfts, tpots, duration, st, sp)
        adapters.expect(goodput(ttfts, tpots, duration, st, sp), pytest.approx(want),
                        f"goodput({_call((ttfts, tpots, duration, st, sp), {})}) "
                        f"({round(want * duration)} of {n} requests within the SLO)")


@pytest.mark.parametrize("args", [([0.1], [0.1, 0.2], 1.0, 1.0, 0.2), ([0.1], [0.1], 0.0, 1.0, 0.2),
                                  ([0.1], [0.1], -2.0, 1.0, 0.2), ([0.1], [0.1], 1.0, 0.0, 0.2),
                                  ([0.1], [0.1], 1.0, 1.0, -0.1)])
def test_goodput_rejects_bad_input(args):
    """Contract: lists of different lengths, duration <= 0, or an SLO <= 0 -> ValueError."""
    _expect_value_error(goodput, *args)


# ---------------------------------------------------------------- next_token_budget


def test_budget_example():
    """Contract: over target -> floor(budget * decrease); under headroom * target -> budget + increase; else or
    None -> keep; always clamped to [min_budget, max_budget]."""
    kw = dict(target=0.2, min_budget=8, max_budget=512)
    for budget, p95, want, why in [(256, 0.35, 128, "p95 above the target: halve the budget"),
                                   (256, 0.1, 272, "p95 well below: add `increase` (16) tokens"),
                                   (256, 0.18, 256, "p95 between headroom * target and target: keep"),
                                   (12, 0.35, 8, "never below min_budget"),
                                   (510, 0.01, 512, "never above max_budget"),
                                   (256, None, 256, "no measurement: keep")]:
        adapters.expect(next_token_budget(budget, p95, **kw), want,
                        f"next_token_budget({budget}, {p95}, target=0.2, min_budget=8, max_budget=512) ({why})")


def test_budget_boundaries_and_options():
    """Contract: 'over' is itl_p95 > target and 'under' is itl_p95 < headroom * target (both strict); decrease,
    increase and headroom are the caller's."""
    kw = dict(min_budget=1, max_budget=10_000)
    for args, opts, want, why in [((100, 0.2, 0.2), {}, 100, "exactly at the target is not above it: keep"),
                                  ((100, 0.1, 0.2), dict(headroom=0.5), 100,
                                   "exactly headroom * target is not below it: keep"),
                                  ((101, 0.3, 0.2), dict(decrease=0.5), 50, "floor(101 * 0.5)"),
                                  ((100, 0.3, 0.2), dict(decrease=0.9), 90, "floor(100 * 0.9)"),
                                  ((100, 0.05, 0.2), dict(increase=7), 107, "100 + increase"),
                                  ((100, 0.19, 0.2), dict(headroom=1.0), 116, "headroom 1: any p95 under target grows")]:
        adapters.expect(next_token_budget(*args, **opts, **kw), want,
                        f"next_token_budget({_call(args, opts | kw)}) ({why})")


def test_budget_controller_converges():
    """Contract: additive increase, multiplicative decrease keeps the p95 ITL near the target."""
    # A toy server whose p95 ITL grows with the budget: 0.05 s + 1 ms per token of budget.
    # The target 0.2 s is met at budgets <= 150: the controller must settle around there.
    budget, seen = 512, []
    for _ in range(60):
        budget = next_token_budget(budget, 0.05 + 0.001 * budget, 0.2, 16, 1024)
        seen.append(budget)
    tail = seen[-20:]
    adapters.expect_that(max(tail) <= 1.2 * 150 and min(tail) >= 150 / 2 - 16,
                         "the last 20 budgets with p95 ITL = 0.05 + 0.001 * budget and target 0.2 s",
                         f"budgets near 150 (within [{150 / 2 - 16:g}, {1.2 * 150:g}])", tail)


@pytest.mark.parametrize("kw", [dict(target=0.0), dict(target=-1.0), dict(min_budget=0), dict(min_budget=600),
                                dict(decrease=1.0), dict(decrease=0.0), dict(headroom=0.0), dict(headroom=1.5),
                                dict(increase=-1)])
def test_budget_rejects_bad_settings(kw):
    """Contract: target <= 0, min_budget < 1 or > max_budget, decrease not in (0, 1), headroom not in (0, 1],
    increase < 0 -> ValueError."""
    args = dict(budget=64, itl_p95=0.1, target=0.2, min_budget=8, max_budget=512) | kw
    _expect_value_error(next_token_budget, **args)


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() returns a dict of this chapter's answers."""
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
