"""The open-loop load generator: arrivals, statistics and goodput by hand, then runs against
a live server. The server runs a tiny Llama with seeded weights and SmolLM2's tokenizer:
the generator only sees HTTP, ignore_eos makes every length exact, and the model loads in
a second instead of the real one's fifteen."""
import json
import math
import random

import pytest

from minillm.bench.loadgen import (LoadRequest, LoadResult, format_table, goodput, load_trace, main, make_requests,
                                  meets_slo, percentile, poisson_arrivals, run_load, run_load_async, sweep)


# -- arrivals and statistics (no server) ------------------------------------------------------

def test_poisson_arrivals_are_seeded_increasing_and_have_the_right_mean_gap():
    a = poisson_arrivals(4.0, 4000, seed=3)
    assert a == poisson_arrivals(4.0, 4000, seed=3) and a != poisson_arrivals(4.0, 4000, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = sum(gaps) / len(gaps)
    # Exponential gaps: the mean of n has standard deviation (1/rate)/sqrt(n); allow 5 of them.
    assert abs(mean - 0.25) < 5 * 0.25 / math.sqrt(len(gaps))
    # ... and a coefficient of variation of 1 (a regular grid would have 0).
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert 0.9 < sd / mean < 1.1


@pytest.mark.parametrize("rate", [0, -1, float("inf"), "2", True])
def test_poisson_arrivals_reject_bad_rates(rate):
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(rate, 10)


def test_percentile_matches_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    xs = [rng.expovariate(1.0) for _ in range(101)]
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None and percentile([2.0], 99) == 2.0


def _rec(arrival, ttft, tpot, e2e, ok=True, n=10):
    return {"arrival": arrival, "lag": 0.0, "ttft": ttft, "tpot": tpot, "itls": [], "e2e": e2e, "ok": ok,
            "output_tokens": n}


def test_goodput_counts_finished_requests_within_both_slos():
    recs = [_rec(0.0, 0.5, 0.1, 1.5),          # meets both
            _rec(0.5, 1.5, 0.1, 2.0),          # TTFT too slow
            _rec(1.0, 0.2, 0.3, 3.0),          # TPOT too slow
            _rec(1.0, 0.2, None, 0.2, n=1),    # one token: no TPOT, meets TTFT
            _rec(1.5, 0.1, 0.05, None, ok=False)]  # failed: never counts
    assert [meets_slo(r, 1.0, 0.2) for r in recs] == [True, False, False, True, False]
    # Span: first arrival 0.0 to the last end (1.0 + 3.0 = 4.0 s).
    assert goodput(recs, 1.0, 0.2) == pytest.approx(2 / 4.0)
    assert goodput(recs, 10.0, 10.0) == pytest.approx(4 / 4.0)
    assert goodput(recs, 1.0, 0.2, duration=8.0) == pytest.approx(2 / 8.0)
    res = LoadResult("u", 2.0, recs, 4.0)
    s = res.summary()
    assert (s["num_ok"], s["num_failed"], s["goodput"], s["slo_attainment"]) == (4, 1, 0.5, 0.4)
    assert s["throughput_tok_s"] == pytest.approx(31 / 4.0) and s["ttft_p50"] == pytest.approx(0.35)
    for key in ("rate", "throughput_tok_s", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "itl_p95", "e2e_p50",
                "goodput", "num_ok", "num_failed"):
        assert key in s
    table = format_table([res])
    assert "goodput" in table and len(table.splitlines()) == 4


def test_requests_the_server_pushed_back_are_counted():
    """HTTP 429 (the server's queue full) fails the request and is counted apart."""
    recs = [_rec(0.0, 0.5, 0.1, 1.5), {**_rec(0.1, None, None, None, ok=False, n=0), "status": 429},
            {**_rec(0.2, None, None, None, ok=False, n=0), "status": 429},
            {**_rec(0.3, None, None, None, ok=False, n=0), "status": 400}]
    s = LoadResult("u", 2.0, recs, 2.0).summary()
    assert (s["num_ok"], s["num_failed"], s["num_rejected"]) == (1, 3, 2)
    head, _, row = format_table(LoadResult("u", 2.0, recs, 2.0)).splitlines()[:3]
    assert "429" in head.split() and row.split()[3] == "2"
    assert LoadResult("u", 2.0, [_rec(0.0, 0.5, 0.1, 1.5)], 2.0).summary()["num_rejected"] == 0  # no status: none


def test_trace_is_parsed_sorted_and_checked(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 0.5, "prompt": "hi", "output_tokens": 3}\n\n'
                    '{"arrival": 0.0, "prompt_tokens": 7, "max_tokens": 2}\n')
    reqs = load_trace(path)
    assert [r.arrival for r in reqs] == [0.0, 0.5] and [r.output_tokens for r in reqs] == [2, 3]
    assert len(reqs[0].prompt) == 7 and all(isinstance(t, int) for t in reqs[0].prompt) and reqs[1].prompt == "hi"
    for line, mention in [('{"prompt": "x", "output_tokens": 2}', "arrival"),
                          ('{"arrival": 0, "prompt": "x", "output_tokens": 0}', "output_tokens"),
                          ('{"arrival": 0, "output_tokens": 2}', "prompt_tokens"),
                          ("not json", "JSON")]:
        path.write_text('{"arrival": 0, "prompt": "ok", "output_tokens": 1}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"t.jsonl:2: .*{mention}|t.jsonl:2: not valid {mention}"):
            load_trace(path)
    with pytest.raises(ValueError, match="does not exist"):
        load_trace(tmp_path / "missing.jsonl")


def test_make_requests_cycles_prompts_and_checks_lengths():
    reqs = make_requests(5, 4, ["a", "b"], seed=1)
    assert sorted(r.prompt for r in reqs) == ["a", "a", "a", "b", "b"] and {r.output_tokens for r in reqs} == {4}
    assert [r.output_tokens for r in make_requests(3, [1, 2, 3])] == [1, 2, 3]
    with pytest.raises(ValueError, match="output"):
        make_requests(2, 0)
    with pytest.raises(ValueError, match="prompts"):
        make_requests(2, 3, [""])
    with pytest.raises(ValueError, match=r"give rate .* or trace"):
        run_load("http://127.0.0.1:9")


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(ValueError, match="could not list the models"):
        run_load("http://127.0.0.1:9", rate=1.0, num_requests=1)


# -- against a live server --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    from minillm import EngineConfig, ModelConfig
    from minillm.engine import build_engine
    from minillm.serving.async_llm import AsyncLLM
    from minillm.serving.server import serve_in_background

    tiny = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32)
    config = EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8)
    llm = AsyncLLM(build_engine(config, model_config=tiny))
    with serve_in_background(async_llm=llm) as handle:
        yield handle
    llm.shutdown()


