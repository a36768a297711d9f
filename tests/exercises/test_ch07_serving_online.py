"""Grades exercises/ch07_serving_online.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python), never taken from minillm, so the tests stay
meaningful for the solutions. The statistical checks of the arrivals use 20000 gaps and
bounds of about six standard errors: a correct generator fails them about once in a
hundred million runs, a wrong distribution (uniform gaps, a fixed gap, gaps of mean
rate instead of 1 / rate) fails them every time. The whole file runs in about a second.
"""
from __future__ import annotations

import math
import random

import pytest

import adapters

pytestmark = pytest.mark.exercises

CHAPTER = "ch07_serving_online"
poisson_arrivals = adapters.function(CHAPTER, "poisson_arrivals")
goodput = adapters.function(CHAPTER, "goodput")
next_token_budget = adapters.function(CHAPTER, "next_token_budget")


# ---------------------------------------------------------------- poisson_arrivals


def test_arrivals_shape():
    times = poisson_arrivals(2.0, 50, seed=1)
    assert len(times) == 50 and all(isinstance(t, float) for t in times), "n floats"
    assert times[0] == 0.0, "the first request arrives at 0"
    assert all(b >= a for a, b in zip(times, times[1:])), "arrival times never go back"
    assert poisson_arrivals(3.0, 1) == [0.0]


def test_arrivals_are_seeded():
    assert poisson_arrivals(2.0, 30, seed=7) == poisson_arrivals(2.0, 30, seed=7), "same seed, same arrivals"
    assert poisson_arrivals(2.0, 30, seed=7) != poisson_arrivals(2.0, 30, seed=8), "another seed, other arrivals"
    state = random.getstate()
    poisson_arrivals(2.0, 10, seed=3)
    assert random.getstate() == state, "use a generator of your own: do not reseed or draw from the global one"


@pytest.mark.parametrize("rate", [0.5, 4.0])
def test_gaps_are_exponential_with_mean_one_over_rate(rate):
    n = 20001
    times = poisson_arrivals(rate, n, seed=0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    m = len(gaps)
    mean = sum(gaps) / m
    # Exponential(rate): mean 1/rate, sd 1/rate; the sample mean has sd (1/rate)/sqrt(m).
    assert abs(mean - 1 / rate) < 6 / rate / math.sqrt(m), (
        f"mean gap {mean:.4f} s, expected 1/rate = {1 / rate:.4f} s (the rate is requests per second)")
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (m - 1))
    # sd of the sample sd of an exponential ~ sqrt(2)/rate / sqrt(m) (its kurtosis is 9): 6 of those
    assert abs(sd / mean - 1) < 6 * math.sqrt(2) / math.sqrt(m), (
        f"gap sd / mean = {sd / mean:.3f}; exponential gaps have sd = mean (a fixed or uniform gap does not)")
    short = sum(g < math.log(2) / rate for g in gaps) / m
    assert abs(short - 0.5) < 6 * 0.5 / math.sqrt(m), (
        f"{short:.3f} of the gaps are shorter than ln(2)/rate, the exponential's median: expected 0.5")


@pytest.mark.parametrize("rate, n", [(0, 5), (-1.0, 5), (float("inf"), 5), (float("nan"), 5), (1.0, 0), (1.0, 2.5)])
def test_arrivals_reject_bad_input(rate, n):
    with pytest.raises(ValueError):
        poisson_arrivals(rate, n)


# ---------------------------------------------------------------- goodput


def _goodput_oracle(ttfts, tpots, duration, slo_ttft, slo_tpot):
    good = 0
    for ttft, tpot in zip(ttfts, tpots):
        if ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot):
            good += 1
    return good / duration


def test_goodput_example():
    got = goodput([0.5, 2.0, 0.3, None], [0.1, 0.1, 0.5, None], 2.0, 1.0, 0.2)
    assert got == pytest.approx(0.5), (
        f"only the first request meets TTFT <= 1 s and TPOT <= 0.2 s: 1 request / 2 s = 0.5; got {got}")


