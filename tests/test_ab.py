"""A/B on one trace (minillm/bench/ab.py, loadgen.run_ab) and the server's trace recorder
(minillm/serving/trace_recorder.py).

The statistics are checked by hand on samples whose answer is known (no server); then two
in-process servers, each a tiny Llama with seeded weights and SmolLM2's tokenizer, run the
A/B command and a record -> replay round trip. No assert here depends on how fast anything runs.
"""
import json

import numpy as np
import pytest

from minillm.bench import ab
from minillm.bench.ab import ABRow, ab_to_json, bootstrap_diff, compare, format_ab_table, verdict
from minillm.bench.loadgen import (LoadResult, _parser, ab_order, load_trace, main, meets_slo, run_ab, run_load)
from minillm.serving.trace_recorder import TraceRecorder


# -- the bootstrap ------------------------------------------------------------------------------

def test_the_interval_covers_a_known_difference_about_as_often_as_it_says():
    """Normal(10, 1) against Normal(12, 1): the medians differ by exactly 2. Over 40 seeded draws
    the 95% interval should hold 2 about 38 times; the bootstrap of a median runs a little
    narrow at n=60, so at least 33 (a coverage far below 95% would fail)."""
    covered = 0
    for s in range(40):
        rng = np.random.default_rng(s)
        a, b = rng.normal(10, 1, 60).tolist(), rng.normal(12, 1, 60).tolist()
        diff, (low, high) = bootstrap_diff(a, b, 50, n_boot=500, seed=s)
        assert low <= diff <= high
        covered += low <= 2.0 <= high
        assert verdict((low, high)) == "worse"  # B's latencies are 2 higher: worse, every time
    assert covered >= 33, covered


def test_identical_samples_are_no_difference():
    rng = np.random.default_rng(0)
    a = rng.lognormal(0, 0.5, 50).tolist()
    for q in (50, 95, 99, "mean"):
        diff, ci = bootstrap_diff(a, a, q)
        assert diff == 0.0 and ci[0] <= 0 <= ci[1] and verdict(ci) == "no difference"
    assert bootstrap_diff([1.0] * 5, [1.0] * 5, 50) == (0.0, (0.0, 0.0))  # no spread at all: still no difference
    assert verdict((0.0, 0.0)) == "no difference"


def test_clearly_shifted_samples_are_better_or_worse():
    rng = np.random.default_rng(1)
    a = rng.lognormal(0, 0.3, 40)
    _, ci_up = bootstrap_diff(a.tolist(), (a + 1.0).tolist(), 95)
    _, ci_down = bootstrap_diff(a.tolist(), (a * 0.5).tolist(), 50)
    assert ci_up[0] > 0 and ci_down[1] < 0
    assert verdict(ci_up) == "worse" and verdict(ci_down) == "better"  # latencies: lower is better
    assert verdict(ci_up, lower_is_better=False) == "better" and verdict(ci_down, lower_is_better=False) == "worse"


def test_the_same_seed_gives_the_same_interval():
    rng = np.random.default_rng(2)
    a, b = rng.exponential(1, 30).tolist(), rng.exponential(1.2, 30).tolist()
    assert bootstrap_diff(a, b, 95, seed=7) == bootstrap_diff(a, b, 95, seed=7)
    assert bootstrap_diff(a, b, 95, seed=7) != bootstrap_diff(a, b, 95, seed=8)
    assert bootstrap_diff(a, b, 95, conf=0.5)[1][1] - bootstrap_diff(a, b, 95, conf=0.5)[1][0] < \
        bootstrap_diff(a, b, 95, conf=0.99)[1][1] - bootstrap_diff(a, b, 95, conf=0.99)[1][0]


def test_groups_are_drawn_whole():
    """ITLs: one list per request. Drawing requests (and pooling their gaps) sees that the gaps of
    one request move together; drawing gaps one by one would give a far narrower interval."""
    rng = np.random.default_rng(3)
    # 20 requests per side, 30 gaps each; each request has its own level (its batch, its neighbours).
    a = [(rng.normal(1.0, 0.3) + rng.normal(0, 0.02, 30)).tolist() for _ in range(20)]
    b = [(rng.normal(1.0, 0.3) + rng.normal(0, 0.02, 30)).tolist() for _ in range(20)]
    _, (lo_g, hi_g) = bootstrap_diff(a, b, 50)
    _, (lo_f, hi_f) = bootstrap_diff(sum(a, []), sum(b, []), 50)
    assert hi_g - lo_g > 2 * (hi_f - lo_f)
    assert verdict(bootstrap_diff(a, a, 95)[1]) == "no difference"
    assert verdict(bootstrap_diff(a, [[x + 1.0 for x in g] for g in a], 95)[1]) == "worse"
    # A request with no gaps (one token) drops out; the diff is on the pooled values.
    assert bootstrap_diff([[1.0, 2.0], []], [[2.0, 3.0]], 50)[0] == pytest.approx(1.0)


