"""The SLO controller (minillm/slo.py): its rule, its configuration, the controller on a fake
clock, inside the engine (the same greedy tokens, with events), on the serve command line,
at /metrics and on the dashboard.

No timing asserts: the controller is fed synthetic token times, or an engine whose clock
a test advances by hand (``VirtualClock``), so every decision is known in advance.
"""
from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from minillm import seams
from minillm.clock import VirtualClock
from minillm.config import EngineConfig, ModelConfig
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.slo import SloConfig, SloController, p95, slo_decision, slo_token_budget

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)


def decide(budget, ttft, itl, lo=8, hi=512, **targets):
    return slo_decision(budget, ttft, itl, SloConfig(window_s=10, **targets), min_budget=lo, max_budget=hi)


# ---------------------------------------------------------------- the rule

def test_the_itl_rule_is_chapter_7s_and_keeps_its_name_in_the_sweep():
    from minillm.bench import sweep

    assert sweep.slo_token_budget is slo_token_budget
    kw = dict(min_budget=8, max_budget=512)
    assert [slo_token_budget(256, v, 0.2, **kw) for v in (0.35, 0.10, 0.18, None)] == [128, 272, 256, 256]
    assert slo_token_budget(9, 1.0, 0.2, **kw) == 8 and slo_token_budget(510, 0.01, 0.2, **kw) == 512


def test_itl_over_target_cuts_the_budget_in_band_holds_under_headroom_grows():
    assert decide(256, None, 0.5, itl_p95=0.3) == (128, "itl p95 over target")
    assert decide(256, None, 0.27, itl_p95=0.3) == (256, ""), "within [0.8, 1] x target: hold (hysteresis)"
    assert decide(256, None, 0.1, itl_p95=0.3) == (272, "under headroom")
    assert decide(256, None, None, itl_p95=0.3) == (256, ""), "nothing measured: hold"


def test_both_over_target_the_streams_keep_their_pace():
    assert decide(256, 9.0, 0.5, ttft_p95=2.0, itl_p95=0.3) == (128, "itl p95 over target")


def test_ttft_over_target_gives_budget_back_while_the_itl_has_room():
    assert decide(64, 5.0, 0.1, ttft_p95=2.0, itl_p95=0.3) == (128, "ttft p95 over target"), "undoes one cut"
    assert decide(64, 5.0, None, ttft_p95=2.0, itl_p95=0.3) == (128, "ttft p95 over target")
    assert decide(64, 5.0, 0.27, ttft_p95=2.0, itl_p95=0.3) == (64, ""), "ITL in its band: no room, hold"
    assert decide(400, 5.0, 0.1, ttft_p95=2.0, itl_p95=0.3) == (512, "ttft p95 over target"), "to the ceiling"
    assert decide(512, 5.0, 0.1, ttft_p95=2.0, itl_p95=0.3) == (512, ""), "at the ceiling: nothing to give"


def test_near_where_the_itl_broke_a_ttft_raise_probes_instead_of_doubling():
    kw = dict(ttft_p95=2.0, itl_p95=0.3)
    assert slo_decision(144, 5.0, 0.1, SloConfig(window_s=10, **kw), min_budget=8, max_budget=1024,
                        itl_break=288) == (272, "ttft p95 over target")
    assert slo_decision(272, 5.0, 0.1, SloConfig(window_s=10, **kw), min_budget=8, max_budget=1024,
                        itl_break=288) == (288, "ttft p95 over target"), "then by increase tokens"
    assert slo_decision(64, 5.0, 0.1, SloConfig(window_s=10, **kw), min_budget=8, max_budget=1024,
                        itl_break=288) == (128, "ttft p95 over target"), "far below it: doubles"


def test_growth_waits_until_every_measured_p95_is_under_headroom():
    assert decide(64, 1.8, 0.1, ttft_p95=2.0, itl_p95=0.3) == (64, ""), "TTFT within its band: hold"
    assert decide(64, 1.0, 0.1, ttft_p95=2.0, itl_p95=0.3) == (80, "under headroom")
    assert decide(64, None, 0.1, ttft_p95=2.0, itl_p95=0.3) == (80, "under headroom"), "TTFT unmeasured"
    assert decide(64, 1.0, None, ttft_p95=2.0) == (80, "under headroom"), "a TTFT-only SLO"
    assert decide(64, 3.0, None, ttft_p95=2.0) == (128, "ttft p95 over target")


