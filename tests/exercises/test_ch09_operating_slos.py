"""Grades exercises/ch09_operating_slos.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python, numpy's percentile), never taken from minillm, so
the tests stay meaningful for the solutions. ``bootstrap_ci`` draws random resamples the
grader cannot know, so it is graded on what every correct percentile bootstrap does: the
difference exactly; the same seed, the same answer; an interval within the range of the
resampled differences; a 95% interval that covers the true difference of medians for at
least 51 of 60 synthetic data sets (the library's covers 59 of these fixed data sets with
any of the seeds tried: the margin is for other random draws); an interval that narrows
as the samples grow 16-fold; one above 0 for a clearly slower B. The last tests check the
grader itself (it fails deliberately wrong bootstraps); they run with MINILLM_IMPL=solutions
and are skipped when grading exercises/. The whole file runs in about a second. Every
failure is one line: what was checked, what was expected, what came back.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch09_operating_slos"
blocks_to_offload = adapters.function(CHAPTER, "blocks_to_offload")
slo_decision = adapters.function(CHAPTER, "slo_decision")
bootstrap_ci = adapters.function(CHAPTER, "bootstrap_ci")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


# ---------------------------------------------------------------- blocks_to_offload


def _offload_oracle(evictable, on_host, now, idle_s):
    out = []
    for b, freed_at in evictable:
        if now - freed_at < idle_s:
            break
        if b not in on_host:
            out.append(b)
    return out


def _check_offload(evictable, on_host, now, idle_s, note: str = "") -> None:
    __tracebackhide__ = True
    pool, host = list(evictable), set(on_host)
    shown = "{" + ", ".join(map(str, sorted(host))) + "}" if host else "set()"
    what = f"blocks_to_offload(evictable={pool}, on_host={shown}, now={now}, idle_s={idle_s}){note}"
    got = blocks_to_offload(pool, host, now, idle_s)
    adapters.expect_all(got, _offload_oracle(evictable, on_host, now, idle_s), what)
    adapters.expect((pool, host), (list(evictable), set(on_host)), f"{what}: (evictable, on_host) afterwards "
                                                                  f"(the inputs are not modified)")


def test_offload_example():
    """Contract: the idle blocks not in on_host, in the pool's (LRU) order."""
    _check_offload([(4, 5.0), (9, 7.5), (2, 8.0), (6, 9.5)], {9}, 10.0, 2.0,
                   " (9 is on the host already, 6 has waited 0.5 s only)")


def test_offload_idle_is_inclusive():
    """Contract: a block is idle when now - freed_at >= idle_s (inclusive)."""
    _check_offload([(1, 1.0), (2, 1.5), (3, 2.0)], set(), 3.5, 2.0,
                   " (block 2 has waited exactly idle_s: idle)")
    _check_offload([(1, 0.25), (2, 0.5)], set(), 0.5, 0.0, " (idle_s 0: every block is idle)")


def test_offload_nothing_to_copy():
    """Contract: nothing idle, or every idle block on the host already: an empty list."""
    _check_offload([], set(), 5.0, 1.0, " (an empty pool)")
    _check_offload([(3, 4.5), (7, 4.75)], set(), 5.0, 1.0, " (no block has waited idle_s)")
    _check_offload([(3, 1.0), (7, 2.0), (8, 9.0)], {3, 7}, 5.0, 1.0, " (the idle ones are all on the host)")


def test_offload_random():
    """Contract: the idle blocks not on the host, in LRU order; the inputs are not modified (random pools, smallest
    first)."""
    rng = random.Random(9)
    cases = []
    for _ in range(300):
        ids = rng.sample(range(64), rng.randint(0, 10))
        t, pool = 0.0, []
        for b in ids:  # freed in this order: freed_at does not decrease along the pool
            t += rng.choice([0.0, 0.25, 0.5, 1.0, 2.0])
            pool.append((b, t))
        host = {b for b in ids if rng.random() < 0.3}
        now = t + rng.choice([0.0, 0.5, 1.0, 3.0])
        cases.append((pool, host, now, rng.choice([0.0, 0.5, 1.0, 2.0, 4.0])))
    for pool, host, now, idle_s in sorted(cases, key=lambda c: len(c[0])):
        _check_offload(pool, host, now, idle_s)


# ---------------------------------------------------------------- slo_decision


