"""Chapter 7's seams: arrivals, goodput and the token-budget controller plugged into the
load generator and the open-loop runner.

With the reference answers plugged, every number is the library's: the same arrival times,
the same goodput, the same controller decisions on the same inputs. Each plugged function
is called by the library's own code paths (``run_open_loop`` on a tiny random Llama with the
SLO controller on). Wrong functions are caught: a shape the engine cannot use is a
ValueError naming the seam; a wrong rule that fits the shape changes the numbers.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from minillm import seams
from minillm.bench import loadgen
from minillm.bench import sweep as ls
from test_spec_engine import tiny_engine, tiny_prompts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch07_serving_online as s07  # noqa: E402

SOLUTIONS = dict(poisson_arrivals=s07.poisson_arrivals, goodput=s07.goodput, next_token_budget=s07.next_token_budget)


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def spy(fn, calls: list):
    """``fn``, recording each call's arguments in ``calls``."""
    def call(*args):
        calls.append(args)
        return fn(*args)

    return call


def records():
    """Load-generator records: within the SLO, late, slow, one token, failed, rejected."""
    def rec(ok, ttft, tpot, arrival, e2e, status=200):
        return {"ok": ok, "ttft": ttft, "tpot": tpot, "arrival": arrival, "lag": 0.0, "e2e": e2e, "itls": [],
                "output_tokens": 4 if ok else 0, "status": status}

    return [rec(True, 0.3, 0.05, 0.0, 1.0), rec(True, 1.5, 0.05, 0.2, 2.0), rec(True, 0.4, 0.5, 0.5, 2.5),
            rec(True, 0.2, None, 0.9, 0.3), rec(False, None, None, 1.1, None), rec(False, None, None, 1.3, None, 429),
            rec(True, 1.0, 0.2, 1.4, 1.6)]


# ------------------------------------------------------------------ the reference answers plugged


@pytest.mark.parametrize("rate, n, seed", [(1.0, 1, 0), (2.5, 17, 3), (0.3, 40, 11)])
def test_plugged_arrivals_are_the_library_arrivals(rate, n, seed):
    want = loadgen.poisson_arrivals(rate, n, seed)
    calls = []
    with seams.plug(poisson_arrivals=spy(s07.poisson_arrivals, calls)):
        assert loadgen.poisson_arrivals(rate, n, seed) == want
        assert ls.arrival_offsets(rate, n, seed) == want
    assert calls == [(rate, n, seed)] * 2
    assert ls.arrival_offsets(rate, n, seed) == want, "unplugged again after the block"


def test_the_http_load_generator_takes_its_arrivals_from_the_seam(monkeypatch):
    sent = {}

    async def fake_run(url, requests, arrivals, **kw):  # stands in for the HTTP run: keeps what it was given
        sent["arrivals"] = arrivals
        return loadgen.LoadResult(url, kw["rate"], [], 0.0)

    monkeypatch.setattr(loadgen, "run_load_async", fake_run)
    loadgen.run_load("http://unused", rate=3.0, num_requests=9, seed=4)
    want = sent.pop("arrivals")
    calls = []
    with seams.plug(poisson_arrivals=spy(s07.poisson_arrivals, calls)):
        loadgen.run_load("http://unused", rate=3.0, num_requests=9, seed=4)
    assert calls == [(3.0, 9, 4)] and sent["arrivals"] == want == loadgen.poisson_arrivals(3.0, 9, 4)


def test_plugged_goodput_is_the_library_goodput():
    recs = records()
    result = loadgen.LoadResult("http://unused", 1.0, recs, loadgen._span(recs), slo_ttft=1.0, slo_tpot=0.2)
    want = [loadgen.goodput(recs, 1.0, 0.2), loadgen.goodput(recs, 1.0, 0.2, 8.0), loadgen.goodput(recs, 2.0, 1.0),
            result.summary()["goodput"]]
    assert want[0] == pytest.approx(3 / loadgen._span(recs)), "the first, the fourth (one token) and the last"
    calls = []
    with seams.plug(goodput=spy(s07.goodput, calls)):
        got = [loadgen.goodput(recs, 1.0, 0.2), loadgen.goodput(recs, 1.0, 0.2, 8.0), loadgen.goodput(recs, 2.0, 1.0),
               result.summary()["goodput"]]
    assert got == want
    assert len(calls) == 4
    ttfts, tpots, duration, slo_ttft, slo_tpot = calls[0]
    assert ttfts == [0.3, 1.5, 0.4, 0.2, None, None, 1.0] and tpots == [0.05, 0.05, 0.5, None, None, None, 0.2]
    assert (duration, slo_ttft, slo_tpot) == (loadgen._span(recs), 1.0, 0.2)


