"""Chapter 7's edges: what the open-loop runner and the SLO controllers decide with the learner's
arrivals, goodput and token-budget rule.

These seams measure and steer rather than schedule, so each case drives the library code that
calls them: the sweep's arrival offsets (``bench.sweep.arrival_offsets``), the goodput of the
load generator and of the sweep (``loadgen.goodput``, ``LoadResult.summary``,
``sweep.summarize_requests`` on a simulated run), and the token budget of the engine's SLO
controller (``slo.SloController``) and of ``run_open_loop``'s controller, replayed on recorded
windows of p95 ITLs so the clock plays no part.

Random arrivals cannot be compared draw for draw (a correct generator need not draw what the
library draws), so their case compares what every correct Poisson generator gives: the count,
the first arrival, the order, the seed's effect, the global generator left alone, and the gap
statistics of 20000 gaps within six standard errors.
"""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any, Sequence

from . import EdgeCase

# -- arrivals ---------------------------------------------------------------------------------


def arrival_properties(rate: float = 4.0, n: int = 20001, seed: int = 5) -> dict[str, Any]:
    """What the sweep's arrival offsets must show for any correct Poisson generator."""
    from minillm.bench.sweep import arrival_offsets

    state = random.getstate()
    times = arrival_offsets(rate, n, seed)
    untouched = random.getstate() == state
    gaps = [b - a for a, b in zip(times, times[1:])]
    m = len(gaps)
    mean = sum(gaps) / m
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (m - 1))
    short = sum(g < math.log(2) / rate for g in gaps) / m
    return {
        "one request arrives at 0": arrival_offsets(rate, 1, seed) == [0.0],
        "count, first arrival": (len(times), times[0]),
        "never going back": all(b >= a for a, b in zip(times, times[1:])),
        f"mean gap within 6 standard errors of 1 / rate = {1 / rate:g} s":
            abs(mean - 1 / rate) < 6 / rate / math.sqrt(m),
        "gap sd / mean within 6 standard errors of 1 (exponential)": abs(sd / mean - 1) < 6 * math.sqrt(2 / m),
        "half the gaps under ln(2) / rate (the exponential's median)": abs(short - 0.5) < 3 / math.sqrt(m),
        "the same seed, the same arrivals": arrival_offsets(rate, n, seed) == times,
        "another seed, other arrivals": arrival_offsets(rate, 50, seed + 1) != times[:50],
        "Python's global random state left alone": untouched,
    }


# -- goodput ----------------------------------------------------------------------------------


def _rounded(goodput: float) -> float:
    """To 9 decimals: a correct count divided another way (``count * (1 / duration)``) may differ in the last bit."""
    return round(goodput, 9)


def _record(ok: bool, ttft: float | None, tpot: float | None, arrival: float, e2e: float | None,
            status: int = 200) -> dict[str, Any]:
    return {"ok": ok, "ttft": ttft, "tpot": tpot, "arrival": arrival, "lag": 0.0, "e2e": e2e, "itls": [],
            "output_tokens": 4 if ok else 0, "status": status}


# Within both SLOs; TTFT exactly at 1.0 s; TPOT exactly at 0.25 s (both exact in binary, like the
# SLOs below); late; slow; a one-token answer; a one-token answer that is late; failed; rejected.
RECORDS = [_record(True, 0.25, 0.0625, 0.0, 1.0), _record(True, 1.0, 0.125, 0.25, 2.0),
           _record(True, 0.5, 0.25, 0.5, 1.5), _record(True, 1.5, 0.0625, 0.75, 2.5),
           _record(True, 0.375, 0.5, 1.0, 3.0), _record(True, 0.125, None, 1.25, 0.125),
           _record(True, 1.25, None, 1.5, 1.25), _record(False, None, None, 1.75, None),
           _record(False, None, None, 2.0, None, 429)]
SLOS = [(1.0, 0.25), (2.0, 1.0), (0.25, 0.0625), (0.125, 0.125)]


def goodput_of_records() -> dict[str, Any]:
    """The load generator's goodput of ``RECORDS`` at several SLOs, and its run summary's."""
    from minillm.bench import loadgen

    span = loadgen._span(RECORDS)
    out: dict[str, Any] = {f"goodput at TTFT <= {st} s, TPOT <= {sp} s": _rounded(loadgen.goodput(RECORDS, st, sp))
                           for st, sp in SLOS}
    out["goodput over 8 s"] = _rounded(loadgen.goodput(RECORDS, 1.0, 0.25, 8.0))
    summary = loadgen.LoadResult("http://unused", 1.0, RECORDS, span, slo_ttft=1.0, slo_tpot=0.25).summary()
    out["the run summary's goodput"] = _rounded(summary["goodput"])
    return out