@pytest.mark.slow
def test_poisson_run_has_exact_lengths_and_consistent_summary(server):
    res = run_load(server.url, rate=8.0, num_requests=12, output_tokens=6, seed=1)
    s = res.summary()
    assert (s["num_ok"], s["num_failed"]) == (12, 0), res.errors
    for r in res.records:
        assert r["output_tokens"] == 6 and r["finish_reason"] == "length"
        assert 0 < r["ttft"] <= r["e2e"] and 1 <= len(r["itls"]) + 1 <= 6
        # The server may send several tokens in one chunk when the client reads late; all six
        # in one chunk arrive at one instant, so the client sees them 0 s apart.
        assert r["tpot"] > 0 if r["itls"] else r["tpot"] == 0.0, (r["tpot"], r["itls"])
        assert 0 <= r["lag"] < 0.5  # sent on time: the run is open-loop
    assert s["throughput_tok_s"] * s["duration_s"] == pytest.approx(72)
    assert s["ttft_p50"] <= s["ttft_p95"] <= s["ttft_p99"] and s["e2e_p50"] <= s["e2e_p99"]
    assert goodput(res.records, 1e9, 1e9, s["duration_s"]) == pytest.approx(s["throughput_req_s"])
    assert goodput(res.records, 1e-9, 1e-9) == 0.0
    # The offered rate was sent: 12 arrivals span about 11 / 8 s (Poisson, so loosely).
    assert res.records[-1]["arrival"] == pytest.approx(max(poisson_arrivals(8.0, 12, 1)))


@pytest.mark.slow
def test_sweep_and_trace_replay(server, tmp_path):
    results = sweep(server.url, [4.0, float("inf")], num_requests=4, output_tokens=3, seed=2)
    assert [r.rate for r in results] == [4.0, float("inf")]
    assert all(r.summary()["num_ok"] == 4 for r in results)
    assert all(rec["arrival"] == 0.0 for rec in results[1].records)  # a burst
    assert len(format_table(results).splitlines()) == 5
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(d) for d in [
        {"arrival": 0.0, "prompt": "Explain how a rainbow forms.", "output_tokens": 4},
        {"arrival": 0.3, "prompt_tokens": 40, "output_tokens": 2},
        {"arrival": 0.6, "prompt": "Why do cats purr?", "output_tokens": 10_000},  # beyond max_model_len
    ]))
    res = run_load(server.url, trace=trace)
    s = res.summary()
    assert (s["num_ok"], s["num_failed"]) == (2, 1) and s["rate"] is None
    bad = [r for r in res.records if not r["ok"]][0]
    assert "HTTP 400" in bad["error"] and "max_tokens" in bad["error"]
    ok = sorted((r for r in res.records if r["ok"]), key=lambda r: r["arrival"])
    assert [r["output_tokens"] for r in ok] == [4, 2] and ok[1]["prompt_tokens"] == 40


@pytest.mark.slow
def test_run_load_async_with_explicit_arrivals(server):
    import asyncio

    reqs = [LoadRequest("Hello there", 3), LoadRequest([100, 200, 300], 2)]
    res = asyncio.run(run_load_async(server.url + "/v1", reqs, [0.0, 0.2]))
    assert [r["output_tokens"] for r in res.records] == [3, 2] and res.records[1]["prompt_tokens"] == 3
    assert res.model == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_command_line_prints_a_table_and_writes_json(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    rc = main(["--url", server.url, "--rate", "20", "--num-requests", "4", "--output-tokens", "3", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "TTFT p50" in printed and "goodput" in printed
    data = json.loads(out.read_text())
    assert len(data) == 1 and data[0]["summary"]["num_ok"] == 4 and len(data[0]["records"]) == 4


@pytest.mark.slow
def test_workload_prompts_come_as_text_with_their_lengths(server):
    from minillm.bench.workload import make_workload
    from minillm.loader import load_tokenizer

    reqs = make_requests(4, prompts="skewed", seed=3)
    wl = make_workload("skewed", 4, seed=3, tokenizer=load_tokenizer())
    assert [r.output_tokens for r in reqs] == [w.max_tokens for w in wl.requests]
    assert all(isinstance(r.prompt, str) and r.prompt for r in reqs)
    assert [r.output_tokens for r in make_requests(4, 5, prompts="skewed")] == [5] * 4
    with pytest.raises(ValueError, match="unknown workload"):
        make_requests(2, prompts="no-such-workload")
