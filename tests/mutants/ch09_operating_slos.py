"""Wrong answers to exercises/ch09_operating_slos.py, each a mistake the contract rules out."""
from __future__ import annotations

import math

import numpy as np

from mutants import mutant

# ---------------------------------------------------------------- blocks_to_offload


@mutant("blocks_to_offload", "a block that waited exactly idle_s is not idle yet (> instead of >=)")
def _offload_idle_exclusive(evictable, on_host, now, idle_s):
    out = []
    for b, freed_at in evictable:
        if not now - freed_at > idle_s:
            break
        if b not in on_host:
            out.append(b)
    return out


@mutant("blocks_to_offload", "blocks the host already holds are copied again")
def _offload_ignores_host(evictable, on_host, now, idle_s):
    out = []
    for b, freed_at in evictable:
        if now - freed_at < idle_s:
            break
        out.append(b)
    return out


@mutant("blocks_to_offload", "the scan stops at the first block the host holds (break instead of skipping it)")
def _offload_stops_at_host(evictable, on_host, now, idle_s):
    out = []
    for b, freed_at in evictable:
        if now - freed_at < idle_s or b in on_host:
            break
        out.append(b)
    return out


@mutant("blocks_to_offload", "the comparison is reversed: the blocks freed less than idle_s ago are copied")
def _offload_fresh_ones(evictable, on_host, now, idle_s):
    return [b for b, freed_at in evictable if now - freed_at < idle_s and b not in on_host]


@mutant("blocks_to_offload", "the idle blocks come sorted by block id (a set difference), not in the pool's LRU order")
def _offload_sorted_ids(evictable, on_host, now, idle_s):
    return sorted({b for b, freed_at in evictable if now - freed_at >= idle_s} - set(on_host))


@mutant("blocks_to_offload", "on_host is updated with the chosen blocks (the input is modified)",
        same_in_engine="BlockManager.offload_idle passes a copy of the host's set and reads the host tier itself")
def _offload_marks_host(evictable, on_host, now, idle_s):
    out = []
    for b, freed_at in evictable:
        if now - freed_at < idle_s:
            break
        if b not in on_host:
            out.append(b)
    on_host.update(out)
    return out


# ---------------------------------------------------------------- slo_decision


def _clamp(x, lo, hi):
    return max(lo, min(hi, x))


def _decision(give_back=lambda budget, decrease: math.ceil(budget / decrease), ttft_first=False, hysteresis=True,
              room_checked=True, none_is_under=False, clamp=True):
    """The contract's six cases, with one of them written wrong."""

    def slo_decision(budget, ttft_p95, itl_p95, ttft_target, itl_target, *, min_budget, max_budget, decrease=0.5,
                     increase=16, headroom=0.8):
        def bound(x):
            return _clamp(x, min_budget, max_budget) if clamp else x

        itl_on = itl_target is not None and (itl_p95 is not None or none_is_under)
        ttft_on = ttft_target is not None and (ttft_p95 is not None or none_is_under)
        itl = 0.0 if itl_p95 is None else itl_p95
        ttft = 0.0 if ttft_p95 is None else ttft_p95
        itl_next = None
        if itl_on:
            if itl > itl_target:
                itl_next = bound(math.floor(budget * decrease))
            elif itl < headroom * itl_target:
                itl_next = bound(budget + increase)
            else:
                itl_next = bound(budget)
        itl_over = itl_on and itl > itl_target
        ttft_over = ttft_on and ttft > ttft_target
        if itl_over and not (ttft_first and ttft_over):
            return itl_next
        if ttft_over:
            room = itl_next is None or itl_next > budget or not room_checked
            return bound(give_back(budget, decrease) if room else budget)
        if hysteresis and ttft_on and ttft >= headroom * ttft_target:
            return bound(budget)
        if itl_on:
            return itl_next
        if ttft_on:
            return bound(budget + increase)
        return bound(budget)

    return slo_decision


mutant("slo_decision", "the TTFT is looked at first: a TTFT over its target holds the budget although the ITL "
                       "is over its target")(_decision(ttft_first=True))