def goodput_of_a_simulated_run() -> dict[str, Any]:
    """The sweep's numbers of one simulated run (continuous engine, virtual clock), at SLOs that
    split its requests: some in time, some late, one with a single token."""
    from minillm.bench.cost_model import simulate
    from minillm.bench.sweep import summarize_requests
    from minillm.bench.workload import workload_from_lengths

    run = simulate(workload_from_lengths([12, 40, 8, 30, 20, 16], [6, 1, 9, 4, 7, 3],
                                         arrival_times=[0.0, 0.05, 0.1, 0.3, 0.35, 0.6]), "continuous", 2)
    requests = [SimpleNamespace(metrics=m, output_token_ids=tokens) for m, tokens in
                zip(run.metrics, run.output_token_ids)]
    ttfts = sorted(m.ttft for m in run.metrics)
    tpots = sorted(m.tpot for m in run.metrics if m.tpot is not None)
    # SLOs at a measured TTFT and TPOT exactly: the bound is inclusive.
    out = {}
    for slo_ttft, slo_tpot in [(ttfts[2], tpots[2]), (ttfts[4], tpots[0]), (ttfts[-1], tpots[-1])]:
        summary = summarize_requests(requests, 0.0, 0.0, slo_ttft, slo_tpot)
        out[f"goodput at TTFT <= {slo_ttft:.4g} s, TPOT <= {slo_tpot:.4g} s"] = _rounded(summary["goodput"])
    return out


# -- the token budget -------------------------------------------------------------------------


def replay_controller(config: dict, windows: Sequence[tuple[float | None, float | None]], start_budget: int,
                      max_num_seqs: int = 4) -> dict[str, Any]:
    """The engine's SLO controller (``slo.SloController.decide``, its ``itl_break`` memory included)
    deciding once per recorded window of (p95 TTFT, p95 ITL). Its budgets and events."""
    from minillm.slo import SloController

    class Replay(SloController):
        def window_p95(self, now: float) -> tuple[float | None, float | None]:
            return windows[int(now)]

    scheduler = SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=start_budget, waiting=[], running=[])
    controller = Replay(config, scheduler, engine="paged")
    budgets = []
    for i in range(len(windows)):
        controller.decide(float(i))
        budgets.append(scheduler.max_num_batched_tokens)
    return {"budgets": budgets,
            "events": [(e.old_budget, e.new_budget, e.reason) for e in controller.events]}


# The ITL target 0.25 s and headroom 0.75 make the band [0.1875, 0.25], exact in binary.
ITL_ONLY = dict(itl_p95=0.25, window_s=1.0, min_budget=8, max_budget=200, decrease=0.5, increase=16,
                headroom=0.75)
# Over (101 -> floor 50), exactly at the target, exactly at the band's lower edge, under, no
# measurement, cuts down to the floor and one past it, then growth up to the ceiling and past it.
ITL_WINDOWS = ([(None, 0.3), (None, 0.25), (None, 0.1875), (None, 0.1), (None, None)] + [(None, 0.3)] * 4
               + [(None, 0.01)] * 14)


def run_open_loop_controls(target: float = 0.25, min_budget: int = 8, max_budget: int = 200,
                           start: int = 101) -> list[int]:
    """``run_open_loop(..., slo_itl=target)``'s controller (``sweep.slo_token_budget``) fed a recorded
    sequence of interval p95s, None where an interval had no token gap; the budgets it sets."""
    from minillm.bench.sweep import slo_token_budget

    budget, budgets = start, []
    for p95 in [None, 0.3, None, 0.25, 0.1875, 0.05, 0.3, 0.3, 0.3, 0.3, 0.3, None, 0.01, 0.2, 0.26]:
        budget = slo_token_budget(budget, p95, target, min_budget=min_budget, max_budget=max_budget)
        budgets.append(budget)
    return budgets


CASES = [
    EdgeCase("20001 arrivals: the count, arrival 0 first, the order, the seed, the gap statistics",
             ("poisson_arrivals",), arrival_properties),
    EdgeCase("goodput of recorded requests: bounds met exactly, one-token answers, failed and rejected ones",
             ("goodput",), goodput_of_records),
    EdgeCase("goodput of a simulated run, SLOs set to measured latencies",
             ("goodput",), goodput_of_a_simulated_run),
    EdgeCase("the engine's SLO controller: a cut of an odd budget, the band's edges, the floor and the ceiling",
             ("next_token_budget",), lambda: replay_controller(ITL_ONLY, ITL_WINDOWS, 101)),
    EdgeCase("run_open_loop's controller: intervals without a token gap, the band's edges, the floor",
             ("next_token_budget",), run_open_loop_controls),
]