def test_replays_that_disagree_widen_the_interval():
    """Two replays per side, each at its own level (the machine ran one slower): drawing only
    requests sees 30 tight values per replay and calls the sides different; drawing the
    replays too sees that the levels move from replay to replay, and does not."""
    rng = np.random.default_rng(4)

    def side(levels):
        return [float(level + rng.normal(0, 0.02)) for level in levels for _ in range(30)]

    a, b = side([1.0, 1.2]), side([1.1, 1.25])
    runs = [0] * 30 + [1] * 30
    _, flat_ci = bootstrap_diff(a, b, "mean")
    _, two_level_ci = bootstrap_diff(a, b, "mean", runs_a=runs, runs_b=runs)
    assert verdict(flat_ci) == "worse" and verdict(two_level_ci) == "no difference"
    assert two_level_ci[1] - two_level_ci[0] > 5 * (flat_ci[1] - flat_ci[0])
    # A real effect, far larger than the replays' disagreement, still shows.
    far = side([2.0, 2.2])
    for q in ("mean", 50, 95):
        assert verdict(bootstrap_diff(a, far, q, runs_a=runs, runs_b=runs)[1]) == "worse"
    with pytest.raises(ValueError, match="runs_a"):
        bootstrap_diff(a, b, 50, runs_a=[0, 1])


@pytest.mark.parametrize("kwargs, match", [
    (dict(a=[], b=[1.0], q=50), "a has no values"),
    (dict(a=[1.0], b=[float("nan")], q=50), r"b\[0\]"),
    (dict(a=[1.0], b=[1.0], q=101), "percentile"),
    (dict(a=[1.0], b=[1.0], q=50, conf=1.0), "conf"),
    (dict(a=[1.0], b=[1.0], q=50, n_boot=0), "n_boot"),
    (dict(a="abc", b=[1.0], q=50), "sequence"),
])
def test_bad_input_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bootstrap_diff(**kwargs)


@pytest.mark.parametrize("ci", [(1.0, -1.0), (float("nan"), 1.0), "ab", (1.0,)])
def test_verdict_rejects_what_is_not_an_interval(ci):
    with pytest.raises(ValueError, match="ci"):
        verdict(ci)


# -- comparing two runs -----------------------------------------------------------------------------

def _result(seed, shift=0.0, n=40, slo_ttft=1.0, slo_tpot=0.2):
    rng = np.random.default_rng(seed)
    recs = []
    for i in range(n):
        ttft = float(rng.lognormal(-1.5, 0.4)) + shift
        itls = (rng.lognormal(-3.0, 0.2, 7) + shift / 10).tolist()
        recs.append({"index": i, "arrival": i * 0.1, "lag": 0.0, "ttft": ttft, "tpot": sum(itls) / len(itls),
                     "itls": itls, "e2e": ttft + sum(itls), "output_tokens": 8, "ok": True, "status": 200})
    return LoadResult("http://x", None, recs, 5.0, slo_ttft, slo_tpot, label="trace t")


def test_compare_gives_one_row_per_metric_with_verdicts():
    a, a2, worse = _result(0), _result(1), _result(0, shift=0.5)
    rows = compare(a, worse, n_boot=500)
    assert [r.metric for r in rows] == [m[0] for m in ab.METRICS] + [m[0] for m in ab.RATES]
    by = {r.metric: r for r in rows}
    for name in ("TTFT p50", "TTFT p95", "TPOT p50", "ITL p50", "E2E p50"):
        assert by[name].verdict == "worse" and by[name].diff > 0, by[name]
    assert by["SLO attainment"].lower_is_better is False
    assert by["throughput"].verdict == "n/a" and by["throughput"].ci_low is None
    assert {r.verdict for r in compare(worse, a, n_boot=500)[:9]} == {"better"}
    same = compare(a, a, n_boot=500)
    assert all(r.verdict in ("no difference", "n/a") for r in same) and all(r.diff in (0.0, None) for r in same)
    # Reproducible, and rounds pool: two results per side count both's requests.
    assert compare(a, a2, n_boot=300, seed=4) == compare(a, a2, n_boot=300, seed=4)
    assert compare([a, a2], [a2, a], n_boot=200)[0].n_a == 80


def test_slo_attainment_counts_as_loadgen_does():
    res = _result(5, n=30, slo_ttft=0.25, slo_tpot=0.05)
    res.records[0] = {**res.records[0], "ok": False, "ttft": None, "tpot": None, "e2e": None, "itls": []}
    expected = sum(meets_slo(r, 0.25, 0.05) for r in res.records) / 30
    row = {r.metric: r for r in compare(res, res, n_boot=50)}["SLO attainment"]
    assert row.a == pytest.approx(expected) == pytest.approx(res.summary()["slo_attainment"])
    assert 0 < expected < 1


