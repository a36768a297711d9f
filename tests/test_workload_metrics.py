"""Workloads, metrics, the cost model and simulator, the charts and the bench CLI's
argument handling. No model is loaded here (the simulator runs the real schedulers on
a virtual clock), so everything is fast."""
from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from minillm.bench import compare
from minillm.viz import charts  # noqa: E402
from minillm.bench.cost_model import CostModel, simulate  # noqa: E402
from minillm.metrics import StepRecord, slot_accounting
from minillm.bench.summary import RunResult, format_table, percentiles, slot_utilization, summarize
from minillm.request import RequestMetrics  # noqa: E402
from minillm.bench.workload import WORKLOADS, make_workload, workload_from_lengths  # noqa: E402

# -- workloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_seeded(name):
    a, b = make_workload(name, 20, seed=3), make_workload(name, 20, seed=3)
    assert [(r.prompt_token_ids, r.max_tokens) for r in a] == [(r.prompt_token_ids, r.max_tokens) for r in b]
    c = make_workload(name, 20, seed=4)
    assert [r.prompt_token_ids for r in a] != [r.prompt_token_ids for r in c]
    for r in a:
        assert r.sampling_params().ignore_eos and r.sampling_params().greedy
        assert r.sampling_params().max_tokens == r.max_tokens >= 1


def test_skewed_is_the_barrel_effect():
    w = make_workload("skewed", 32, seed=0)
    outs = [r.max_tokens for r in w]
    for g in range(0, 32, 8):
        group = outs[g:g + 8]
        assert sum(o > 400 for o in group) == 1, f"group {g // 8} should hold exactly one long request: {group}"
        assert all(15 <= o <= 25 for o in group if o < 400)
    assert all(760 <= o <= 840 for o in outs if o > 400)


def test_uniform_lengths_are_equal():
    w = make_workload("uniform", 10, output_len=48)
    assert {r.max_tokens for r in w} == {48}


def test_prompts_from_the_tokenizer_have_the_asked_length():
    class Tok:  # a stand-in tokenizer: one token per character
        def __call__(self, text, add_special_tokens=False):
            return type("E", (), {"input_ids": [ord(c) for c in text]})()

    w = make_workload("chat", 8, seed=1, tokenizer=Tok())
    wl = make_workload("chat", 8, seed=1)
    assert [len(r.prompt_token_ids) for r in w] == [len(r.prompt_token_ids) for r in wl]
    assert all(bytes(r.prompt_token_ids).decode().endswith("Answer:") for r in w)