def test_goodput_is_not_asked_where_its_contract_rejects_the_input():
    calls = []
    with seams.plug(goodput=spy(s07.goodput, calls)):
        assert loadgen.goodput([], 1.0, 0.2) == 0.0  # no records: no duration
        assert loadgen.goodput(records(), 1.0, 0.2, 0.0) == 0.0
    assert calls == []


@pytest.mark.parametrize("target", [0.05, 0.2])
def test_plugged_controller_makes_the_library_decisions(target):
    grid = [(b, p95, lo, hi, d, inc, h) for b in (1, 7, 64, 256, 600) for p95 in (None, 0.0, 0.01, 0.04, 0.05, 0.19,
                                                                                  0.2, 0.35, 2.0)
            for lo, hi in ((1, 1000), (8, 512), (64, 64)) for d, inc, h in ((0.5, 16, 0.8), (0.9, 0, 1.0))]
    want = [ls.slo_token_budget(b, p95, target, min_budget=lo, max_budget=hi, decrease=d, increase=inc, headroom=h)
            for b, p95, lo, hi, d, inc, h in grid]
    calls = []
    with seams.plug(next_token_budget=spy(s07.next_token_budget, calls)):
        got = [ls.slo_token_budget(b, p95, target, min_budget=lo, max_budget=hi, decrease=d, increase=inc, headroom=h)
               for b, p95, lo, hi, d, inc, h in grid]
    assert got == want and len(calls) == len(grid)
    assert calls[0] == (1, None, target, 1, 1000, 0.5, 16, 0.8), "the exercise's argument order"


def test_run_open_loop_runs_all_three_seams_and_matches_the_library():
    eng = tiny_engine(enable_chunked_prefill=True, max_num_batched_tokens=32)
    prompts = tiny_prompts(4)
    calls = {name: [] for name in SOLUTIONS}
    with seams.plug(**{name: spy(fn, calls[name]) for name, fn in SOLUTIONS.items()}):
        summary, reqs = ls.run_open_loop(eng, prompts, 400.0, 8, 10, seed=2, slo_ttft=60.0, slo_tpot=60.0,
                                         control_every=0.0, slo_itl=1e-6, min_budget=4)
    assert all(calls.values()), {k: len(v) for k, v in calls.items()}
    assert summary["num_ok"] == 8 and not eng.has_unfinished()
    # What is deterministic, recomputed by the library (nothing plugged) on the same run:
    start = reqs[0].arrival_time
    assert [r.arrival_time for r in reqs] == [start + t for t in ls.arrival_offsets(400.0, 8, 2)]
    again = ls.summarize_requests(reqs, 400.0, start, 60.0, 60.0)
    assert {k: summary[k] for k in again} == again
    assert summary["goodput"] > 0
    controls = summary["controls"]
    assert controls and len(controls) == len(calls["next_token_budget"])
    assert summary["controller"] == dict(target=1e-6, min_budget=4, max_budget=32)
    for _, budget, p95, nxt in controls:
        assert nxt == ls.slo_token_budget(budget, p95, 1e-6, min_budget=4, max_budget=32)
    # Every measured p95 is over a 1 us target: the budget only ever halves, down to min_budget.
    assert [b for _, b in summary["budgets"]] == [32, 16, 8, 4]


def test_run_open_loop_controller_options_are_checked():
    eng = tiny_engine(enable_chunked_prefill=True, max_num_batched_tokens=32)
    prompts = tiny_prompts(2)
    with pytest.raises(ValueError, match="not both"):
        ls.run_open_loop(eng, prompts, 10.0, 2, 2, controller=lambda b, p: b, slo_itl=0.1)
    with pytest.raises(ValueError, match="give slo_itl"):
        ls.run_open_loop(eng, prompts, 10.0, 2, 2, min_budget=4)
    with pytest.raises(ValueError, match="min_budget"):
        ls.run_open_loop(eng, prompts, 10.0, 2, 2, slo_itl=0.1, min_budget=64)  # above the starting budget 32
    with pytest.raises(ValueError, match="target"):
        ls.run_open_loop(eng, prompts, 10.0, 2, 2, slo_itl=0.0)
    with pytest.raises(ValueError, match="integer >= 1"):
        ls.run_open_loop(eng, prompts, 10.0, 2, 2, controller=lambda b, p: 0.5, control_every=0.0)


# ------------------------------------------------------------------ wrong functions


def unsorted_arrivals(rate, n, seed=0):
    t = s07.poisson_arrivals(rate, n, seed)
    return [0.0] + [b - a for a, b in zip(t, t[1:])]  # wrong: the gaps, not their running sum


