"""Chapter 9's seams: the idle blocks copied to the host tier, the SLO controller's rule, and
the A/B bootstrap, plugged into the library's own code paths.

With the reference answers plugged, every number is the library's: the same decisions of
``slo.slo_decision`` (its ``itl_break`` clamp applied to the plugged answer, as to its own),
the same controller events and greedy tokens in an engine, the same host copies, the same
A/B intervals. Each plugged function is called where the brief says and nowhere else (the
bootstrap only for one number per request and one replay a side). An answer the library
cannot use is a ValueError naming exercises/ch09_operating_slos.py.
"""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

from minillm import seams
from minillm.bench import ab
from minillm.block_manager import BlockManager
from minillm.clock import VirtualClock
from minillm.kv_offload import HostTier
from minillm.sampling_params import SamplingParams
from minillm.slo import SloConfig, slo_decision
from test_slo import tiny_engine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import solutions.ch09_operating_slos as s09  # noqa: E402


def spy(fn, calls: list):
    def call(*args, **kwargs):
        calls.append((args, kwargs))
        return fn(*args, **kwargs)

    return call


def test_the_new_seams_name_chapter_9():
    for name in ("blocks_to_offload", "slo_decision", "bootstrap_ci"):
        assert seams.SEAMS[name].chapter == "ch09_operating_slos"
        assert callable(getattr(s09, name))


# ------------------------------------------------------------------ slo_decision

CONFIGS = [dict(ttft_p95=2.0), dict(itl_p95=0.1), dict(ttft_p95=2.0, itl_p95=0.1),
           dict(ttft_p95=2.0, itl_p95=0.1, decrease=0.7, increase=0, headroom=1.0),
           dict(ttft_p95=1.0, itl_p95=0.05, decrease=0.25, increase=5, headroom=0.5)]


def _grid():
    for opts, (lo, hi), b, ttft, itl, brk in itertools.product(
            CONFIGS, ((1, 1000), (8, 64), (16, 16), (32, 512)), (1, 7, 16, 33, 64, 100, 600),
            (None, 0.0, 0.9, 1.6, 1.7, 2.0, 2.5), (None, 0.0, 0.03, 0.08, 0.09, 0.1, 0.3), (None, 1, 20, 64, 80, 200)):
        yield SloConfig(window_s=1, **opts), lo, hi, b, ttft, itl, brk


def test_plugged_rule_makes_the_library_decisions_itl_break_included():
    want = [slo_decision(b, t, i, c, min_budget=lo, max_budget=hi, itl_break=k) for c, lo, hi, b, t, i, k in _grid()]
    calls = []
    with seams.plug(slo_decision=spy(s09.slo_decision, calls)):
        got = [slo_decision(b, t, i, c, min_budget=lo, max_budget=hi, itl_break=k) for c, lo, hi, b, t, i, k in _grid()]
    assert len(calls) == len(want)
    cases = list(_grid())
    budgets_differ = [(case, g, w) for case, g, w in zip(cases, got, want) if g[0] != w[0]]
    assert not budgets_differ, budgets_differ[:3]
    # The reason is derived from the direction when plugged: the library's own wherever the budget
    # starts within its bounds (the controller's budget always does).
    in_bounds = [(case, g, w) for case, g, w in zip(cases, got, want) if case[1] <= case[3] <= case[2]]
    assert [g for _, g, _ in in_bounds] == [w for _, _, w in in_bounds]
    assert sum(k is not None and w[0] > b for (c, lo, hi, b, t, i, k), _, w in in_bounds) > 100, \
        "the grid must hold raises the itl_break clamp applies to"
    args, kwargs = calls[0]
    c = cases[0][0]
    assert args == (cases[0][3], cases[0][4], cases[0][5], c.ttft_p95, c.itl_p95), "the exercise's argument order"
    assert kwargs == dict(min_budget=cases[0][1], max_budget=cases[0][2], decrease=c.decrease, increase=c.increase,
                          headroom=c.headroom)