def test_goodput_edges():
    assert goodput([1.0], [0.2], 1.0, 1.0, 0.2) == pytest.approx(1.0), "both bounds are inclusive"
    assert goodput([0.1], [None], 4.0, 1.0, 0.2) == pytest.approx(0.25), "a one-token answer: only its TTFT counts"
    assert goodput([None], [None], 1.0) == 0.0, "a failed request never meets the SLO"
    assert goodput([], [], 3.0) == 0.0, "no requests, no goodput"


def test_goodput_random():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 20)
        ttfts = [None if rng.random() < 0.1 else rng.uniform(0, 2) for _ in range(n)]
        tpots = [None if rng.random() < 0.2 else rng.uniform(0, 0.4) for _ in range(n)]
        duration, st, sp = rng.uniform(0.5, 30), rng.uniform(0.1, 2), rng.uniform(0.05, 0.4)
        assert goodput(ttfts, tpots, duration, st, sp) == pytest.approx(_goodput_oracle(ttfts, tpots, duration, st, sp))


@pytest.mark.parametrize("args", [([0.1], [0.1, 0.2], 1.0, 1.0, 0.2), ([0.1], [0.1], 0.0, 1.0, 0.2),
                                  ([0.1], [0.1], -2.0, 1.0, 0.2), ([0.1], [0.1], 1.0, 0.0, 0.2),
                                  ([0.1], [0.1], 1.0, 1.0, -0.1)])
def test_goodput_rejects_bad_input(args):
    with pytest.raises(ValueError):
        goodput(*args)


# ---------------------------------------------------------------- next_token_budget


def test_budget_example():
    kw = dict(target=0.2, min_budget=8, max_budget=512)
    assert next_token_budget(256, 0.35, **kw) == 128, "p95 above the target: halve the budget"
    assert next_token_budget(256, 0.1, **kw) == 272, "p95 well below: add `increase` (16) tokens"
    assert next_token_budget(256, 0.18, **kw) == 256, "p95 between headroom * target and target: keep"
    assert next_token_budget(12, 0.35, **kw) == 8, "never below min_budget"
    assert next_token_budget(510, 0.01, **kw) == 512, "never above max_budget"
    assert next_token_budget(256, None, **kw) == 256, "no measurement: keep"


def test_budget_boundaries_and_options():
    kw = dict(min_budget=1, max_budget=10_000)
    assert next_token_budget(100, 0.2, 0.2, **kw) == 100, "exactly at the target is not above it: keep"
    assert next_token_budget(100, 0.1, 0.2, headroom=0.5, **kw) == 100, "exactly headroom * target is not below it: keep"
    assert next_token_budget(101, 0.3, 0.2, decrease=0.5, **kw) == 50, "floor(101 * 0.5)"
    assert next_token_budget(100, 0.3, 0.2, decrease=0.9, **kw) == 90
    assert next_token_budget(100, 0.05, 0.2, increase=7, **kw) == 107
    assert next_token_budget(100, 0.19, 0.2, headroom=1.0, **kw) == 116, "headroom 1: any p95 under target grows"


def test_budget_controller_converges():
    # A toy server whose p95 ITL grows with the budget: 0.05 s + 1 ms per token of budget.
    # The target 0.2 s is met at budgets <= 150: the controller must settle around there.
    budget, seen = 512, []
    for _ in range(60):
        budget = next_token_budget(budget, 0.05 + 0.001 * budget, 0.2, 16, 1024)
        seen.append(budget)
    tail = seen[-20:]
    assert max(tail) <= 1.2 * 150 and min(tail) >= 150 / 2 - 16, (
        f"with p95 ITL = 0.05 + 0.001 * budget and target 0.2 s, budgets should stay near 150; got {tail}")


@pytest.mark.parametrize("kw", [dict(target=0.0), dict(target=-1.0), dict(min_budget=0), dict(min_budget=600),
                                dict(decrease=1.0), dict(decrease=0.0), dict(headroom=0.0), dict(headroom=1.5),
                                dict(increase=-1)])
def test_budget_rejects_bad_settings(kw):
    args = dict(budget=64, itl_p95=0.1, target=0.2, min_budget=8, max_budget=512) | kw
    with pytest.raises(ValueError):
        next_token_budget(**args)