def test_the_budget_stays_within_its_bounds():
    assert decide(9, None, 9.0, itl_p95=0.3) == (8, "itl p95 over target")
    assert decide(8, None, 9.0, itl_p95=0.3) == (8, ""), "at the floor: nothing changes"
    assert decide(510, None, 0.0, itl_p95=0.3) == (512, "under headroom")


def test_a_plugged_next_token_budget_makes_the_itl_decision():
    calls = []

    def quarter(budget, itl_p95, target, min_budget, max_budget, decrease, increase, headroom):
        calls.append((budget, itl_p95, target))
        return max(min_budget, budget // 4) if itl_p95 > target else budget

    with seams.plug(next_token_budget=quarter):
        assert decide(256, None, 0.5, itl_p95=0.3) == (64, "itl p95 over target")
        assert decide(256, 1.0, 0.1, ttft_p95=2.0, itl_p95=0.3) == (256, ""), "its 'keep' leaves no room to grow"
    assert calls == [(256, 0.5, 0.3), (256, 0.1, 0.3)]


def test_p95_is_the_sweeps_percentile():
    from minillm.bench.summary import percentiles

    xs = [0.3, 0.1, 2.0, 0.7, 0.2, 1.1]
    assert p95(xs) == pytest.approx(percentiles(xs, (95,))["p95"]) and p95([]) is None


# ---------------------------------------------------------------- configuration errors

@pytest.mark.parametrize("options, match", [
    ({"itl_p95": 0.3, "window_s": 10, "budget": 5}, "unknown slo option.*budget"),
    ({"window_s": 10}, "needs a target"),
    ({"itl_p95": 0.3}, "needs window_s"),
    ({"itl_p95": 0.3, "window_s": 0}, "window_s must be a number of seconds > 0"),
    ({"itl_p95": 0.3, "window_s": -1}, "window_s"),
    ({"itl_p95": -0.3, "window_s": 10}, "itl_p95 must be a number of seconds > 0"),
    ({"ttft_p95": 0, "window_s": 10}, "ttft_p95 must be"),
    ({"itl_p95": 0.3, "window_s": 10, "interval_s": 0}, "interval_s"),
    ({"itl_p95": 0.3, "window_s": 10, "min_budget": 64, "max_budget": 32}, "min_budget .* <= max_budget"),
    ({"itl_p95": 0.3, "window_s": 10, "decrease": 1.5}, "decrease"),
    ({"itl_p95": 0.3, "window_s": 10, "headroom": 0}, "headroom"),
    ("fast", "slo must be a dict"),
])
def test_bad_slo_options_say_what_to_change(options, match):
    with pytest.raises(ValueError, match=match):
        SloConfig.from_dict(options)
    with pytest.raises(ValueError, match=match):
        EngineConfig(engine="paged", slo=options)


def test_engines_without_a_budget_to_move_are_refused():
    for engine in ("simple", "static"):
        with pytest.raises(ValueError, match="continuous or paged"):
            EngineConfig(engine=engine, slo={"itl_p95": 0.3, "window_s": 10})
    with pytest.raises(ValueError, match="min_budget=4 is smaller than max_num_seqs=8"):
        EngineConfig(engine="paged", slo={"itl_p95": 0.3, "window_s": 10, "min_budget": 4})
    cfg = EngineConfig.from_kwargs(engine="continuous", slo={"itl_p95": 0.3, "window_s": 10})  # what LLM(...) does
    assert isinstance(cfg.slo, SloConfig) and cfg.slo.interval_s == 5.0 and EngineConfig().slo is None


# ---------------------------------------------------------------- the controller, on a fake clock

class FakeScheduler:
    def __init__(self, budget=256, seqs=8):
        self.max_num_seqs, self.max_num_batched_tokens = seqs, budget
        self.waiting, self.running = [], []


def request(arrival, token_times):
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=100), arrival_time=arrival)
    r.metrics.first_token_time = token_times[0] if token_times else None
    r.metrics.token_times = list(token_times)
    return r