def test_the_itl_break_clamp_applies_to_a_plugged_raise():
    c = SloConfig(ttft_p95=2.0, itl_p95=0.1, window_s=1)

    def double(budget, *args, min_budget, max_budget, **kw):  # a raise of its own, whatever the p95s
        return min(max_budget, 2 * budget)

    with seams.plug(slo_decision=double):
        assert slo_decision(64, 3.0, 0.05, c, min_budget=8, max_budget=512) == (128, "ttft p95 over target")
        # The ITL broke at 100: the raise stops at 100 - 16 = 84, the library's clamp.
        assert slo_decision(64, 3.0, 0.05, c, min_budget=8, max_budget=512, itl_break=100) == \
            (84, "ttft p95 over target")
        assert slo_decision(64, 1.0, 0.05, c, min_budget=8, max_budget=512, itl_break=70) == (80, "under headroom")


def test_chapter_7s_seam_still_decides_the_itl_part_of_the_library_rule():
    c = SloConfig(ttft_p95=2.0, itl_p95=0.1, window_s=1)
    calls = []
    import solutions.ch07_serving_online as s07

    with seams.plug(next_token_budget=spy(s07.next_token_budget, calls)):
        assert slo_decision(128, 3.0, 0.05, c, min_budget=16, max_budget=512) == (256, "ttft p95 over target")
        assert slo_decision(128, 1.0, 0.2, c, min_budget=16, max_budget=512) == (64, "itl p95 over target")
    assert len(calls) == 2
    calls.clear()
    with seams.plug(next_token_budget=spy(s07.next_token_budget, calls), slo_decision=s09.slo_decision):
        assert slo_decision(128, 1.0, 0.2, c, min_budget=16, max_budget=512) == (64, "itl p95 over target")
    assert len(calls) == 1, "the reference slo_decision calls the library's rule, which asks chapter 7's seam"


@pytest.mark.parametrize("answer, match", [
    (100.0, "return the next budget as an int"),
    (True, "return the next budget as an int"),
    ("64", "return the next budget as an int"),
    (600, r"outside \[min_budget, max_budget\] = \[16, 512\]"),
    (8, r"outside \[min_budget, max_budget\]"),
    (256, "a broken ITL must lower the budget"),
])
def test_an_answer_the_controller_cannot_take_is_a_clear_error(answer, match):
    c = SloConfig(ttft_p95=2.0, itl_p95=0.1, window_s=1)
    with seams.plug(slo_decision=lambda *a, **k: answer):
        with pytest.raises(ValueError, match=match) as e:
            slo_decision(128, 3.0, 0.2, c, min_budget=16, max_budget=512)
    assert "seam slo_decision (exercises/ch09_operating_slos.py)" in str(e.value)


def _controlled_run(plug: dict) -> tuple[list, list]:
    """The tiny paged engine with both targets, on a virtual clock whose steps cost more with
    more tokens: the controller cuts, gives back and probes. (tokens, events)."""
    eng = tiny_engine(enable_chunked_prefill=True, max_num_batched_tokens=96, max_num_seqs=4,
                      slo={"ttft_p95": 0.3, "itl_p95": 0.04, "window_s": 0.4, "interval_s": 0.2, "min_budget": 8})
    clock = VirtualClock()
    eng.clock = clock
    eng.scheduler.clock = clock.now
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [[(5 * i + j) % 120 + 3 for j in range(12 + 11 * (i % 5))] for i in range(14)]
    reqs = [eng.add_request(p, params, arrival_time=0.05 * i) for i, p in enumerate(prompts)]
    with seams.plug(**plug):
        while eng.has_unfinished():
            before = len(eng.step_records)
            eng.step()
            for rec in eng.step_records[before:]:
                clock.advance(0.01 + 0.0008 * rec.num_tokens)
    events = [(round(e.time, 9), e.old_budget, e.new_budget, e.reason) for e in eng.slo_controller.events]
    return [r.output_token_ids for r in reqs], events