def test_poisson_arrivals():
    w = make_workload("uniform", 400, seed=0, rate=10.0)
    times = [r.arrival_time for r in w]
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)
    assert 0.08 < mean_gap < 0.12, f"mean gap {mean_gap:.3f}s should be ~1/rate = 0.1s"
    assert w.arrival == "poisson"
    assert all(r.arrival_time == 0.0 for r in make_workload("uniform", 5))


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="bursty"), "valid workloads: uniform, skewed, chat"),
    (dict(rate=-1.0), "rate must be"),
    (dict(arrival="poisson"), "needs rate > 0"),
    (dict(arrival="sometimes"), "valid arrivals"),
    (dict(num_requests=0), "num_requests"),
    (dict(nonsense=3), "bad parameter"),
])
def test_workload_bad_input(kwargs, match):
    args = dict(name="skewed", num_requests=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        make_workload(**args)


# -- metrics -----------------------------------------------------------------------------


def test_percentiles():
    p = percentiles(range(1, 101))
    assert p["p50"] == pytest.approx(50.5) and p["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert percentiles([3.0])["p95"] == 3.0


def test_slot_accounting_varlen_and_padded():
    # varlen: 3 rows (a 5-token prefill, 2 decodes) in 4 slots -> 7 useful + 1 empty slot
    assert slot_accounting([5, 1, 1], 4) == (8, 0, 1)
    # padded prefill: prompts 3 and 5 in a 4-slot batch -> [4, 5] rectangle
    assert slot_accounting([3, 5], 4, padded_width=5) == (20, 2, 2)
    # padded decode: 1 live row of 4 slots
    assert slot_accounting([1], 4, padded_width=1) == (4, 0, 3)


def test_request_metrics_definitions():
    m = RequestMetrics(arrival_time=1.0, first_token_time=3.0, token_times=[3.0, 3.5, 4.5], finish_time=4.5)
    assert m.ttft == 2.0 and m.e2e == 3.5
    assert m.itls == [0.5, 1.0] and m.tpot == pytest.approx(0.75)


def _step(i, new, slots, **kw):
    return StepRecord(i, float(i), i + 1.0, [str(k) for k in range(len(new))], new, len(new), len(new), 0,
                      num_slots=4, token_slots=slots, **kw)


def test_summary_has_the_documented_fields():
    steps = [_step(0, [3, 3], 8), _step(1, [1, 1], 4)]
    m = [RequestMetrics(0.0, 0.0, 1.0, [1.0, 2.0], 2.0), RequestMetrics(0.0, 0.0, 1.0, [1.0, 2.0], 2.0)]
    res = RunResult("continuous", m, [[1, 2], [3, 4]], steps, 0.0, 2.0, 4, 1000, [3, 3])
    s = summarize(res, workload="skewed")
    for key in ("engine", "workload", "num_requests", "output_tokens", "wall_s", "output_tokens_per_s",
                "forward_passes", "slot_utilization", "ttft_s", "tpot_s", "kv_reserved_bytes", "kv_used_bytes_peak"):
        assert key in s, key
    assert s["output_tokens"] == 4 and s["output_tokens_per_s"] == 2.0 and s["forward_passes"] == 2
    assert s["slot_utilization"] == pytest.approx(8 / 12)
    assert set(s["ttft_s"]) == {"p50", "p95", "p99"}
    json.dumps(s)
    assert "continuous" in format_table([s])


# -- cost model and simulator -------------------------------------------------------------


def test_cost_model_fit_recovers_coefficients():
    true = CostModel(0.02, 0.001, 1e-6, 2e-5, 0.003)
    steps = []
    for i, (new, ctx) in enumerate([([1] * 8, [300] * 8), ([1], [20]), ([40, 1], [40, 500]), ([1] * 4, [50, 900, 30, 60]),
                                    ([100], [100]), ([1] * 2, [700, 710]), ([7, 9, 1], [7, 9, 200])]):
        t = true.step_time(new, ctx, len(new))
        steps.append(StepRecord(i, 0.0, t, [], new, len(new), 0, 0, context_tokens=sum(ctx), max_context=max(ctx)))
    fit = CostModel.fit(steps)
    assert fit.coefficients == pytest.approx(true.coefficients, rel=1e-4, abs=1e-9)
    assert abs(fit.error(steps)) < 1e-6


def test_simulated_barrel_effect():
    w = make_workload("skewed", 16, seed=0, long_tokens=200)
    static, cont = simulate(w, "static", 8), simulate(w, "continuous", 8)
    assert static.output_tokens == cont.output_tokens == w.output_tokens
    assert len(cont.steps) < len(static.steps)
    assert slot_utilization(cont.steps) > 1.5 * slot_utilization(static.steps)
    # near-equal lengths: nothing to gain
    u = make_workload("uniform", 16, seed=0, output_len=32)
    assert len(simulate(u, "static", 8).steps) == len(simulate(u, "continuous", 8).steps)


def test_simulate_bad_input():
    w = make_workload("uniform", 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        simulate(w, "continuous", 0)
    with pytest.raises(ValueError, match="valid engines"):
        simulate(w, "turbo", 4)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        simulate(w, "continuous", 4, max_num_batched_tokens=3)


# -- charts --------------------------------------------------------------------------------


def test_charts_draw():
    w = workload_from_lengths([5, 9, 4], [3, 12, 2])
    runs = [simulate(w, "static", 2), simulate(w, "continuous", 2)]
    lanes = charts.assign_lanes(runs[0].steps)
    assert sorted(set(lanes.values())) == [0, 1]
    for r in runs:
        charts.plot_timeline(r)
        charts.plot_timeline(r, x="time")
    charts.plot_utilization(runs)
    charts.plot_kv_memory(runs)
    charts.plot_latency_cdfs(runs)
    charts.plot_throughput_vs_batch({"continuous": [(1, 10.0), (4, 30.0)]})
    import matplotlib.pyplot as plt
    plt.close("all")


def test_timeline_lanes_show_held_slots():
    w = workload_from_lengths([4, 4], [2, 6])
    r = simulate(w, "static", 2)
    held = [s.held_ids for s in r.steps]
    assert held[0] == [] and held[3] == ["0"]  # request 0 finished after step 1 but keeps its slot


# -- the bench CLI's argument handling (no engine runs) -----------------------------------------


def test_parse_engines():
    assert compare.parse_engines("all") == ["static", "continuous", "paged", "hf-generate", "hf-continuous"]
    assert compare.parse_engines("continuous, static") == ["continuous", "static"]
    assert compare.parse_engines("continuous,vllm") == ["continuous", "vllm"]  # a peer: named, never in 'all'
    with pytest.raises(ValueError, match="valid engines: static, continuous, paged, hf-generate, hf-continuous, vllm"):
        compare.parse_engines("continuous,sglang")


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "sglang"], "valid engines"),
    (["--workload", "bursty"], "invalid choice"),
    (["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (["--max-num-batched-tokens", "0"], "at least one token"),
    (["--max-num-batched-tokens", "4"], "smaller than max_num_seqs=8"),
    (["--request-rate", "-2"], "request rate must be >= 0"),
    (["--workload-param", "long_tokens"], "KEY=VALUE"),
])
def test_bench_bad_arguments(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        compare.main(argv + ["--dummy-weights"])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_bench_help_names_the_prog(capsys):
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    out = capsys.readouterr().out
    assert "python -m minillm bench" in out and "--max-num-batched-tokens" in out


def test_explorer_redraws_and_confirms():
    pytest.importorskip("ipywidgets")
    calls = []

    def confirm(settings):
        calls.append(settings)
        wl = make_workload("skewed", settings["num_requests"], settings["seed"], long_tokens=settings["long_tokens"])
        return simulate(wl, settings["engine"], settings["max_num_seqs"])

    ui = charts.explorer(CostModel(), num_requests=8, confirm=confirm)
    controls = {w.description: w for box in ui.children[:2] for w in box.children}
    controls["max batch"].value = 4  # a slider move redraws from the cost model
    controls["engine"].value = "static"
    button, note = ui.children[2].children
    button.click()
    assert calls and calls[-1]["max_num_seqs"] == 4 and calls[-1]["engine"] == "static"
    assert "measured" in note.value and "simulated" in note.value
    import matplotlib.pyplot as plt
    plt.close("all")


@pytest.mark.parametrize("name, params, match", [
    ("uniform", dict(prompt_len=0), "prompt_len must be an integer >= 4"),
    ("uniform", dict(prompt_len=3), "prompt_len must be an integer >= 4"),
    ("uniform", dict(prompt_len=2.5), "prompt_len must be an integer"),
    ("uniform", dict(output_len=2.5), "output_len must be an integer >= 1"),
    ("uniform", dict(output_len=True), "output_len"),
    ("skewed", dict(prompt_len=2), "prompt_len must be an integer >= 3"),
    ("skewed", dict(long_every=0), "long_every"),
    ("skewed", dict(long_tokens="800"), "long_tokens"),
    ("chat", dict(prompt_median=0), "prompt_median must be a number > 0"),
    ("chat", dict(output_median=float("nan")), "output_median"),
    ("long-prompt-arrival", dict(num_long=1.5), "num_long must be an integer"),
    ("long-prompt-arrival", dict(arrival_gap_s=-1), "arrival_gap_s must be a number >= 0"),
    ("grounded", dict(output_len=0), "output_len"),
    ("skewed", dict(prompt_lenn=4), "unknown prompt_lenn; valid parameters: short_tokens, long_tokens"),
])
def test_workload_params_are_checked_by_name(name, params, match):
    with pytest.raises(ValueError, match=match):
        make_workload(name, 8, **params)


def test_workload_param_table_matches_the_length_functions():
    import inspect

    from minillm.bench.workload import WORKLOAD_PARAMS

    for name, fn in WORKLOADS.items():
        assert list(inspect.signature(fn).parameters)[2:] == list(WORKLOAD_PARAMS[name]), name
    # The lowest accepted values still build (and int values are fine for float parameters).
    make_workload("uniform", 8, prompt_len=4, output_len=1)
    make_workload("skewed", 8, prompt_len=3, short_tokens=1, long_tokens=1, long_every=1)
    make_workload("chat", 8, prompt_median=0.5, output_median=1, max_prompt=1, max_output=1)
    make_workload("long-prompt-arrival", 8, first_arrival_s=0, arrival_gap_s=0, num_long=1)