def test_the_controller_cuts_on_slow_tokens_then_grows_back(caplog):
    sched = FakeScheduler(256)
    ctl = SloController({"itl_p95": 0.3, "window_s": 4, "interval_s": 2}, sched)
    assert (ctl.min_budget, ctl.max_budget) == (8, 256), "defaults: max_num_seqs and the starting budget"
    slow = request(0.0, [0.5 * i for i in range(1, 9)])  # a token every 0.5 s
    with caplog.at_level(logging.INFO, logger="minillm.slo"):
        assert ctl.after_step([slow], now=4.0) is None, "the first step starts the clock of decisions"
        event = ctl.after_step([slow], now=6.0)
    assert sched.max_num_batched_tokens == 128 and event.direction == "down"
    assert (event.time, event.old_budget, event.new_budget, event.reason) == (6.0, 256, 128, "itl p95 over target")
    assert event.itl_p95 == pytest.approx(0.5) and event.ttft_p95 is None, "no first token in the window"
    assert "256 -> 128" in caplog.text and "itl p95 over target" in caplog.text
    fast = request(6.0, [])  # then a token every 0.1 s: the p95 gap is back under 0.8 x 0.3
    for now in (8.0, 10.0, 12.0):
        fast.metrics.token_times = [6.0 + 0.1 * i for i in range(1, round((now - 6.0) / 0.1) + 1)]
        fast.metrics.first_token_time = 6.1
        ctl.after_step([fast], now=now)
    assert [e.new_budget for e in ctl.events] == [128, 144, 160, 176]
    assert [e.reason for e in ctl.events[1:]] == ["under headroom"] * 3
    assert ctl.itl_break == 256, "where the ITL broke: TTFT raises probe near it"
    assert (ctl.num_decisions, ctl.num_decreases, ctl.num_increases) == (4, 1, 3)
    snap = ctl.snapshot()
    assert (snap.token_budget, snap.itl_target, snap.num_decreases, snap.last_event_time) == (176, 0.3, 1, 12.0)


def test_a_waiting_request_counts_at_its_age():
    for ceiling in (None, 256):
        sched = FakeScheduler(64)
        ctl = SloController({"ttft_p95": 2.0, "itl_p95": 0.3, "window_s": 10, "interval_s": 1,
                             "max_budget": ceiling}, sched)
        ctl.after_step([request(0.0, [0.5, 0.6, 0.7])], now=1.0)
        sched.waiting.append(request(0.0, []))  # arrived at 0, no token yet: its TTFT is at least its age
        sched.waiting.append(request(99.0, []))  # not arrived yet: not counted
        assert ctl.window_p95(1.0)[0] == pytest.approx(0.5 + 0.95 * 0.5)
        event = ctl.after_step([], now=5.0)
        assert ctl.last_ttft_p95 == pytest.approx(0.5 + 0.95 * 4.5) and ctl.last_itl_p95 == pytest.approx(0.1)
        if ceiling is None:
            assert event is None and sched.max_num_batched_tokens == 64, "at its ceiling (the start): nothing to give"
        else:
            assert (event.reason, event.new_budget) == ("ttft p95 over target", 128), "the ITL has room"


def test_continuous_engine_never_goes_below_its_longest_prompt():
    sched = FakeScheduler(128, seqs=4)
    ctl = SloController({"itl_p95": 0.3, "window_s": 4}, sched, engine="continuous", max_model_len=64)
    assert ctl.min_budget == 63, "whole prompts: the longest it accepts (max_model_len - 1) must still fit"
    with pytest.raises(ValueError, match="longest prompt the continuous engine accepts"):
        SloController({"itl_p95": 0.3, "window_s": 4, "min_budget": 16}, sched, engine="continuous",
                      max_model_len=64)
    with pytest.raises(ValueError, match="outside the slo bounds"):
        SloController({"itl_p95": 0.3, "window_s": 4, "max_budget": 64}, FakeScheduler(128))


# ---------------------------------------------------------------- in the engine

def tiny_engine(**options):
    from minillm.engine import build_engine

    cfg = EngineConfig(**{"engine": "paged", "max_num_seqs": 4, "max_model_len": 128, "device": "cpu",
                          "dtype": "float32", **options})
    return build_engine(cfg, model_config=TINY, tokenizer=None)


PROMPTS = [[(7 * i + j) % 120 + 3 for j in range(20 + 9 * i)] for i in range(6)]


def run_by_hand(engine, step_s=0.1):
    """Every request at t=0, one step per ``step_s`` seconds of a virtual clock."""
    clock = VirtualClock()
    engine.clock = clock
    engine.scheduler.clock = clock.now
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reqs = [engine.add_request(p, params, arrival_time=0.0) for p in PROMPTS]
    while engine.has_unfinished():
        clock.advance(step_s)
        engine.step()
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("engine, options", [
    ("paged", dict(enable_chunked_prefill=True, max_num_batched_tokens=64)),
    ("continuous", dict(max_num_batched_tokens=256, max_model_len=96)),
])
def test_the_engine_runs_the_controller_and_the_greedy_tokens_stay(engine, options):
    plain = tiny_engine(engine=engine, **options)
    assert plain.slo_controller is None and plain.snapshot().slo is None
    # Every gap is 0.1 s of the virtual clock, over a 0.05 s target: every decision cuts
    slo = tiny_engine(engine=engine, **options, slo={"itl_p95": 0.05, "window_s": 0.5, "interval_s": 0.2})
    assert run_by_hand(slo) == run_by_hand(plain), "a budget changes the schedule, never a greedy token"
    ctl = slo.slo_controller
    assert ctl.events and all(e.direction == "down" and e.reason == "itl p95 over target" for e in ctl.events)
    assert [e.old_budget for e in ctl.events[1:]] == [e.new_budget for e in ctl.events[:-1]]
    assert slo.scheduler.max_num_batched_tokens == ctl.events[-1].new_budget >= ctl.min_budget
    assert slo.snapshot().slo.token_budget == slo.scheduler.max_num_batched_tokens