def _slo_oracle(budget, ttft, itl, ttft_target, itl_target, *, min_budget, max_budget, decrease=0.5, increase=16,
                headroom=0.8):
    def clamp(x):
        return max(min_budget, min(max_budget, x))

    itl_on = itl is not None and itl_target is not None
    ttft_on = ttft is not None and ttft_target is not None
    itl_next = None
    if itl_on:
        if itl > itl_target:
            itl_next = clamp(math.floor(budget * decrease))
        elif itl < headroom * itl_target:
            itl_next = clamp(budget + increase)
        else:
            itl_next = clamp(budget)
        if itl > itl_target:
            return itl_next
    if ttft_on and ttft > ttft_target:
        nxt = math.ceil(budget / decrease) if itl_next is None or itl_next > budget else budget
    elif ttft_on and ttft >= headroom * ttft_target:
        nxt = budget
    elif itl_on:
        nxt = itl_next
    elif ttft_on:
        nxt = budget + increase
    else:
        nxt = budget
    return clamp(nxt)


def _check_slo(budget, ttft, itl, ttft_target, itl_target, note: str = "", **kw) -> None:
    __tracebackhide__ = True
    kw = {"min_budget": 16, "max_budget": 512, **kw}
    want = _slo_oracle(budget, ttft, itl, ttft_target, itl_target, **kw)
    opts = ", ".join(f"{k}={v}" for k, v in kw.items())
    what = (f"slo_decision(budget={budget}, ttft_p95={ttft}, itl_p95={itl}, ttft_target={ttft_target}, "
            f"itl_target={itl_target}, {opts}){note}")
    got = slo_decision(budget, ttft, itl, ttft_target, itl_target, **kw)
    adapters.expect_that(type(got) is int and got == want, what, f"{want} (an int)",
                         f"{got!r} ({type(got).__name__})")


@pytest.mark.parametrize("ttft, itl, why", [
    (1.0, 0.15, "case 1: the ITL over its target cuts"),
    (3.0, 0.15, "case 1: the ITL over its target cuts, whatever the TTFT"),
    (3.0, 0.05, "case 2: the TTFT over its target with ITL room gives budget back"),
    (3.0, 0.09, "case 2: the TTFT over its target, but the ITL is in its band: no room, hold"),
    (1.8, 0.05, "case 3: the TTFT in its band holds, though the ITL has room"),
    (1.0, 0.05, "case 4: both under headroom: grow by increase"),
    (1.0, 0.09, "case 4: the ITL in its band holds"),
    (1.0, None, "case 5: only the TTFT measured, under headroom: grow"),
    (3.0, None, "case 2: only the TTFT measured, over its target: give back"),
    (None, 0.05, "case 4: only the ITL measured"),
    (None, None, "case 6: nothing measured: hold"),
], ids=["itl-over", "both-over", "ttft-over-itl-room", "ttft-over-itl-band", "ttft-band", "both-under", "itl-band",
        "ttft-only-under", "ttft-only-over", "itl-only", "nothing"])
def test_slo_decision_examples(ttft, itl, why):
    """Contract: the first of the six cases that applies decides."""
    _check_slo(128, ttft, itl, 2.0, 0.1, f" ({why})")


def test_slo_decision_targets_switched_off():
    """Contract: a metric is watched when both its p95 and its target are given."""
    _check_slo(128, 3.0, 0.15, None, 0.1, " (no TTFT target: the ITL alone, chapter 7's rule)")
    _check_slo(128, 3.0, 0.05, None, 0.1, " (no TTFT target: a TTFT over 2 s means nothing)")
    _check_slo(128, 3.0, 0.15, 2.0, None, " (no ITL target: an ITL over 0.1 s means nothing; the TTFT gives back)")
    _check_slo(128, 1.9, 0.15, 2.0, None, " (no ITL target, the TTFT in its band: hold)")
    _check_slo(128, 0.5, 0.01, None, None, " (no target at all: hold)")


