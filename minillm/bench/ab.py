"""A/B on one trace: is server B better than A, worse, or not measurably different?

    python -m minillm load --trace trace.jsonl --url http://127.0.0.1:8000 --url http://127.0.0.1:8001

Both servers are sent the same requests at the same arrival times (``loadgen.run_ab``);
this module turns the two sets of per-request records into a verdict per metric. Everything
here is a pure function of the records: no server, no clock.

The statistic is a percentile (TTFT p95, ITL p50...) of each side's per-request values,
and the question is whether B's minus A's could be zero. The *percentile bootstrap*
answers without assuming a distribution (latencies are skewed and heavy-tailed): draw each
side's requests again with replacement, independently (A's and B's requests are separate
samples), recompute the difference, and repeat ``n_boot`` times; the middle 95% of those
differences is the confidence interval. Entirely below 0 means B's latencies are lower:
"better"; entirely above: "worse"; straddling 0: "no difference" at 95%.

What one sample is:

* TTFT, TPOT, E2E: one value per finished request.
* ITL: every gap of every request, but the bootstrap draws *requests* and pools their gaps
  (a cluster bootstrap): a request's gaps share its batch and its neighbours, so drawing
  gaps one by one would pretend to far more independent evidence than there is.
* SLO attainment: per request, 1 if it finished with TTFT <= slo_ttft and TPOT <=
  slo_tpot, else 0 (the rule of ``loadgen.meets_slo``); the statistic is the mean. This is
  goodput's per-request side, and the one that can be bootstrapped.
* Throughput (requests/s, tokens/s) and goodput: *no interval*. In an open-loop replay both
  sides get the same requests at the same times, so a server that keeps up finishes at the
  trace's own rate whatever its latency; the sides differ only in when the last requests
  end: one number per replay, not a sample of requests to draw from. They are shown (mean
  over rounds) with their difference and the verdict "n/a"; the evidence about them is in
  E2E and SLO attainment.

Replays: one replay per side shows only the requests' own noise, not a machine that ran
one replay slower than the other (another job on its cores, a different batching of the
same arrivals), which the interval then mistakes for a difference between the servers.
With several replays per side (``--rounds``, in alternating order A B, B A, ... so that a
drift weighs on both), the bootstrap has two levels: each replicate draws a side's replays
with replacement, then each drawn replay's requests. Replays that disagree widen the
interval instead of producing a verdict. Two or three replays make a coarse outer level;
it errs on the side of "no difference".

Limits worth knowing: a p99 of 30 requests is nearly the maximum, and its interval is wide
and unreliable (the bootstrap of an extreme order statistic is); ask for p99 only with a
few hundred requests. A table of a dozen metrics at 95% each flags one by chance more
often than 5% of the time.
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np

from minillm import seams

VERDICTS = ("better", "worse", "no difference")
FEW_REQUESTS = 20  # format_ab_table warns below this many requests on a side


# -- the bootstrap ------------------------------------------------------------------------------

def _as_groups(values: Any, side: str, runs: Any = None) -> tuple[list[np.ndarray], bool, list[np.ndarray]]:
    """``values`` as one 1-D array per request, whether it came as groups, and the requests of
    each replay (index arrays into that list; one replay when ``runs`` is None).

    Flat numbers are groups of one; requests whose group is empty (one token: no ITL) drop out.
    """
    if isinstance(values, (str, bytes, dict)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{side} must be a sequence of numbers (or of lists of numbers, one per request), "
                         f"got {type(values).__name__}")
    items = list(values)
    labels = [0] * len(items) if runs is None else list(runs)
    if len(labels) != len(items):
        raise ValueError(f"runs_{side} must name the replay of each of {side}'s {len(items)} values, "
                         f"got {len(labels)} labels")
    grouped = any(isinstance(v, (Sequence, np.ndarray)) and not isinstance(v, (str, bytes)) for v in items)
    groups, members = [], {}
    for i, (v, label) in enumerate(zip(items, labels)):
        vs = list(v) if grouped and isinstance(v, (Sequence, np.ndarray)) else [v]
        for x in vs:
            if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(x):
                raise ValueError(f"{side}[{i}] holds {x!r}: every value must be a finite number")
        if vs:
            members.setdefault(label, []).append(len(groups))
            groups.append(np.asarray(vs, dtype=np.float64))
    if not groups:
        raise ValueError(f"{side} has no values: a side needs at least one request with a value")
    return groups, grouped, [np.asarray(m) for m in members.values()]


def _stat(x: np.ndarray, q: float | str, axis: int | None = None) -> Any:
    return np.mean(x, axis=axis) if q == "mean" else np.percentile(x, q, axis=axis)


def _replicates(groups: list[np.ndarray], grouped: bool, replays: list[np.ndarray], q: float | str, n_boot: int,
                rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` values of the statistic, each on the side drawn again with replacement:
    its requests; or, with several replays, its replays and then each drawn replay's requests."""
    n = len(groups)
    flat = np.concatenate(groups)
    if len(replays) == 1 and not grouped:  # one value per request: all replicates at once, an (n_boot, n) matrix
        return _stat(flat[rng.integers(0, n, size=(n_boot, n))], q, axis=1)
    sizes = np.array([len(g) for g in groups])
    out = np.empty(n_boot)
    for i in range(n_boot):
        counts = np.zeros(n, dtype=np.int64)  # how often each request is in this replicate
        for r in rng.integers(0, len(replays), len(replays)):
            counts += np.bincount(replays[r][rng.integers(0, len(replays[r]), len(replays[r]))], minlength=n)
        # A request drawn k times contributes all its values k times (ITLs: a cluster bootstrap).
        out[i] = _stat(np.repeat(flat, np.repeat(counts, sizes)), q)
    return out


