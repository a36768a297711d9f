"""The latency-vs-load sweep (minillm/bench/sweep.py) on a tiny random-weight Llama:
open-loop arrivals are honoured, the numbers are the requests' own, the knee and the
speculation crossover read what the points say, bad input fails with a ValueError."""
from __future__ import annotations

import time

import pytest

from minillm.config import EngineConfig, ModelConfig
from minillm.engine import build_engine
from minillm.bench import sweep as ls
from minillm.bench.sweep import RatePoint

TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=16, max_position_embeddings=256)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13], [20, 21, 22, 20, 21, 22, 20]]


class TinyLab:
    """What sweep_engines needs of a Lab: engines on shared (here: seeded tiny) weights."""

    tokenizer = None

    def engine(self, engine="paged", **options):
        cfg = EngineConfig(engine=engine, device="cpu", dtype="float32", **options)
        return build_engine(cfg, model_config=TINY, tokenizer=None)


def test_open_loop_run_honours_arrivals_and_counts_exactly():
    eng = TinyLab().engine("paged", max_num_seqs=4, max_model_len=128)
    summary, reqs = ls.run_open_loop(eng, PROMPTS, rate=20.0, num_requests=10, output_tokens=8, seed=3)
    assert set(ls.SUMMARY_KEYS) <= set(summary)
    assert (summary["num_ok"], summary["num_failed"]) == (10, 0)
    offsets = ls.arrival_offsets(20.0, 10, 3)
    start = reqs[0].arrival_time
    for r, off in zip(reqs, offsets):
        assert r.arrival_time - start == pytest.approx(off)
        assert r.metrics.first_scheduled_time >= r.arrival_time, "nobody runs before it arrives (open loop)"
        assert len(r.output_token_ids) == 8
    wall = max(r.metrics.finish_time for r in reqs) - start
    assert summary["throughput_tok_s"] == pytest.approx(80 / wall)
    assert summary["ttft_p50"] <= summary["ttft_p95"] <= summary["ttft_p99"]
    assert summary["goodput"] == pytest.approx(10 / wall) or summary["goodput"] < 10 / wall
    # The run lasted at least as long as the arrivals did
    assert wall >= offsets[-1]


def test_goodput_counts_only_requests_within_the_slo():
    eng = TinyLab().engine("paged", max_num_seqs=4, max_model_len=128)
    loose, reqs = ls.run_open_loop(eng, PROMPTS, 50.0, 6, 4, slo_ttft=1e9, slo_tpot=1e9)
    wall = max(r.metrics.finish_time for r in reqs) - reqs[0].arrival_time
    assert loose["goodput"] == pytest.approx(6 / wall)
    strict, _ = ls.run_open_loop(eng, PROMPTS, 50.0, 6, 4, slo_ttft=1e-9, slo_tpot=1e9)
    assert strict["goodput"] == 0.0
    assert ls.meets_slo(0.5, None, 1.0, 0.1) and not ls.meets_slo(None, 0.01, 1.0, 0.1)
    assert not ls.meets_slo(0.5, 0.2, 1.0, 0.1)


def test_sweep_engines_covers_every_config_and_rate():
    points = ls.sweep_engines(TinyLab(), ["paged", "paged+ngram"], rates=[10.0, 40.0], num_requests=5,
                              output_tokens=6, prompts=PROMPTS, max_num_seqs=4, max_model_len=128, progress=False)
    assert [(p.config, p.rate) for p in points] == [("paged", 10.0), ("paged", 40.0), ("paged+ngram", 10.0),
                                                     ("paged+ngram", 40.0)]
    assert all(p.summary["num_ok"] == 5 for p in points)
    assert points[2].extra["acceptance_rate"] is not None and "acceptance_rate" not in points[0].extra
    table = ls.format_points(points)
    assert "paged+ngram" in table and len(table.splitlines()) == 2 + len(points)


def test_sweep_feeds_a_dashboard():
    from minillm.viz.dashboard import Dashboard, EngineSource

    lab = TinyLab()
    dash = Dashboard(EngineSource(lab.engine("paged", max_num_seqs=4, max_model_len=128)), interval=0.1,
                     display=False, draw=False)
    with dash:
        ls.sweep_engines(lab, ["paged", "continuous"], rates=[30.0], num_requests=4, output_tokens=5,
                         prompts=PROMPTS, max_num_seqs=4, max_model_len=128, progress=False, dashboard=dash)
    assert [m[1] for m in dash.marks] == ["paged 30/s", "continuous 30/s"]
    assert dash.errors == [] and dash.samples[-1].finished == 8, "every tracked request is counted, once"