def test_slo_decision_band_edges():
    """Contract: over means p95 > target; the band is headroom * target <= p95 <= target (hysteresis: hold)."""
    # Targets and headroom whose products are exact in binary: 0.75 x 2.0 = 1.5, 0.75 x 0.5 = 0.375.
    kw = dict(headroom=0.75)
    _check_slo(64, 2.0, 0.25, 2.0, 0.5, " (TTFT exactly at its target: in the band, not over)", **kw)
    _check_slo(64, 1.5, 0.25, 2.0, 0.5, " (TTFT exactly headroom x target: in the band)", **kw)
    _check_slo(64, 1.0, 0.5, 2.0, 0.5, " (ITL exactly at its target: in the band, not over)", **kw)
    _check_slo(64, 1.0, 0.375, 2.0, 0.5, " (ITL exactly headroom x target: in the band, hold)", **kw)
    _check_slo(64, 3.0, 0.375, 2.0, 0.5, " (TTFT over, ITL exactly headroom x target: no room)", **kw)


def test_slo_decision_clamps_and_rounds():
    """Contract: a cut is floor(budget * decrease), a give-back ceil(budget / decrease); the result is clamped to
    [min_budget, max_budget], an int."""
    _check_slo(400, 3.0, 0.05, 2.0, 0.1, " (a give-back past max_budget stops at it)")
    _check_slo(24, 1.0, 0.15, 2.0, 0.1, " (a cut below min_budget stops at it)")
    _check_slo(510, 1.0, 0.05, 2.0, 0.1, " (growth past max_budget stops at it)")
    _check_slo(101, 1.0, 0.15, 2.0, 0.1, " (floor(101 x 0.5))")
    _check_slo(101, 3.0, 0.05, 2.0, 0.1, " (ceil(101 / 0.5))")
    _check_slo(100, 1.0, 0.15, 2.0, 0.1, " (floor(100 x 0.7))", decrease=0.7)
    _check_slo(100, 3.0, 0.05, 2.0, 0.1, " (ceil(100 / 0.7))", decrease=0.7)
    _check_slo(512, 3.0, 0.05, 2.0, 0.1, " (at max_budget already: nothing to give back)")


def test_slo_decision_room_is_chapter_7s_rule():
    """Contract: the ITL has room when itl_next > budget (chapter 7's rule would grow it)."""
    _check_slo(128, 3.0, 0.05, 2.0, 0.1, " (increase 0: chapter 7's rule would keep the budget, so the ITL has no "
                                         "room and the TTFT gives nothing back)", increase=0)
    _check_slo(128, 1.0, 0.05, 2.0, 0.1, " (increase 0: nothing grows)", increase=0)


def test_slo_decision_random():
    """Contract: the six cases in order, clamped, an int (random settings)."""
    rng = random.Random(7)
    for _ in range(3000):
        lo = rng.choice([1, 4, 16, 32])
        hi = rng.choice([lo, 64, 256, 2048])
        kw = dict(min_budget=lo, max_budget=hi, decrease=rng.choice([0.5, 0.25, 0.75, 0.9]),
                  increase=rng.choice([0, 1, 16, 64]), headroom=rng.choice([0.5, 0.8, 1.0]))
        _check_slo(rng.randint(lo, hi), rng.choice([None, 0.0, 0.5, 1.2, 1.6, 1.9, 2.0, 2.5, 9.0]),
                   rng.choice([None, 0.0, 0.02, 0.06, 0.09, 0.1, 0.11, 0.4]), rng.choice([None, 2.0, 2.0, 1.0]),
                   rng.choice([None, 0.1, 0.1, 0.05]), **kw)


# ---------------------------------------------------------------- bootstrap_ci


def _sample(rng: np.random.Generator, n: int, shift: float = 0.0) -> list[float]:
    return (rng.standard_normal(n) + shift).tolist()


def _ci(fn, a, b, q, n_boot=2000, seed=0, conf=0.95) -> tuple[float, float, float]:
    """(diff, low, high) of ``fn(a, b, q, n_boot, seed, conf)``, as floats; one line if the shape is wrong."""
    __tracebackhide__ = True
    what = f"bootstrap_ci({len(a)} values, {len(b)} values, q={q}, n_boot={n_boot}, seed={seed}, conf={conf})"
    got = fn(list(a), list(b), q, n_boot, seed, conf)
    try:
        diff, (low, high) = got
        diff, low, high = float(diff), float(low), float(high)
    except (TypeError, ValueError):
        pytest.fail(f"{what}: expected (diff, (low, high)), three numbers, got {adapters._short(got)}", pytrace=False)
    adapters.expect_that(math.isfinite(low) and math.isfinite(high) and low <= high, f"{what}: the interval",
                         "finite numbers with low <= high", f"({low!r}, {high!r})")
    return diff, low, high