def _check_q(q: Any) -> float | str:
    if q == "mean":
        return q
    if isinstance(q, bool) or not isinstance(q, numbers.Real) or not 0 <= q <= 100:
        raise ValueError(f"q must be a percentile in [0, 100] or 'mean', got {q!r}")
    return float(q)


def bootstrap_diff(a: Sequence, b: Sequence, q: float | str, n_boot: int = 2000, seed: int = 0,
                   conf: float = 0.95, *, runs_a: Sequence | None = None,
                   runs_b: Sequence | None = None) -> tuple[float, tuple[float, float]]:
    """B's q-th percentile minus A's, and its ``conf`` percentile-bootstrap interval.

    ``a``, ``b``: one number per request, or one list of numbers per request (ITLs: the
    requests are drawn, their values pooled). ``q``: 0..100, or ``"mean"``. Each side is
    drawn again with replacement, independently, ``n_boot`` times (numpy's generator seeded
    with ``seed``: same inputs and seed, same interval). ``runs_a``/``runs_b``: the replay
    each value came from (any labels); with two or more replays on a side, each replicate
    draws that side's replays with replacement, then each drawn replay's requests (a
    two-level bootstrap), so the interval also holds how much replays differ from one
    another. Returns ``(diff, (low, high))``.

    A plugged ``bootstrap_ci`` (chapter 9's exercise) answers, once the inputs are checked
    here, for one number per request and one replay a side with a percentile ``q``; its
    answer is checked (the difference of the two percentiles, and a finite interval within
    the range of the resampled differences).
    """
    q = _check_q(q)
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise ValueError(f"n_boot must be an integer >= 1, got {n_boot!r}")
    if isinstance(conf, bool) or not isinstance(conf, numbers.Real) or not 0 < conf < 1:
        raise ValueError(f"conf must be a confidence level in (0, 1), e.g. 0.95; got {conf!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    ga, grouped_a, replays_a = _as_groups(a, "a", runs_a)
    gb, grouped_b, replays_b = _as_groups(b, "b", runs_b)
    mine = seams.plugged("bootstrap_ci")  # a learner's bootstrap (chapter 9), when plugged in
    if mine is not None and q != "mean" and not (grouped_a or grouped_b) and len(replays_a) == len(replays_b) == 1:
        # One number per request, one replay a side: the one-level percentile bootstrap it implements.
        # (Lists of values per request, several replays, and the mean stay the library's.)
        flat_a, flat_b = [float(g[0]) for g in ga], [float(g[0]) for g in gb]
        return _checked_ci(mine(flat_a, flat_b, q, n_boot, seed, conf), flat_a, flat_b, q)
    diff = float(_stat(np.concatenate(gb), q) - _stat(np.concatenate(ga), q))
    rng = np.random.default_rng(seed)
    boot = (_replicates(gb, grouped_b, replays_b, q, n_boot, rng)
            - _replicates(ga, grouped_a, replays_a, q, n_boot, rng))
    tail = (1 - conf) / 2 * 100
    low, high = np.percentile(boot, [tail, 100 - tail])
    return diff, (float(low), float(high))


def _checked_ci(got: Any, a: list[float], b: list[float], q: float) -> tuple[float, tuple[float, float]]:
    """What a plugged ``bootstrap_ci`` returned, as floats; ``seams.SeamContractError`` if a verdict cannot be
    read from it: the diff np.percentile(b, q) - np.percentile(a, q), a finite interval with low <= high,
    within the range every resampled difference lies in."""
    at = f"for {len(a)} and {len(b)} values, q={q:g},"

    def broken(invariant: str, what: str) -> seams.SeamContractError:
        return seams.SeamContractError("bootstrap_ci", invariant, f"{at} it returned {what}")

    try:
        diff, (low, high) = got
        diff, low, high = (float(x) for x in (diff, low, high))
    except (TypeError, ValueError):
        raise broken("return (diff, (low, high)), three numbers", repr(got)) from None
    if not all(math.isfinite(x) for x in (diff, low, high)) or low > high:
        raise broken("the interval must be finite with low <= high", repr(got))
    span = max(b) - min(a), min(b) - max(a)  # no replicate's difference lies outside [min(b) - max(a), max(b) - min(a)]
    slack = 1e-9 * max(1.0, abs(span[0]), abs(span[1]))
    if low < span[1] - slack or high > span[0] + slack:
        raise broken(f"the interval lies within [{span[1]!r}, {span[0]!r}], where every resampled difference lies "
                     f"(take percentiles of the resampled differences)", f"the interval ({low!r}, {high!r})")
    want = float(np.percentile(b, q) - np.percentile(a, q))
    if abs(diff - want) > 1e-9 * max(1.0, abs(want)):
        raise broken("the diff is np.percentile(b, q) - np.percentile(a, q) (B minus A, linear interpolation)",
                     f"diff {diff!r}, not {want!r}")
    return diff, (low, high)


def verdict(ci: Sequence[float], lower_is_better: bool = True) -> str:
    """B against A from the interval of B - A: "better", "worse" or "no difference".

    An interval entirely below 0 means B's values are lower: "better" for a latency
    (``lower_is_better``), "worse" for a rate. One that holds 0 (a bound on 0 included) is
    "no difference".
    """
    try:
        low, high = (float(x) for x in ci)
    except (TypeError, ValueError):
        raise ValueError(f"ci must be a pair (low, high) of numbers, got {ci!r}") from None
    if not (math.isfinite(low) and math.isfinite(high)) or low > high:
        raise ValueError(f"ci must be a finite interval with low <= high, got {ci!r}")
    if high < 0:
        return "better" if lower_is_better else "worse"
    if low > 0:
        return "worse" if lower_is_better else "better"
    return "no difference"


# -- comparing two load runs --------------------------------------------------------------------

# (row name, series, statistic, unit). Latencies: lower is better; SLO attainment: higher.
METRICS: list[tuple[str, str, float | str, str]] = [
    ("TTFT p50", "ttft", 50, "s"), ("TTFT p95", "ttft", 95, "s"), ("TTFT p99", "ttft", 99, "s"),
    ("TPOT p50", "tpot", 50, "s"), ("TPOT p95", "tpot", 95, "s"),
    ("ITL p50", "itl", 50, "s"), ("ITL p95", "itl", 95, "s"),
    ("E2E p50", "e2e", 50, "s"), ("E2E p95", "e2e", 95, "s"),
    ("SLO attainment", "slo", "mean", "fraction"),
]
# One number per replay (see the module docstring): no interval.
RATES: list[tuple[str, str, str]] = [("throughput", "throughput_req_s", "req/s"),
                                     ("tokens/s", "throughput_tok_s", "tok/s"), ("goodput", "goodput", "req/s")]


@dataclass(slots=True)
class ABRow:
    """One metric of an A/B: each side's value, B - A, its interval (None for a rate) and the verdict."""

    metric: str
    unit: str
    a: float | None
    b: float | None
    diff: float | None
    ci_low: float | None
    ci_high: float | None
    verdict: str  # better | worse | no difference | n/a (no interval: a rate, or a side without values)
    lower_is_better: bool
    n_a: int  # requests that gave this metric a value
    n_b: int


def _runs(result: Any) -> list[Any]:
    """A load result (``records``, ``summary()``) or a list of them (the rounds of one side)."""
    runs = list(result) if isinstance(result, (list, tuple)) else [result]
    if not runs or not all(hasattr(r, "records") and hasattr(r, "summary") for r in runs):
        raise ValueError("compare() takes load results (minillm.bench.loadgen.LoadResult), or a list of them "
                         "per side (its rounds)")
    return runs


def _series(runs: list[Any], name: str, slo_ttft: float, slo_tpot: float) -> tuple[list, list[int]]:
    """One side's values of series ``name``, one per request, and the replay each came from."""
    values, labels = [], []
    for k, run in enumerate(runs):
        for r in run.records:
            if name == "slo":  # every request counts, failed ones as misses
                v: Any = float(r["ok"] and r["ttft"] is not None and r["ttft"] <= slo_ttft
                               and (r["tpot"] is None or r["tpot"] <= slo_tpot))
            elif not r["ok"] or (name != "itl" and r[name] is None):
                continue
            else:
                v = list(r["itls"]) if name == "itl" else r[name]
            values.append(v)
            labels.append(k)
    return values, labels


def compare(result_a: Any, result_b: Any, *, n_boot: int = 2000, seed: int = 0, conf: float = 0.95,
            slo_ttft: float | None = None, slo_tpot: float | None = None) -> list[ABRow]:
    """Every metric of ``METRICS`` (bootstrapped) and ``RATES`` (point values), B against A.

    ``result_a``/``result_b``: a ``LoadResult`` or the list of one side's rounds (their
    requests pooled for the values; with two or more, the bootstrap draws the rounds too:
    ``bootstrap_diff``'s two levels). SLOs: A's own (``slo_ttft``/``slo_tpot`` override).
    Metric k is bootstrapped with the seed ``(seed, k)``: reproducible, and independent of
    the others.
    """
    runs_a, runs_b = _runs(result_a), _runs(result_b)
    slo_ttft = runs_a[0].slo_ttft if slo_ttft is None else slo_ttft
    slo_tpot = runs_a[0].slo_tpot if slo_tpot is None else slo_tpot
    rows = []
    for k, (metric, series, q, unit) in enumerate(METRICS):
        lower = series != "slo"
        (xa, la), (xb, lb) = _series(runs_a, series, slo_ttft, slo_tpot), _series(runs_b, series, slo_ttft, slo_tpot)
        na, nb = (sum(1 for g in x if g) if series == "itl" else len(x) for x in (xa, xb))
        if na == 0 or nb == 0:  # e.g. TPOT of one-token requests: nothing to compare
            va = float(_stat(np.concatenate([np.ravel(g) for g in xa]), q)) if na else None
            vb = float(_stat(np.concatenate([np.ravel(g) for g in xb]), q)) if nb else None
            rows.append(ABRow(metric, unit, va, vb, None, None, None, "n/a", lower, na, nb))
            continue
        metric_seed = int(np.random.SeedSequence([seed, k]).generate_state(1)[0])
        diff, (low, high) = bootstrap_diff(xa, xb, q, n_boot, metric_seed, conf, runs_a=la, runs_b=lb)
        va, vb = (float(_stat(np.concatenate([np.ravel(g) for g in x]), q)) for x in (xa, xb))
        rows.append(ABRow(metric, unit, va, vb, diff, low, high, verdict((low, high), lower), lower, na, nb))
    for metric, key, unit in RATES:
        va = _mean(run.summary()[key] for run in runs_a)
        vb = _mean(run.summary()[key] for run in runs_b)
        rows.append(ABRow(metric, unit, va, vb, None if va is None or vb is None else vb - va, None, None, "n/a",
                          False, sum(len(r.records) for r in runs_a), sum(len(r.records) for r in runs_b)))
    return rows


def _mean(values: Any) -> float | None:
    xs = [v for v in values if v is not None]
    return sum(xs) / len(xs) if xs else None


# -- reporting ------------------------------------------------------------------------------------

def _fmt(v: float | None, unit: str, signed: bool = False) -> str:
    if v is None:
        return "-"
    sign = "+" if signed else ""
    if unit == "s":  # latencies read best in milliseconds
        return f"{v * 1000:{sign}.1f}"
    if unit == "fraction":
        return f"{v * 100:{sign}.1f}%"
    return f"{v:{sign}.2f}"


def format_ab_table(rows: Sequence[ABRow], label_a: str = "A", label_b: str = "B", conf: float = 0.95) -> str:
    """One row per metric: A, B, B - A (and as % of A), the interval, the verdict (B against A)."""
    pct = f"{conf:.0%} CI"
    heads = ["metric", label_a, label_b, "B-A", "B-A %", pct, "verdict"]
    body = []
    for r in rows:
        rel = "-" if r.diff is None or not r.a else f"{r.diff / abs(r.a):+.0%}"
        ci = "-" if r.ci_low is None else f"[{_fmt(r.ci_low, r.unit, True)}, {_fmt(r.ci_high, r.unit, True)}]"
        unit = {"s": " (ms)", "fraction": ""}.get(r.unit, f" ({r.unit})")
        body.append([r.metric + unit, _fmt(r.a, r.unit), _fmt(r.b, r.unit), _fmt(r.diff, r.unit, True), rel, ci,
                     r.verdict])
    widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(heads)]
    align = lambda cells: "  ".join(c.ljust(w) if i in (0, 6) else c.rjust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(cells, widths)))
    line = align(heads)
    out = [line, "-" * len(line)] + [align(row) for row in body]
    out.append(f"B against A: 'better'/'worse' when the {pct} (percentile bootstrap over requests) of B - A "
               "excludes 0; rates have one value per replay, no interval (n/a)")
    few = min((min(r.n_a, r.n_b) for r in rows if r.ci_low is not None), default=FEW_REQUESTS)
    if few < FEW_REQUESTS:
        out.append(f"only {few} requests on a side: a bootstrap of so few values is rough, and a verdict may be "
                   "chance; replay more requests")
    return "\n".join(out)


def ab_to_json(rows: Sequence[ABRow], **about: Any) -> dict[str, Any]:
    """The A/B as JSON: ``about`` (urls, rounds, n_boot, seed...) and one object per metric."""
    return {**about, "rows": [asdict(r) for r in rows]}


def format_ab_json(rows: Sequence[ABRow], **about: Any) -> str:
    return json.dumps(ab_to_json(rows, **about), indent=1)


__all__ = ["bootstrap_diff", "verdict", "compare", "format_ab_table", "ab_to_json", "format_ab_json", "ABRow",
           "METRICS", "RATES", "VERDICTS"]