@pytest.mark.parametrize("wrong, match", [
    (unsorted_arrivals, "comes before arrival"),
    (lambda rate, n, seed=0: s07.poisson_arrivals(rate, n, seed)[:-1], "arrival times for n="),
    (lambda rate, n, seed=0: [t + 1.0 for t in s07.poisson_arrivals(rate, n, seed)], "first request arrives at 0"),
    (lambda rate, n, seed=0: [0.0] + [-1.0] * (n - 1), ">= 0"),
    (lambda rate, n, seed=0: [0.0] + [float("nan")] * (n - 1), "finite"),
    (lambda rate, n, seed=0: ",".join(map(str, s07.poisson_arrivals(rate, n, seed))), "return a list"),
])
def test_wrong_arrivals_are_a_clear_error(wrong, match):
    with seams.plug(poisson_arrivals=wrong):
        with pytest.raises(ValueError, match=f"seam poisson_arrivals .*{match}"):
            ls.arrival_offsets(2.0, 6, 1)
        with pytest.raises(ValueError, match="seam poisson_arrivals "):
            ls.run_open_loop(tiny_engine(), tiny_prompts(2), 50.0, 6, 2)


def test_goodput_that_counts_failed_requests_changes_the_result():
    def counts_failed(ttfts, tpots, duration, slo_ttft=1.0, slo_tpot=0.2):
        good = sum(t is None or (t <= slo_ttft and (p is None or p <= slo_tpot)) for t, p in zip(ttfts, tpots))
        return good / duration

    recs = records()
    want = loadgen.goodput(recs, 1.0, 0.2)
    with seams.plug(goodput=counts_failed):
        got = loadgen.goodput(recs, 1.0, 0.2)
    assert got != want and got == pytest.approx(5 / loadgen._span(recs)), "the two failed requests counted"


@pytest.mark.parametrize("wrong, match", [
    (lambda ttfts, tpots, duration, st=1.0, sp=0.2: sum(t is not None for t in ttfts) / len(ttfts) * 0.37,
     "not a whole number|return \\(the number"),
    (lambda ttfts, tpots, duration, st=1.0, sp=0.2: -1.0, ">= 0"),
    (lambda ttfts, tpots, duration, st=1.0, sp=0.2: None, ">= 0"),
    (lambda ttfts, tpots, duration, st=1.0, sp=0.2: 2 * len(ttfts) / duration, "at most once"),
])
def test_wrong_goodput_is_a_clear_error(wrong, match):
    with seams.plug(goodput=wrong):
        with pytest.raises(ValueError, match=f"seam goodput .*({match})"):
            loadgen.goodput(records(), 1.0, 0.2)


def raises_when_over(budget, itl_p95, target, min_budget, max_budget, decrease=0.5, increase=16, headroom=0.8):
    if itl_p95 is not None and itl_p95 > target:  # wrong: backwards
        return min(max_budget, budget + increase)
    return s07.next_token_budget(budget, itl_p95, target, min_budget, max_budget, decrease, increase, headroom)


def test_a_controller_that_raises_the_budget_over_target_is_caught():
    with seams.plug(next_token_budget=raises_when_over):
        with pytest.raises(ValueError, match="seam next_token_budget .*never raise it"):
            ls.slo_token_budget(64, 0.5, 0.2, min_budget=8, max_budget=512)
        eng = tiny_engine(enable_chunked_prefill=True, max_num_batched_tokens=16)
        with pytest.raises(ValueError, match="seam next_token_budget "):
            ls.run_open_loop(eng, tiny_prompts(4), 400.0, 6, 8, control_every=0.0, slo_itl=1e-6, max_budget=64)


@pytest.mark.parametrize("wrong, match", [
    (lambda b, p, t, lo, hi, *rest: hi + 1, "outside \\[min_budget, max_budget\\]"),
    (lambda b, p, t, lo, hi, *rest: 0, "outside"),
    (lambda b, p, t, lo, hi, *rest: b * 0.5, "as an int"),
    (lambda b, p, t, lo, hi, *rest: True, "as an int"),
])
def test_a_budget_the_engine_cannot_take_is_a_clear_error(wrong, match):
    with seams.plug(next_token_budget=wrong):
        with pytest.raises(ValueError, match=f"seam next_token_budget .*{match}"):
            ls.slo_token_budget(64, 0.1, 0.2, min_budget=8, max_budget=512)


def test_a_controller_that_never_probes_upwards_changes_the_decisions():
    def never_grows(budget, itl_p95, target, min_budget, max_budget, decrease=0.5, increase=16, headroom=0.8):
        return max(min_budget, min(max_budget, budget if itl_p95 is None or itl_p95 <= target
                                   else int(budget * decrease)))

    inputs = [(256, 0.35), (128, 0.05), (144, 0.18), (144, None), (144, 0.01)]
    want = [ls.slo_token_budget(b, p, 0.2, min_budget=8, max_budget=512) for b, p in inputs]
    with seams.plug(next_token_budget=never_grows):
        got = [ls.slo_token_budget(b, p, 0.2, min_budget=8, max_budget=512) for b, p in inputs]
    assert want == [128, 144, 144, 144, 160] and got == [128, 128, 144, 144, 144]