@pytest.mark.parametrize("q", [0, 10, 37.5, 50, 95, 100])
def test_bootstrap_diff_is_the_difference_of_percentiles(q):
    """Contract: diff = np.percentile(b, q) - np.percentile(a, q) (linear interpolation)."""
    rng = np.random.default_rng(11)
    a, b = _sample(rng, 17), _sample(rng, 30, shift=0.4)
    want = float(np.percentile(b, q) - np.percentile(a, q))
    diff, _, _ = _ci(bootstrap_ci, a, b, q, n_boot=50)
    adapters.expect_approx(diff, want, f"the diff of bootstrap_ci(17 values, 30 values, q={q}): "
                                       f"np.percentile(b, q) - np.percentile(a, q), linear interpolation",
                           rel=1e-9, abs=1e-12)


def test_bootstrap_returns_floats():
    """Contract: returns (diff, (low, high)) as floats."""
    got = bootstrap_ci([1.0, 2.0, 4.0], [2.0, 3.0, 7.0], 50, 20, 0, 0.9)
    shape = type(got).__name__
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], tuple) and len(got[1]) == 2:
        shape = f"({type(got[0]).__name__}, ({type(got[1][0]).__name__}, {type(got[1][1]).__name__}))"
    adapters.expect(shape, "(float, (float, float))", "the type of bootstrap_ci([1, 2, 4], [2, 3, 7], 50, 20, 0, 0.9)")


def test_bootstrap_no_spread_gives_a_point():
    """Contract: the interval is taken from the n_boot resampled differences: no spread, a point."""
    adapters.expect(_ci(bootstrap_ci, [1.0] * 5, [1.0] * 5, 50), (0.0, 0.0, 0.0),
                    "(diff, low, high) of two identical constant samples (every resample is the same)")
    adapters.expect(_ci(bootstrap_ci, [1.5], [4.0], 95), (2.5, 2.5, 2.5),
                    "(diff, low, high) of a = [1.5], b = [4.0] (one value a side: every resample is the same)")
    d, low, high = _ci(bootstrap_ci, [0.5, 1.0, 2.0, 8.0], [3.0, 1.0, 0.25], 50, n_boot=1)
    adapters.expect_that(low == high, "the interval of bootstrap_ci(4 values, 3 values, q=50, n_boot=1)",
                         "low == high (one resampled difference)", f"({low!r}, {high!r})")


def test_bootstrap_is_seeded_and_leaves_the_global_generators_alone():
    """Contract: the same inputs and seed give the same answer, from a generator of your own
    (np.random.default_rng(seed)), never the global one."""
    rng = np.random.default_rng(3)
    a, b = _sample(rng, 40), _sample(rng, 40, shift=0.2)
    py_state, np_state = random.getstate(), np.random.get_state()
    first = _ci(bootstrap_ci, a, b, 90, n_boot=300, seed=5)
    adapters.expect_that(random.getstate() == py_state, "Python's global random state after bootstrap_ci",
                         "unchanged (draw from a generator of your own: np.random.default_rng(seed))",
                         "changed (random.seed or random.random was used)")
    same_np = all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                  for x, y in zip(np.random.get_state(), np_state))
    adapters.expect_that(same_np, "numpy's global random state after bootstrap_ci",
                         "unchanged (draw from a generator of your own: np.random.default_rng(seed))",
                         "changed (np.random.seed or np.random.* was used)")
    adapters.expect(_ci(bootstrap_ci, a, b, 90, n_boot=300, seed=5), first,
                    "(diff, low, high) of a second bootstrap_ci call, same data, seed=5 (same seed, same answer)")
    other = _ci(bootstrap_ci, a, b, 90, n_boot=300, seed=6)
    adapters.expect_that(other[1:] != first[1:], "the interval with seed=6 against seed=5 (same data)",
                         "another interval (the seed picks the resamples)", f"the same, {first[1:]}")