def test_controller_sets_the_token_budget():
    eng = TinyLab().engine("paged", max_num_seqs=2, max_model_len=128, enable_chunked_prefill=True,
                           max_num_batched_tokens=64)
    calls = []

    def halve(budget, itl_p95):
        calls.append((budget, itl_p95))
        return max(2, budget // 2)

    summary, _ = ls.run_open_loop(eng, PROMPTS, 5.0, 6, 20, controller=halve, control_every=0.0)
    assert calls and calls[0][0] == 64
    assert summary["budgets"][0] == (0.0, 64) and summary["budgets"][-1][1] == eng.scheduler.max_num_batched_tokens == 2
    assert summary["num_ok"] == 6, "a smaller budget slows prefill, never loses a request"


def test_slo_token_budget_rule():
    kw = dict(min_budget=8, max_budget=512)
    assert ls.slo_token_budget(256, 0.35, 0.2, **kw) == 128
    assert ls.slo_token_budget(256, 0.10, 0.2, **kw) == 272
    assert ls.slo_token_budget(256, 0.18, 0.2, **kw) == 256
    assert ls.slo_token_budget(256, None, 0.2, **kw) == 256
    assert ls.slo_token_budget(9, 1.0, 0.2, **kw) == 8
    with pytest.raises(ValueError, match="min_budget"):
        ls.slo_token_budget(64, 0.1, 0.2, min_budget=100, max_budget=50)


def _points(config, values, metric="ttft_p50"):
    return [RatePoint(config, r, {metric: v, "tpot_p50": v}) for r, v in values]


def test_saturation_knee():
    pts = _points("x", [(0.5, 0.30), (1.0, 0.35), (2.0, 0.70), (4.0, 5.0)])
    assert ls.saturation_knee(pts) == 2.0, "0.70 > 2 x 0.30 first at 2 req/s"
    assert ls.saturation_knee(pts, factor=10) == 4.0
    assert ls.saturation_knee(_points("x", [(1, 0.3), (2, 0.4)])) is None, "never took off"
    with pytest.raises(ValueError, match="factor"):
        ls.saturation_knee(pts, factor=1.0)


def test_spec_crossover():
    base = _points("paged", [(0.5, 0.20), (1.0, 0.22), (2.0, 0.30), (4.0, 0.50)], "tpot_p50")
    spec = _points("spec", [(0.5, 0.10), (1.0, 0.15), (2.0, 0.35), (4.0, 0.70)], "tpot_p50")
    c = ls.spec_crossover(base, spec)
    assert c["stops_paying_at"] == 2.0 and c["pays"] == {0.5: True, 1.0: True, 2.0: False, 4.0: False}
    assert c["ratio"][0.5] == pytest.approx(0.5)
    always = ls.spec_crossover(base, _points("spec", [(r, 0.01) for r in (0.5, 1, 2, 4)], "tpot_p50"))
    assert always["stops_paying_at"] is None
    never = ls.spec_crossover(base, _points("spec", [(r, 9.0) for r in (0.5, 1, 2, 4)], "tpot_p50"))
    assert never["stops_paying_at"] == 0.5
    # A point where it pays again later means it has not stopped paying yet
    back = ls.spec_crossover(base, _points("spec", [(0.5, 0.1), (1.0, 0.3), (2.0, 0.2), (4.0, 0.9)], "tpot_p50"))
    assert back["stops_paying_at"] == 4.0
    with pytest.raises(ValueError, match="no rate"):
        ls.spec_crossover(base, _points("spec", [(9.0, 1.0)], "tpot_p50"))


@pytest.mark.parametrize("rates", [[], [1.0, -2.0], [0.0], [float("inf")], "1,2", [True]])
def test_bad_rates_are_rejected(rates):
    with pytest.raises(ValueError, match="rate"):
        ls.check_rates(rates)


def test_bad_input_is_rejected():
    eng = TinyLab().engine("paged", max_num_seqs=2, max_model_len=128)
    with pytest.raises(ValueError, match="rate"):
        ls.run_open_loop(eng, PROMPTS, -1.0, 4, 4)
    with pytest.raises(ValueError, match="num_requests"):
        ls.run_open_loop(eng, PROMPTS, 1.0, 0, 4)
    with pytest.raises(ValueError, match="prompts"):
        ls.run_open_loop(eng, [], 1.0, 2, 4)
    with pytest.raises(ValueError, match="unknown config"):
        ls.sweep_engines(TinyLab(), ["paged", "warp-drive"], [1.0], prompts=PROMPTS)
    with pytest.raises(ValueError, match="no points"):
        ls.points_of([], "paged")


def test_cli_rejects_bad_rates(capsys):
    with pytest.raises(SystemExit):
        ls.main(["--rates", "1,-2"])
    assert "rate" in capsys.readouterr().err


def test_arrivals_scale_with_the_rate():
    a, b = ls.arrival_offsets(1.0, 20, 5), ls.arrival_offsets(4.0, 20, 5)
    assert all(x == pytest.approx(4 * y) for x, y in zip(a, b)), "one seed: the same pattern, time-scaled"
    assert a[0] == 0.0 and a == sorted(a)


def test_measure_capacity_is_a_full_batch_per_second():
    eng = TinyLab().engine("paged", max_num_seqs=3, max_model_len=128)
    steps_before = len(eng.step_records)
    t0 = time.perf_counter()
    cap = ls.measure_capacity(eng, PROMPTS, 5)
    wall = time.perf_counter() - t0
    assert cap >= 3 / wall, "3 requests (max_num_seqs) in at most the call's wall time"
    assert len(eng.step_records) > steps_before and not eng.has_unfinished()
    with pytest.raises(ValueError, match="output_tokens"):
        ls.measure_capacity(eng, PROMPTS, 0)


def test_representative_seed():
    seed = ls.representative_seed(6)
    t = ls.arrival_offsets(1.0, 6, seed)
    assert abs(t[-1] / 5 - 1.0) <= 0.1
    assert all(abs(ls.arrival_offsets(1.0, 6, s)[-1] / 5 - 1.0) > 0.1 for s in range(seed)), "the first such seed"
    assert ls.representative_seed(1) == 0