def test_a_prompt_longer_than_the_lowered_budget_is_still_accepted():
    eng = tiny_engine(max_num_batched_tokens=64, slo={"itl_p95": 0.05, "window_s": 0.5})
    eng.scheduler.max_num_batched_tokens = 8  # as the controller may have set it
    req = eng.make_request(list(range(3, 60)), SamplingParams(max_tokens=2))  # 57 tokens > 8, <= its ceiling
    assert req.num_prompt_tokens == 57
    with pytest.raises(ValueError, match="max_num_batched_tokens is 64"):
        eng.make_request(list(range(3, 70)), SamplingParams(max_tokens=2))


@pytest.mark.slow
def test_llm_takes_slo():
    from minillm import LLM

    llm = LLM(engine="paged", device="cpu", dtype="float32", max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=64, slo={"ttft_p95": 1.0, "itl_p95": 0.5, "window_s": 2})
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4))
    assert out[0].token_ids and llm.engine.slo_controller.min_budget == 8


# ---------------------------------------------------------------- serving and the dashboard

def test_serve_flags_become_the_slo_config():
    from minillm.serving.cli import _serve_parser, engine_kwargs_from_args

    def kwargs(*flags):
        return engine_kwargs_from_args(_serve_parser().parse_args(list(flags)))

    kw = kwargs("--slo-ttft-p95", "2", "--slo-itl-p95", "0.25", "--slo-window", "8")
    assert kw["slo"] == {"ttft_p95": 2.0, "itl_p95": 0.25, "window_s": 8.0}
    assert EngineConfig.from_kwargs(**kw).slo == SloConfig(ttft_p95=2.0, itl_p95=0.25, window_s=8.0)
    assert "slo" not in kwargs()
    with pytest.raises(ValueError, match="need --slo-window"):
        kwargs("--slo-itl-p95", "0.25")
    with pytest.raises(ValueError, match="give a target"):
        kwargs("--slo-window", "8")


def test_metrics_export_the_controller_and_the_dashboard_reads_them_back():
    from minillm.serving.prometheus import ServingMetrics
    from minillm.viz.sources import EngineSource, MetricsSource

    eng = tiny_engine(enable_chunked_prefill=True, max_num_batched_tokens=64,
                      slo={"ttft_p95": 5.0, "itl_p95": 0.05, "window_s": 0.5, "interval_s": 0.2})
    run_by_hand(eng)
    ctl = eng.slo_controller
    text = ServingMetrics(SimpleNamespace(stats=eng.snapshot(), counts={}), "m").render()[0].decode()
    lines = set(text.splitlines())
    assert f'minillm_slo_token_budget{{model_name="m"}} {float(ctl.token_budget)}' in lines
    assert 'minillm_slo_target_seconds{metric="ttft",model_name="m"} 5.0' in lines
    assert 'minillm_slo_target_seconds{metric="itl",model_name="m"} 0.05' in lines
    assert f'minillm_slo_adjustments_total{{direction="down",model_name="m"}} {float(ctl.num_decreases)}' in lines
    assert f'minillm_slo_window_p95_seconds{{metric="itl",model_name="m"}} {ctl.last_itl_p95!r}' in lines
    plain = ServingMetrics(SimpleNamespace(stats=tiny_engine().snapshot(), counts={}), "m").render()[0].decode()
    assert "minillm_slo" not in plain, "no controller, no SLO metrics"
    sample = MetricsSource("http://127.0.0.1:1/metrics", fetch=lambda url: text).poll()
    assert (sample.token_budget, sample.slo_adjustments) == (ctl.token_budget, len(ctl.events))
    local = EngineSource(eng).poll()
    assert (local.token_budget, local.slo_adjustments) == (ctl.token_budget, len(ctl.events))
    assert EngineSource(tiny_engine()).poll().token_budget is None