def test_bootstrap_interval_within_the_resampled_range():
    """Contract: the interval is made of resampled differences of percentiles: never outside [min(b) - max(a), max(b) -
    min(a)]."""
    rng = np.random.default_rng(4)
    for n_a, n_b, q in [(5, 8, 50), (12, 3, 95), (30, 30, 5), (2, 2, 50)]:
        a, b = _sample(rng, n_a), _sample(rng, n_b, shift=1.0)
        _, low, high = _ci(bootstrap_ci, a, b, q, n_boot=400)
        lo, hi = min(b) - max(a), max(b) - min(a)
        adapters.expect_that(lo - 1e-12 <= low and high <= hi + 1e-12,
                             f"the interval of bootstrap_ci({n_a} values, {n_b} values, q={q})",
                             f"within [{lo:.4f}, {hi:.4f}] (min(b) - max(a) .. max(b) - min(a): no resampled "
                             f"difference lies outside)", f"({low:.4f}, {high:.4f})")


def _check_coverage(fn) -> None:
    """60 data sets of 40 + 40 normal values, B's shifted by 0.5: the 95% interval of the
    difference of medians must cover 0.5 for at least 51 of them (85%)."""
    __tracebackhide__ = True
    rng = np.random.default_rng(2024)
    covered = 0
    for k in range(60):
        a, b = _sample(rng, 40), _sample(rng, 40, shift=0.5)
        _, low, high = _ci(fn, a, b, 50, n_boot=1000, seed=k)
        covered += low <= 0.5 <= high
    adapters.expect_that(covered >= 51, "data sets of 60 (40 + 40 normal values, true difference of medians 0.5) "
                                        "whose 95% interval of B - A at q=50 covers 0.5",
                         "at least 51 (a correct bootstrap covers 59)", str(covered))


def test_bootstrap_covers_the_true_difference():
    """Contract: resample a and b independently with replacement, each to its own size; the quantiles (1 - conf) / 2
    and 1 - (1 - conf) / 2 of the differences."""
    _check_coverage(bootstrap_ci)


def _check_narrowing(fn) -> None:
    __tracebackhide__ = True
    rng = np.random.default_rng(8)
    widths = {}
    for n in (25, 400):
        _, low, high = _ci(fn, _sample(rng, n), _sample(rng, n, shift=0.3), 50, n_boot=1000, seed=1)
        widths[n] = high - low
    adapters.expect_that(widths[400] < 0.5 * widths[25], "the width of the 95% interval (q=50) with 400 values a "
                                                         "side against 25",
                         f"under half of {widths[25]:.4f} (about a quarter: sqrt(16))", f"{widths[400]:.4f}")


def test_bootstrap_interval_narrows_as_samples_grow():
    """Contract: each side is resampled to its own size: more requests, a narrower interval."""
    _check_narrowing(bootstrap_ci)


def _check_conf(fn) -> None:
    __tracebackhide__ = True
    rng = np.random.default_rng(12)
    a, b = _sample(rng, 60), _sample(rng, 60)
    _, lo50, hi50 = _ci(fn, a, b, 50, n_boot=2000, seed=2, conf=0.5)
    _, lo99, hi99 = _ci(fn, a, b, 50, n_boot=2000, seed=2, conf=0.99)
    adapters.expect_that(hi99 - lo99 > 1.5 * (hi50 - lo50), "the width of the 99% interval against the 50% one "
                                                           "(same data, q=50)",
                         f"over 1.5 x {hi50 - lo50:.4f} (about 3.8 x for a bell curve: quantiles "
                         f"(1 - conf) / 2 and 1 - (1 - conf) / 2)", f"{hi99 - lo99:.4f}")


def test_bootstrap_conf_sets_the_width():
    """Contract: the interval is the (1 - conf) / 2 and 1 - (1 - conf) / 2 quantiles of the n_boot differences."""
    _check_conf(bootstrap_ci)


def test_bootstrap_sees_a_clear_shift():
    """Contract: an interval entirely above 0 for a clearly slower B, below for a clearly faster one."""
    rng = np.random.default_rng(5)
    a, b = _sample(rng, 50), _sample(rng, 50, shift=3.0)
    _, low, high = _ci(bootstrap_ci, a, b, 50, n_boot=1000)
    adapters.expect_that(low > 0, "the 95% interval of B - A at q=50, B's 50 values 3 standard deviations slower",
                         "entirely above 0", f"({low:.4f}, {high:.4f})")
    _, low, high = _ci(bootstrap_ci, b, a, 95, n_boot=1000)
    adapters.expect_that(high < 0, "the 95% interval of B - A at q=95, B's 50 values 3 standard deviations faster",
                         "entirely below 0", f"({low:.4f}, {high:.4f})")