def test_the_controller_in_the_engine_makes_the_same_moves_with_the_reference_plugged(one_torch_thread):
    want_tokens, want_events = _controlled_run({})
    moves = {r for *_, r in want_events}
    assert {"itl p95 over target", "ttft p95 over target", "under headroom"} <= moves, want_events
    # A TTFT raise after a cut stops short of doubling: the itl_break clamp (ceil(20 / 0.5) = 40 -> 36).
    assert any(r == "ttft p95 over target" and 0 < new - old < old for _, old, new, r in want_events), want_events
    calls = []
    tokens, events = _controlled_run({"slo_decision": spy(s09.slo_decision, calls)})
    assert events == want_events and tokens == want_tokens
    assert len(calls) >= len(events)


# ------------------------------------------------------------------ blocks_to_offload


class _Seq:
    def __init__(self, tokens):
        self.all_token_ids, self.block_ids, self.request_id = tokens, [], "s"

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def _offload_story(plug: dict) -> list[int]:
    """Three prompts freed at t = 0, 1, 2; idle copies asked at t = 0.5 .. 4 (idle_s 1.5)."""
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    bm.enable_host_tier(HostTier(16, idle_s=1.5))
    now = [0.0]
    bm.allocator.clock = lambda: now[0]
    counts = []
    with seams.plug(**plug):
        for t, tokens in enumerate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13]]):
            now[0] = float(t)
            s = _Seq(tokens)
            bm.grow(s, len(tokens))
            bm.cache_blocks(s, len(tokens))
            bm.free(s)
        for t in (0.5, 2.0, 2.0, 3.0, 3.5, 4.0):
            counts.append(bm.offload_idle(t))
            counts.append(len(bm.take_kv_copies().outs))
    bm.check_invariants()
    return counts


def test_plugged_offload_choice_makes_the_library_copies():
    want = _offload_story({})
    assert sum(want) > 0 and want[0] == 0, want
    calls = []
    assert _offload_story({"blocks_to_offload": spy(s09.blocks_to_offload, calls)}) == want
    assert len(calls) == 6
    (pool, on_host, now, idle_s), _ = calls[0]
    assert isinstance(pool, list) and all(len(x) == 2 for x in pool) and isinstance(on_host, set)
    assert (now, idle_s) == (0.5, 1.5)


@pytest.mark.parametrize("answer, match", [
    ("abc", "must return a list of block ids"),
    ([99], "not in the evictable pool"),
    (None, "must return a list of block ids"),
])
def test_an_offload_choice_the_engine_cannot_copy_is_a_clear_error(answer, match):
    with pytest.raises(ValueError, match=match) as e:
        _offload_story({"blocks_to_offload": lambda *a: answer})
    assert "exercises/ch09_operating_slos.py" in str(e.value)


def test_the_engine_keeps_its_tokens_and_copies_with_the_reference_choice(one_torch_thread):
    def run(plug):
        eng = tiny_engine(block_size=8, num_blocks=12, max_model_len=64, enable_prefix_caching=True,
                          kv_offload={"host_blocks": 32, "idle_s": 0.0})
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        history = [[(7 * i + 3 * j) % 120 + 3 for j in range(20)] for i in range(4)]  # 4 conversations
        outs = []
        with seams.plug(**plug):
            for turn in range(3):  # each turn resends the conversation so far: the pool holds about two
                for i in range(4):
                    [out] = [o.token_ids for o in eng.run([eng.make_request(history[i], params)])]
                    outs.append(out)
                    history[i] = history[i] + out + [turn + 3, i + 3]
        host = eng.scheduler.block_manager.host
        return outs, (host.blocks_out, host.blocks_in, host.idle_offloads)

    want = run({})
    assert want[1][2] > 0 and want[1][1] > 0, f"no idle copy or no host hit: the test shows nothing ({want[1]})"
    calls = []
    assert run({"blocks_to_offload": spy(s09.blocks_to_offload, calls)}) == want and calls


# ------------------------------------------------------------------ bootstrap_ci


def _samples(seed=0, n=30):
    rng = np.random.default_rng(seed)
    return rng.lognormal(0, 0.4, n).tolist(), (rng.lognormal(0, 0.4, n) * 1.3).tolist()