def test_dashboard_marks_the_budget_changes():
    import matplotlib

    matplotlib.use("Agg")
    from minillm.viz.dashboard import Sample, headline, plot_samples, slo_marks
    from minillm.viz.panel import LivePanel, series

    samples = [Sample(t=float(t), arrived=t, finished=t, output_tokens=t, running=1, waiting=0, batch_size=1,
                      token_budget=256 >> min(t // 3, 3), slo_adjustments=min(t // 3, 3)) for t in range(12)]
    assert slo_marks(samples) == [3.0, 6.0, 9.0]
    assert slo_marks([Sample(t=0.0, arrived=0, finished=0, output_tokens=0, running=0, waiting=0,
                             batch_size=0)]) == []
    assert "SLO token budget 32 (3 changes)" in headline(samples[-1])
    fig = plot_samples(samples)
    twin = [ax for ax in fig.axes if ax.get_ylabel() == "token budget"]
    assert len(twin) == 1 and list(twin[0].lines[0].get_ydata()) == [s.token_budget for s in samples]
    panel = LivePanel()
    frame = panel.draw(series(samples), samples[-1].t, marks=slo_marks(samples))
    assert frame.startswith(b"\xff\xd8")
    xs = list(panel.mark_lines["ITL (s)"].get_xdata())
    assert [x for x in xs if not math.isnan(x)] == [-8.0, -8.0, -5.0, -5.0, -2.0, -2.0], "seconds before now"


# ---------------------------------------------------------------- the load-step benchmark's arithmetic

def test_slo_step_arrivals_double_and_recovery_is_read_from_the_window():
    from minillm.bench.slo_step import bucket_table, recovery, step_arrivals, windowed_p95

    t = step_arrivals(2.0, 50.0, 100.0, seed=3)
    assert t == sorted(t) and t[0] == 0.0 and t[-1] < 100.0
    before, after = sum(x < 50 for x in t), sum(x >= 50 for x in t)
    assert 60 <= before <= 140 and 140 <= after <= 260, "~100 at 2/s, then ~200 at 4/s"
    with pytest.raises(ValueError, match="step_at"):
        step_arrivals(1.0, 10.0, 5.0)
    # One request a second; TTFT 0.5 s until 20 s, 3 s from 20 s to 30 s, 0.5 s after
    reqs = []
    for i in range(40):
        ttft = 3.0 if 20 <= i < 30 else 0.5
        r = request(float(i), [i + ttft, i + ttft + 0.1])
        r.metrics.finish_time = i + ttft + 0.1
        reqs.append(r)
    res = dict(requests=reqs, start=0.0, budgets=[(0.0, 64), (25.0, 32)])  # the budget at each bucket's end
    assert windowed_p95(res, "ttft", 10.0, 5.0) == pytest.approx(0.5)
    assert windowed_p95(res, "itl", 10.0, 5.0) == pytest.approx(0.1)
    rec = recovery(res, "ttft", 2.0, step_at=15.0, end=40.0, window=5.0)
    assert rec["ever_over"] and 0 < rec["over_share"] < 1
    # the last 3 s TTFT (first token at 32 s) is in the 5 s window until 37 s: under from 38 s, 23 s after the step
    assert rec["back_under_at"] == pytest.approx(23.0)
    rows = bucket_table(res, 10.0, 40.0)
    assert [row["budget"] for row in rows] == [64, 64, 32, 32] and rows[2]["ttft_p95"] == pytest.approx(3.0)


def test_sustained_capacity_counts_finishes_while_a_full_batch_runs():
    from minillm.bench import slo_step

    class _Metrics:
        def __init__(self, t):
            self.finish_time = t

    class _Req:
        metrics = None

    class _Engine:  # 2 at a time, 8 queued: finishes at 1, 2 (ramp-up), 4, 5, 6, 7.5, then 9, 12 (the tail)
        scheduler = type("S", (), {"max_num_seqs": 2})()

        def make_request(self, prompt, params):
            return _Req()

        def run(self, reqs):
            for r, t in zip(reqs, [5.0, 1.0, 9.0, 2.0, 4.0, 7.5, 12.0, 6.0]):
                r.metrics = _Metrics(t)

    got = slo_step.sustained_capacity(_Engine(), [[1, 2, 3]], 4, batches=4)
    assert got == pytest.approx(4 / (7.5 - 2.0)), "finishes 3..6 between the 2nd and the 6th"
    with pytest.raises(ValueError, match="batches must be >= 3"):
        slo_step.sustained_capacity(_Engine(), [[1, 2, 3]], 4, batches=2)