def test_table_and_json_have_every_row():
    rows = compare(_result(0), _result(0, shift=0.3), n_boot=200)
    table = format_ab_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows) + 1 and "95% CI" in lines[0] and "verdict" in lines[0]
    assert "TTFT p95 (ms)" in table and "worse" in table and "n/a" in table
    few = format_ab_table(compare(_result(0, n=5), _result(1, n=5), n_boot=100))
    assert "only 5 requests on a side" in few.splitlines()[-1] and "only" not in table
    data = json.loads(json.dumps(ab_to_json(rows, url_a="a", url_b="b")))
    assert data["url_a"] == "a" and len(data["rows"]) == len(rows)
    assert set(data["rows"][0]) == set(ABRow.__dataclass_fields__)


def test_compare_rejects_what_is_not_a_load_result():
    with pytest.raises(ValueError, match="LoadResult"):
        compare({"records": []}, _result(0))


def test_the_measure_tallies_verdicts_per_metric():
    from minillm.bench.ab_measure import format_tally, tally

    rows = [compare(_result(s), _result(s, shift=0.5 * (s % 2)), n_boot=100) for s in range(4)]
    counts = tally([{"rows": r} for r in rows])
    assert set(counts) == {m[0] for m in ab.METRICS}  # rates have no verdict to count
    assert counts["TTFT p50"]["worse"] == 2 and counts["TTFT p50"]["no difference"] == 2
    assert len(format_tally(counts, 4).splitlines()) == 1 + len(ab.METRICS)


# -- the command line ---------------------------------------------------------------------------------

def test_two_urls_parse_as_an_ab():
    args = _parser().parse_args(["--url", "http://a", "--url", "http://b", "--trace", "t.jsonl", "--rounds", "2"])
    assert args.url == ["http://a", "http://b"] and args.rounds == 2
    assert _parser().parse_args(["--url", "http://a", "--rate", "1"]).url == ["http://a"]
    assert ab_order(1) == ["A", "B"] and ab_order(3) == ["A", "B", "B", "A", "A", "B"]
    with pytest.raises(ValueError, match="rounds"):
        ab_order(0)


@pytest.mark.parametrize("argv, match", [
    (["--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:9", "--rate", "1"],
     "3 times"),
    (["--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:9", "--sweep", "1,2"], "--sweep"),
    (["--url", "http://127.0.0.1:9", "--rate", "1", "--rounds", "2"], "--rounds is for an A/B"),
    (["--url", "http://127.0.0.1:9", "--rate", "1", "--no-warmup"], "--no-warmup is for an A/B"),
    (["--url", "http://127.0.0.1:9", "--url", "http://127.0.0.1:9", "--rate", "1", "--rounds", "0"], "--rounds"),
])
def test_bad_ab_flags_fail_before_any_request(argv, match):
    with pytest.raises(ValueError, match=match):
        main(argv)


# -- the trace recorder (a clock of its own: offsets are exact) ------------------------------------------

class _Stream:
    def __init__(self, produced, reason="length"):
        self.request = type("R", (), {"num_output_tokens": produced, "finish_reason": reason})()


def test_the_recorder_writes_what_load_trace_reads(tmp_path):
    now = iter([100.0, 100.5, 101.25])
    rec = TraceRecorder(tmp_path / "t.jsonl", clock=lambda: next(now))
    s1, s2, s3 = _Stream(4), _Stream(7, "stop"), _Stream(0, "abort")
    rec.start(s1, rec.arrived(), prompt="Hello there", max_tokens=4)
    rec.start(s2, rec.arrived(), messages=[{"role": "user", "content": "Hi!"}], max_tokens=None)
    rec.start(s3, rec.arrived(), prompt=[101, 102, 103], max_tokens=5)
    rec.end(s2)  # lines come in the order requests end...
    rec.end(s1)
    rec.end(s1)  # (idempotent)
    rec.close()  # ... and what is still open at close is written as far as it got
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [x["arrival"] for x in lines] == [0.5, 0.0, 1.25] and rec.num_written == 3
    assert lines[0]["output_tokens"] == 7 and lines[0]["max_tokens"] is None and lines[0]["finish_reason"] == "stop"
    assert lines[2]["output_tokens"] == 1  # aborted before its first token: replayed with one
    reqs = load_trace(tmp_path / "t.jsonl")  # ... which sorts them by arrival
    assert [r.arrival for r in reqs] == [0.0, 0.5, 1.25]
    assert [r.prompt for r in reqs] == ["Hello there", [{"role": "user", "content": "Hi!"}], [101, 102, 103]]
    assert [r.output_tokens for r in reqs] == [4, 7, 1]