def test_plugged_bootstrap_gives_the_library_intervals_for_flat_samples():
    a, b = _samples()
    cases = [dict(q=50), dict(q=95, n_boot=300, seed=4), dict(q=0, conf=0.8),
             dict(q=50, runs_a=[0] * len(a), runs_b=["r"] * len(b))]  # one replay a side, labelled
    want = [ab.bootstrap_diff(a, b, **kw) for kw in cases]
    calls = []
    with seams.plug(bootstrap_ci=spy(s09.bootstrap_ci, calls)):
        got = [ab.bootstrap_diff(a, b, **kw) for kw in cases]
    assert got == want and len(calls) == len(cases)
    (ca, cb, q, n_boot, seed, conf), _ = calls[1]
    assert (ca, cb, q, n_boot, seed, conf) == (a, b, 95.0, 300, 4, 0.95)


def test_grouped_samples_several_replays_and_the_mean_stay_the_librarys():
    a, b = _samples()
    grouped_a, grouped_b = [[x, x / 2] for x in a], [[x] for x in b]
    calls = []
    with seams.plug(bootstrap_ci=spy(s09.bootstrap_ci, calls)):
        ab.bootstrap_diff(grouped_a, grouped_b, 50, n_boot=50)
        ab.bootstrap_diff(a, b, 50, n_boot=50, runs_a=[i % 2 for i in range(len(a))])
        ab.bootstrap_diff(a, b, "mean", n_boot=50)
    assert calls == []


def test_compare_of_single_runs_takes_the_plugged_bootstrap():
    from minillm.bench.loadgen import LoadResult

    def result(scale, seed):
        rng = np.random.default_rng(seed)
        recs = []
        for i in range(30):
            ttft = float(rng.lognormal(-1.5, 0.4)) * scale
            itls = (rng.lognormal(-3.0, 0.2, 5) * scale).tolist()
            recs.append({"index": i, "arrival": i * 0.1, "lag": 0.0, "ttft": ttft, "tpot": sum(itls) / 5,
                         "e2e": ttft + sum(itls), "itls": itls, "output_tokens": 6, "ok": True, "status": 200})
        return LoadResult("http://x", None, recs, 5.0, 1.0, 0.2, label="t")

    a, b = result(1.0, 0), result(1.4, 1)
    want = ab.compare(a, b, n_boot=300)
    calls = []
    with seams.plug(bootstrap_ci=spy(s09.bootstrap_ci, calls)):
        got = ab.compare(a, b, n_boot=300)
    assert got == want
    flat = [m for m, series, q, _ in ab.METRICS if series not in ("itl", "slo")]
    assert len(calls) == len(flat), "TTFT, TPOT and E2E rows: one number per request, one replay"


@pytest.mark.parametrize("answer, match", [
    ((1.0, 2.0), r"return \(diff, \(low, high\)\)"),
    ("no", r"return \(diff, \(low, high\)\)"),
    ((0.1, (0.5, -0.5)), "low <= high"),
    ((0.1, (float("nan"), 1.0)), "finite"),
    ((0.1, (-1e9, 1e9)), "where every resampled difference lies"),
])
def test_an_interval_the_verdict_cannot_read_is_a_clear_error(answer, match):
    a, b = _samples(n=10)
    with seams.plug(bootstrap_ci=lambda *args: answer):
        with pytest.raises(ValueError, match=match) as e:
            ab.bootstrap_diff(a, b, 50)
    assert "seam bootstrap_ci (exercises/ch09_operating_slos.py)" in str(e.value)


def test_inputs_are_checked_before_the_plugged_bootstrap_is_asked():
    calls = []
    with seams.plug(bootstrap_ci=spy(s09.bootstrap_ci, calls)):
        for bad in (dict(a=[], b=[1.0], q=50), dict(a=[1.0], b=[1.0], q=120), dict(a=[1.0], b=[float("nan")], q=50)):
            with pytest.raises(ValueError):
                ab.bootstrap_diff(**bad)
    assert calls == []