mutant("slo_decision", "the give-back doubles the budget whatever decrease is (budget * 2, not "
                       "ceil(budget / decrease))")(_decision(give_back=lambda budget, decrease: budget * 2))
mutant("slo_decision", "the give-back rounds down (int(budget / decrease)), not up")(
    _decision(give_back=lambda budget, decrease: int(budget / decrease)))
mutant("slo_decision", "no hysteresis: a TTFT between headroom x target and the target lets the budget "
                       "grow")(_decision(hysteresis=False))
mutant("slo_decision", "a TTFT over its target gives budget back without asking whether the ITL has "
                       "room")(_decision(room_checked=False))
mutant("slo_decision", "a metric with a target but no measurement (p95 None) counts as under "
                       "headroom")(_decision(none_is_under=True))
mutant("slo_decision", "the result is not clamped to [min_budget, max_budget]")(_decision(clamp=False))


# ---------------------------------------------------------------- bootstrap_ci


def _check_ci_args(a, b, q, n_boot, conf):
    if not len(a) or not len(b) or not 0 <= q <= 100 or n_boot < 1 or not 0 < conf < 1:
        raise ValueError("bad bootstrap arguments")


def _bootstrap(stat=lambda x, q, axis=None: np.percentile(x, q, axis=axis), sign=1.0, pooled=False,
               size=None, tails=None, rng_of=np.random.default_rng, point=False):
    """A percentile bootstrap with one of its parts written wrong."""

    def bootstrap_ci(a, b, q, n_boot=2000, seed=0, conf=0.95):
        _check_ci_args(a, b, q, n_boot, conf)
        a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
        diff = sign * float(stat(b, q) - stat(a, q))
        if point:
            return diff, (diff, diff)
        rng = rng_of(seed)
        src_a, src_b = (np.concatenate([a, b]),) * 2 if pooled else (a, b)
        size_a = len(a) if size is None else size(n_boot, len(a))
        size_b = len(b) if size is None else size(n_boot, len(b))
        boot_b = stat(src_b[rng.integers(0, len(src_b), size=(n_boot, size_b))], q, axis=1)
        boot_a = stat(src_a[rng.integers(0, len(src_a), size=(n_boot, size_a))], q, axis=1)
        boot = sign * (boot_b - boot_a)
        if tails == "minmax":
            return diff, (float(boot.min()), float(boot.max()))
        lo_q, hi_q = ((1 - conf) / 2 * 100, (1 + conf) / 2 * 100) if tails is None else \
            sorted((conf / 2 * 100, (1 - conf / 2) * 100))
        low, high = np.percentile(boot, [lo_q, hi_q])
        return diff, (float(low), float(high))

    return bootstrap_ci


class _GlobalGenerator:
    """np.random.seed(seed) and the global functions, dressed as a generator."""

    def __init__(self, seed):
        np.random.seed(seed)

    @staticmethod
    def integers(low, high, size):
        return np.random.randint(low, high, size=size)


mutant("bootstrap_ci", "the difference is A minus B, not B minus A")(_bootstrap(sign=-1.0))
mutant("bootstrap_ci", "no interval: the diff itself as a point, (diff, diff)")(_bootstrap(point=True))
mutant("bootstrap_ci", "A and B are both resampled from the pooled values")(_bootstrap(pooled=True))
mutant("bootstrap_ci", "conf taken as the tails: quantiles conf / 2 and 1 - conf / 2")(_bootstrap(tails="conf"))
mutant("bootstrap_ci", "conf ignored: the interval spans every resampled difference, min to max")(
    _bootstrap(tails="minmax"))
mutant("bootstrap_ci", "q read as a fraction: np.percentile(x, q / 100)")(
    _bootstrap(stat=lambda x, q, axis=None: np.percentile(x, q / 100, axis=axis)))
mutant("bootstrap_ci", "each resample draws n_boot values, not the side's own size")(
    _bootstrap(size=lambda n_boot, n: n_boot))
mutant("bootstrap_ci", "numpy's global generator is seeded (np.random.seed) and drawn from")(
    _bootstrap(rng_of=_GlobalGenerator))
