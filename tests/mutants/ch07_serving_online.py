"""Wrong answers to exercises/ch07_serving_online.py, each a mistake the contract rules out."""
from __future__ import annotations

import math
import random

from mutants import mutant


def _check_arrival_args(rate, n):
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")


def _arrivals(n, gap):
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += gap()
    return times


# ---------------------------------------------------------------- poisson_arrivals


@mutant("poisson_arrivals", "the gaps have mean rate, not 1 / rate (expovariate(1 / rate))")
def _arrivals_mean_rate(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(seed)
    return _arrivals(n, lambda: rng.expovariate(1 / rate))


@mutant("poisson_arrivals", "the first request arrives after one gap, not at 0")
def _arrivals_first_after_a_gap(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@mutant("poisson_arrivals", "the gaps are returned, not their running sum")
def _arrivals_gaps_not_times(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(n - 1)]


@mutant("poisson_arrivals", "one arrival too many: the time after the last gap is appended too (n + 1 times)")
def _arrivals_one_too_many(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(seed)
    times, t = [0.0], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        times.append(t)
    return times


@mutant("poisson_arrivals", "the seed is ignored: the generator is seeded with a constant")
def _arrivals_seed_ignored(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(0)
    return _arrivals(n, lambda: rng.expovariate(rate))


@mutant("poisson_arrivals", "the global generator is reseeded (random.seed(seed)) and drawn from")
def _arrivals_global_generator(rate, n, seed=0):
    _check_arrival_args(rate, n)
    random.seed(seed)
    return _arrivals(n, lambda: random.expovariate(rate))


@mutant("poisson_arrivals", "uniform gaps of mean 1 / rate, not exponential ones")
def _arrivals_uniform_gaps(rate, n, seed=0):
    _check_arrival_args(rate, n)
    rng = random.Random(seed)
    return _arrivals(n, lambda: rng.uniform(0, 2 / rate))


# ---------------------------------------------------------------- goodput


def _check_goodput_args(ttfts, tpots, duration, slo_ttft, slo_tpot):
    if len(ttfts) != len(tpots):
        raise ValueError("one TTFT and one TPOT per request")
    if not duration > 0 or not slo_ttft > 0 or not slo_tpot > 0:
        raise ValueError("duration and SLOs must be > 0")


def _goodput(meets):
    def goodput(ttfts, tpots, duration, slo_ttft=1.0, slo_tpot=0.2):
        _check_goodput_args(ttfts, tpots, duration, slo_ttft, slo_tpot)
        return sum(1 for ttft, tpot in zip(ttfts, tpots) if meets(ttft, tpot, slo_ttft, slo_tpot)) / duration
    return goodput


mutant("goodput", "the SLO bounds are exclusive (< instead of <=)")(_goodput(
    lambda ttft, tpot, st, sp: ttft is not None and ttft < st and (tpot is None or tpot < sp)))
mutant("goodput", "a failed request (TTFT None) counts as meeting the SLO")(_goodput(
    lambda ttft, tpot, st, sp: (ttft is None or ttft <= st) and (tpot is None or tpot <= sp)))
mutant("goodput", "a one-token answer (TPOT None) never meets the SLO")(_goodput(
    lambda ttft, tpot, st, sp: ttft is not None and ttft <= st and tpot is not None and tpot <= sp))
mutant("goodput", "only the TTFT is checked: a slow stream (TPOT over its SLO) still counts")(_goodput(
    lambda ttft, tpot, st, sp: ttft is not None and ttft <= st))
mutant("goodput", "every finished request counts, however late (throughput, not goodput)")(_goodput(
    lambda ttft, tpot, st, sp: ttft is not None))


@mutant("goodput", "the fraction of requests within the SLO, not divided by the duration")
def _goodput_fraction(ttfts, tpots, duration, slo_ttft=1.0, slo_tpot=0.2):
    _check_goodput_args(ttfts, tpots, duration, slo_ttft, slo_tpot)
    good = sum(1 for ttft, tpot in zip(ttfts, tpots)
               if ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot))
    return good / len(ttfts) if ttfts else 0.0


@mutant("goodput", "lists of different lengths are not rejected (zip stops at the shorter)",
        same_in_engine="the library builds both lists from the same records, one TTFT and one TPOT per request")
def _goodput_lengths_unchecked(ttfts, tpots, duration, slo_ttft=1.0, slo_tpot=0.2):
    if not duration > 0 or not slo_ttft > 0 or not slo_tpot > 0:
        raise ValueError("duration and SLOs must be > 0")
    good = sum(1 for ttft, tpot in zip(ttfts, tpots)
               if ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot))
    return good / duration


# ---------------------------------------------------------------- next_token_budget


def _check_budget_args(target, min_budget, max_budget, decrease, increase, headroom):
    if not target > 0 or min_budget < 1 or min_budget > max_budget or not 0 < decrease < 1 \
            or not 0 < headroom <= 1 or increase < 0:
        raise ValueError("invalid controller settings")


def _budget(over, under, cut, grow, clamp=True):
    def next_token_budget(budget, itl_p95, target, min_budget, max_budget, decrease=0.5, increase=16, headroom=0.8):
        _check_budget_args(target, min_budget, max_budget, decrease, increase, headroom)
        if itl_p95 is not None and over(itl_p95, target):
            nxt = cut(budget, decrease, increase)
        elif under(itl_p95, target, headroom):
            nxt = grow(budget, increase)
        else:
            nxt = budget
        return max(min_budget, min(max_budget, nxt)) if clamp else nxt
    return next_token_budget


def _over(p95, target):
    return p95 > target


def _under(p95, target, headroom):
    return p95 is not None and p95 < headroom * target


def _halve(budget, decrease, increase):
    return math.floor(budget * decrease)


def _add(budget, increase):
    return budget + increase


mutant("next_token_budget", "a p95 exactly at the target counts as over it (>= instead of >)")(_budget(
    lambda p95, target: p95 >= target, _under, _halve, _add))
mutant("next_token_budget", "the cut rounds up (ceil(budget * decrease)), not down")(_budget(
    _over, _under, lambda budget, decrease, increase: math.ceil(budget * decrease), _add))
mutant("next_token_budget", "the cut subtracts increase (additive decrease), not multiply by decrease")(_budget(
    _over, _under, lambda budget, decrease, increase: budget - increase, _add))
mutant("next_token_budget", "no measurement (None) is taken as room to grow")(_budget(
    _over, lambda p95, target, headroom: p95 is None or p95 < headroom * target, _halve, _add))
mutant("next_token_budget", "the band's lower edge is headroom itself, not headroom * target")(_budget(
    _over, lambda p95, target, headroom: p95 is not None and p95 < headroom, _halve, _add))


@mutant("next_token_budget", "the result is not clamped to [min_budget, max_budget]")
def _budget_unclamped(budget, itl_p95, target, min_budget, max_budget, decrease=0.5, increase=16, headroom=0.8):
    return _budget(_over, _under, _halve, _add, clamp=False)(budget, itl_p95, target, min_budget, max_budget,
                                                            decrease, increase, headroom)