def test_the_recorder_path_is_checked(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        TraceRecorder(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        TraceRecorder(tmp_path / "missing" / "t.jsonl")


def test_trace_messages_are_checked(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0, "messages": [{"role": "user"}], "output_tokens": 2}\n')
    with pytest.raises(ValueError, match="t.jsonl:1: 'messages'"):
        load_trace(path)


def test_serve_takes_record_trace_before_the_weights_load(tmp_path):
    from minillm.serving.cli import _serve_parser, main as serve_main

    assert _serve_parser().parse_args(["--record-trace", "t.jsonl"]).record_trace == "t.jsonl"
    with pytest.raises(ValueError, match="does not exist"):
        serve_main(["--port", "0", "--record-trace", str(tmp_path / "missing" / "t.jsonl")])


# -- against two live servers ---------------------------------------------------------------------------

def _tiny_llm():
    from minillm import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.serving.async_llm import AsyncLLM

    tiny = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
    config = EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8)
    return AsyncLLM(build_engine(config, model_config=tiny))


@pytest.fixture(scope="module")
def two_servers():
    from minillm.serving.server import serve_in_background

    llms = [_tiny_llm(), _tiny_llm()]
    a = serve_in_background(async_llm=llms[0])
    b = serve_in_background(async_llm=llms[1])
    yield a, b
    a.stop()
    b.stop()
    for llm in llms:
        llm.shutdown()


def test_ab_command_against_two_servers(two_servers, tmp_path, capsys):
    a, b = two_servers
    out = tmp_path / "ab.json"
    rc = main(["--url", a.url, "--url", b.url, "--rate", "inf", "--num-requests", "5", "--output-tokens", "3",
               "--rounds", "2", "--n-boot", "200", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr()
    assert printed.out.count("TTFT p50") == 3 and "verdict" in printed.out and "95% CI" in printed.out
    assert [line[:4] for line in printed.err.splitlines() if line.startswith("[")] == ["[A1]", "[B1]", "[B2]", "[A2]"]
    data = json.loads(out.read_text())
    assert len(data["a"]) == len(data["b"]) == 2 and data["ab"]["order"] == "ABBA"
    assert all(run["summary"]["num_ok"] == 5 for run in data["a"] + data["b"])
    assert [r["metric"] for r in data["ab"]["rows"]][:3] == ["TTFT p50", "TTFT p95", "TTFT p99"]
    assert {r["verdict"] for r in data["ab"]["rows"]} <= {"better", "worse", "no difference", "n/a"}


def test_both_sides_get_the_same_requests(two_servers):
    a, b = two_servers
    runs_a, runs_b = run_ab(a.url, b.url, rate=50.0, num_requests=4, output_tokens=2, seed=3, warmup=False)
    (ra,), (rb,) = runs_a, runs_b
    assert [r["arrival"] for r in ra.records] == [r["arrival"] for r in rb.records]
    assert [r["prompt_tokens"] for r in ra.records] == [r["prompt_tokens"] for r in rb.records]
    assert ra.url == a.url and rb.url == b.url


def test_recorded_traffic_replays_as_it_came(two_servers, tmp_path):
    """A hand-written trace (text, token ids, a chat) sent to a recording server comes back as
    the same requests in the same order, and replays on another server."""
    import httpx

    from minillm.serving.server import serve_in_background

    a, b = two_servers
    sent = [{"arrival": 0.0, "prompt": "Explain how a rainbow forms.", "output_tokens": 4},
            {"arrival": 0.2, "prompt": [300, 301, 302, 303, 304], "output_tokens": 2},
            {"arrival": 0.4, "messages": [{"role": "user", "content": "Why do cats purr?"}], "output_tokens": 3}]
    trace, recorded = tmp_path / "sent.jsonl", tmp_path / "recorded.jsonl"
    trace.write_text("\n".join(json.dumps(d) for d in sent))
    with serve_in_background(async_llm=a.llm, record_trace=recorded) as recording:  # A's engine, a second app
        res = run_load(recording.url, trace=trace)
        assert res.summary()["num_ok"] == 3, res.errors
        # A non-streaming request is recorded the same way.
        r = httpx.post(recording.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200
    got = load_trace(recorded)
    assert [g.prompt for g in got] == [d.get("prompt", d.get("messages")) for d in sent] + ["Hi"]
    assert [g.output_tokens for g in got] == [4, 2, 3, 2]
    assert got[0].arrival == 0.0 and all(x.arrival < y.arrival for x, y in zip(got, got[1:]))
    replay = run_load(b.url, trace=recorded)
    assert replay.summary()["num_ok"] == 4, replay.errors
    assert [r["output_tokens"] for r in sorted(replay.records, key=lambda r: r["arrival"])] == [4, 2, 3, 2]
    chat = [r for r in res.records if r["arrival"] == 0.4][0]
    assert chat["output_tokens"] == 3 and chat["prompt_tokens"] > 5  # the chat template was applied