def test_bootstrap_rejects_bad_input():
    """Contract: ValueError when a or b is empty, q is outside [0, 100], n_boot < 1, or conf is not in (0, 1)."""
    a, b = [1.0, 2.0, 3.0], [2.0, 2.5]
    cases = [(([], b, 50), "an empty a"), ((a, [], 50), "an empty b"), ((a, b, -1), "q=-1"),
             ((a, b, 100.5), "q=100.5"), ((a, b, 50, 0), "n_boot=0"), ((a, b, 50, 100, 0, 0.0), "conf=0"),
             ((a, b, 50, 100, 0, 1.0), "conf=1"), ((a, b, 50, 100, 0, 1.5), "conf=1.5")]
    for args, why in cases:
        adapters.expect_raises(ValueError, f"bootstrap_ci with {why}", bootstrap_ci, *args)


def test_bootstrap_leaves_its_inputs_alone():
    """Contract: a and b are not modified."""
    a, b = [3.0, 1.0, 2.0], [5.0, 4.0]
    bootstrap_ci(a, b, 50, 50, 0, 0.95)
    adapters.expect((a, b), ([3.0, 1.0, 2.0], [5.0, 4.0]), "(a, b) after bootstrap_ci (not sorted in place)")


# ---------------------------------------------------------------- the grader fails wrong bootstraps

_graded_against_solutions = pytest.mark.skipif(
    adapters.impl() != "solutions", reason="checks the grader itself, not your code (MINILLM_IMPL=solutions)")


def _no_interval(a, b, q, n_boot=2000, seed=0, conf=0.95):  # the diff as a point: no uncertainty
    d = float(np.percentile(b, q) - np.percentile(a, q))
    return d, (d, d)


def _pooled(a, b, q, n_boot=2000, seed=0, conf=0.95):  # resamples A and B from the pooled values: tests "no shift"
    rng = np.random.default_rng(seed)
    pool = np.asarray(list(a) + list(b))
    boot = (np.percentile(pool[rng.integers(0, len(pool), (n_boot, len(b)))], q, axis=1)
            - np.percentile(pool[rng.integers(0, len(pool), (n_boot, len(a)))], q, axis=1))
    d = float(np.percentile(b, q) - np.percentile(a, q))
    lo, hi = np.percentile(boot, [(1 - conf) / 2 * 100, (1 + conf) / 2 * 100])
    return d, (float(lo), float(hi))


def _conf_as_tails(a, b, q, n_boot=2000, seed=0, conf=0.95):  # quantiles conf / 2 and 1 - conf / 2: swapped
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    boot = (np.percentile(b[rng.integers(0, len(b), (n_boot, len(b)))], q, axis=1)
            - np.percentile(a[rng.integers(0, len(a), (n_boot, len(a)))], q, axis=1))
    lo, hi = sorted(np.percentile(boot, [conf / 2 * 100, (1 - conf / 2) * 100]))
    return float(np.percentile(b, q) - np.percentile(a, q)), (float(lo), float(hi))


@_graded_against_solutions
@pytest.mark.parametrize("wrong,check,expected", [
    (_no_interval, _check_coverage, "covers 0.5"),
    (_pooled, _check_coverage, "covers 0.5"),
    (_conf_as_tails, _check_coverage, "covers 0.5"),
    (_conf_as_tails, _check_conf, "the width of the 99% interval"),
], ids=["no-interval", "pooled-resampling", "conf-as-tails-coverage", "conf-as-tails-width"])
def test_the_grader_fails_a_wrong_bootstrap(wrong, check, expected):
    """Contract: (the grader itself) the coverage and width checks fail a bootstrap that breaks the interval's rule."""
    with pytest.raises(pytest.fail.Exception) as failed:
        check(wrong)
    assert expected in str(failed.value), str(failed.value)


# ---------------------------------------------------------------- quiz


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() returns a dict of this chapter's answers."""
    answers = quiz_answers()
    adapters.expect(type(answers).__name__, "dict", "the type quiz_answers() returns (a dict of answers)")
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:
        pytest.fail(f"question {why}", pytrace=False)
