"""Dashboards on any OpenAI-compatible server: ``MetricsSource`` reads vLLM's and SGLang's
/metrics as well as minillm's, says which server it is (``flavor``), marks what a server does
not export as n/a (None) and never crashes on it; and the Grafana dashboard in docs/grafana/
uses only metric names that minillm's server or vLLM export.

The vLLM page below is modelled on the /metrics page of vLLM 0.32's OpenAI server (the CPU
build ``make peer-vllm`` installs): ``# HELP`` / ``# TYPE`` lines, every series labelled ``engine`` and
``model_name`` (two engines here, as a data-parallel server has), ``_created`` samples next to
counters, histograms as ``_bucket{le=...}`` / ``_count`` / ``_sum``, and the KV cache's size
only as a label of ``vllm:cache_config_info``. No model runs in this file.
"""
from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from string import Template
from types import SimpleNamespace

import pytest

from minillm.viz.dashboard import (PANELS, Dashboard, MetricsSource, detect_flavor, headline, missing_panels,
                                   parse_metrics)

JPEG = b"\xff\xd8"
GRAFANA = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "minillm-dashboard.json"

VLLM_PAGE = Template('''\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="SmolLM2-135M-Instruct"} $run0
vllm:num_requests_running{engine="1",model_name="SmolLM2-135M-Instruct"} $run1
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} $wait0
vllm:num_requests_waiting{engine="1",model_name="SmolLM2-135M-Instruct"} $wait1
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} $kv0
vllm:kv_cache_usage_perc{engine="1",model_name="SmolLM2-135M-Instruct"} $kv1
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="SmolLM2-135M-Instruct"} $queries
vllm:prefix_cache_queries_total{engine="1",model_name="SmolLM2-135M-Instruct"} $queries
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.7963909410524597e+09
vllm:prefix_cache_queries_created{engine="1",model_name="SmolLM2-135M-Instruct"} 1.7963909410524597e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="SmolLM2-135M-Instruct"} $hits0
vllm:prefix_cache_hits_total{engine="1",model_name="SmolLM2-135M-Instruct"} 300.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="SmolLM2-135M-Instruct"} $preempt0
vllm:num_preemptions_total{engine="1",model_name="SmolLM2-135M-Instruct"} 0.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="SmolLM2-135M-Instruct"} 1.7963909410525513e+09
vllm:num_preemptions_created{engine="1",model_name="SmolLM2-135M-Instruct"} 1.7963909410525513e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} $queries
vllm:prompt_tokens_total{engine="1",model_name="SmolLM2-135M-Instruct"} $queries
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="SmolLM2-135M-Instruct"} $gen0
vllm:generation_tokens_total{engine="1",model_name="SmolLM2-135M-Instruct"} $gen1
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="SmolLM2-135M-Instruct"} 10.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="SmolLM2-135M-Instruct"} $len0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="SmolLM2-135M-Instruct"} 0.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="SmolLM2-135M-Instruct"} $stop1
vllm:request_success_total{engine="1",finished_reason="length",model_name="SmolLM2-135M-Instruct"} $len1
vllm:request_success_total{engine="1",finished_reason="abort",model_name="SmolLM2-135M-Instruct"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="SmolLM2-135M-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="SmolLM2-135M-Instruct"} $ttft0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="SmolLM2-135M-Instruct"} $ttft0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="SmolLM2-135M-Instruct"} $ttft0
vllm:time_to_first_token_seconds_count{engine="0",model_name="SmolLM2-135M-Instruct"} $ttft0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="SmolLM2-135M-Instruct"} 1.5
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.1",model_name="SmolLM2-135M-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="0.5",model_name="SmolLM2-135M-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="1",le="1.0",model_name="SmolLM2-135M-Instruct"} $ttft1
vllm:time_to_first_token_seconds_bucket{engine="1",le="+Inf",model_name="SmolLM2-135M-Instruct"} $ttft1
vllm:time_to_first_token_seconds_count{engine="1",model_name="SmolLM2-135M-Instruct"} $ttft1
vllm:time_to_first_token_seconds_sum{engine="1",model_name="SmolLM2-135M-Instruct"} 2.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.05",model_name="SmolLM2-135M-Instruct"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.1",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_count{engine="0",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="SmolLM2-135M-Instruct"} 75.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.05",model_name="SmolLM2-135M-Instruct"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="1",le="0.1",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_bucket{engine="1",le="+Inf",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_count{engine="1",model_name="SmolLM2-135M-Instruct"} $itl0
vllm:inter_token_latency_seconds_sum{engine="1",model_name="SmolLM2-135M-Instruct"} 75.0
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="5.0",model_name="SmolLM2-135M-Instruct"} $e2e0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="10.0",model_name="SmolLM2-135M-Instruct"} $e2e0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="SmolLM2-135M-Instruct"} $e2e0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="SmolLM2-135M-Instruct"} $e2e0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="SmolLM2-135M-Instruct"} 60.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
num_cpu_blocks="None",num_gpu_blocks="200"} 1.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="1",\
num_cpu_blocks="None",num_gpu_blocks="200"} 1.0
''')

# Two scrapes: between them 4 requests finish (2 + 2), 200 tokens are generated, 400 prompt
# tokens are looked up in the prefix cache (100 hits), 2 preemptions, and 4 first tokens come
# out: 2 in (0.1, 0.5] s, 2 in (0.5, 1.0] s.
FIRST = dict(run0=2, run1=1, wait0=0, wait1=3, kv0=0.25, kv1=0.5, queries=1000, hits0=100, preempt0=1,
             gen0=5000, gen1=3000, len0=20, stop1=5, len1=15, ttft0=10, ttft1=10, itl0=100, e2e0=10)
SECOND = dict(FIRST, run0=4, run1=2, wait0=1, wait1=2, kv0=0.5, kv1=0.75, queries=1200, hits0=200, preempt0=3,
              gen0=5150, gen1=3050, len0=22, stop1=6, len1=16, ttft0=12, ttft1=12, itl0=150, e2e0=12)


def pages(*values):
    """A fetch function that answers the pages in turn (the last one from then on)."""
    texts = [VLLM_PAGE.substitute(v) for v in values]
    calls = []

    def fetch(url):
        calls.append(url)
        return texts[min(len(calls), len(texts)) - 1]
    return fetch


def test_vllm_page_fills_a_sample():
    src = MetricsSource("http://127.0.0.1:1/metrics", window_s=60, fetch=pages(FIRST, SECOND))
    assert src.flavor == "unknown", "nothing is known before the first scrape"
    first = src.poll()
    assert src.flavor == "vllm"
    assert (first.finished, first.output_tokens, first.preemptions) == (0, 0, 0), "counters count from the first scrape"
    assert first.ttft["p50"] == pytest.approx(0.05)  # 20 observations, all in (0, 0.1]
    s = src.poll()
    # gauges and counters: summed over both engines' series (and every finish reason)
    assert (s.running, s.waiting, s.batch_size) == (6, 3, 6)
    assert (s.finished, s.output_tokens, s.prompt_tokens, s.preemptions) == (4, 200, 400, 2)
    assert s.arrived == 4 + 6 + 3, "no server counts arrivals: finished + running + waiting"
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (400, 100)
    # a fraction is averaged over engines; the blocks come from cache_config_info's label
    assert s.kv_usage == pytest.approx(0.625)
    assert (s.kv_blocks_total, s.kv_blocks_used) == (400, 250)
    # percentiles of what the window saw: the 4 new first tokens, not the 20 before them
    assert s.ttft["p50"] == pytest.approx(0.5) and s.ttft["p95"] == pytest.approx(0.95)
    assert 0.05 < s.itl["p50"] <= 0.1 and 5.0 >= s.e2e["p50"] > 0
    # not exported by vLLM: None (n/a), not 0
    assert s.kv_blocks_cached is None and s.spec_drafts is None and s.spec_accepted is None
    line = headline(s)
    assert "served 4" in line and "running 6, waiting 3" in line and "250/400" in line
    assert "prefix hits 25%" in line and "spec acceptance n/a" in line


def test_older_vllm_names_are_read_too():
    old = '''\
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.4
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 3.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 3.0
vllm:time_per_output_token_seconds_count{model_name="m"} 3.0
vllm:time_per_output_token_seconds_sum{model_name="m"} 0.1
# TYPE vllm:gpu_prefix_cache_queries counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 10.0
'''
    s = MetricsSource("http://127.0.0.1:1/metrics", fetch=lambda url: old).poll()
    assert s.kv_usage == pytest.approx(0.4) and s.itl["p50"] == pytest.approx(0.025)
    assert s.prefix_cache_queries == 0 and s.prefix_cache_hits is None
    assert s.running is None and s.ttft == {}, "what the page lacks is n/a"


def test_sglang_page_is_read():
    page = '''\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
# HELP sglang:token_usage The token usage
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_running_reqs The number of running requests
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.3
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.5",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
'''
    src = MetricsSource("http://127.0.0.1:1/metrics", fetch=lambda url: page)
    s = src.poll()
    assert src.flavor == "sglang"
    assert (s.running, s.waiting, s.kv_usage) == (5, 2, pytest.approx(0.28))
    assert 0.1 < s.ttft["p50"] <= 0.5 and s.itl == {} and s.finished is None and s.kv_blocks_used is None


def test_an_unknown_server_is_all_na_and_still_drawn():
    page = '# TYPE process_open_fds gauge\nprocess_open_fds 12.0\n'
    src = MetricsSource("http://127.0.0.1:1/metrics", fetch=lambda url: page)
    dash = Dashboard(src, display=False)
    dash.tick()
    dash.tick()
    assert dash.errors == [] and src.flavor == "unknown"
    s = dash.samples[-1]
    assert all(getattr(s, f) is None for f in ("arrived", "finished", "output_tokens", "running", "waiting",
                                                "batch_size", "preemptions", "kv_usage", "prompt_tokens"))
    assert s.ttft == s.itl == s.e2e == {}
    assert missing_panels(dash.samples) == list(PANELS)
    assert "offered n/a / served n/a" in headline(s) and "TTFT p50/p95/p99 n/a ms" in headline(s)
    assert dash.last_frame.startswith(JPEG)
    assert all(dash.panel.axes[p].get_title().endswith("n/a") for p in PANELS)


class _Page(BaseHTTPRequestHandler):
    text = ""

    def do_GET(self):
        body = self.text.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def vllm_server():
    """A local HTTP server that answers SECOND's vLLM page at /metrics."""
    handler = type("Page", (_Page,), {"text": VLLM_PAGE.substitute(SECOND)})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_dashboard_renders_a_vllm_server(vllm_server):
    import matplotlib

    matplotlib.use("Agg")
    src = MetricsSource(vllm_server + "/metrics")
    dash = Dashboard(src, display=False, title="a vLLM server")
    try:
        for _ in range(3):
            dash.tick()
    finally:
        src.close()
    assert dash.errors == [], dash.errors
    last = dash.samples[-1]
    assert (last.running, last.waiting, last.kv_blocks_used, last.kv_blocks_total) == (6, 3, 250, 400)
    assert dash.last_frame.startswith(JPEG)
    assert dash.panel.axes["spec acceptance"].get_title() == "spec acceptance: n/a"
    assert dash.panel.axes["KV blocks"].get_title() == "KV blocks"
    assert dash.heading() == f"a vLLM server (vllm server, {vllm_server}/metrics)"
    fig = dash.figure()
    assert "vllm server" in fig._suptitle.get_text()
    assert any(t.get_text() == "n/a" for t in fig.axes[PANELS.index("spec acceptance")].texts)


# -- minillm's own page, and the Grafana dashboard ---------------------------------------------------

def minillm_metrics_text() -> str:
    """The /metrics text minillm's server writes (``ServingMetrics``, its exporter), over a
    stand-in engine state with every optional part on: priority classes, speculation, one
    finished request and one error, so that every family it can export is there."""
    from minillm.metrics import EngineSnapshot
    from minillm.serving import prometheus as names
    from minillm.serving.prometheus import ServingMetrics

    snap = EngineSnapshot(time=0.0, num_steps=1, num_running=1, num_waiting=2, running_by_class={"high": 1},
                          waiting_by_class={"high": 1, "low": 1}, kv_blocks_total=64, kv_blocks_used=8,
                          kv_blocks_cached=2, num_preemptions=0, preemptions_owner=0, last_step_rows=1,
                          last_step_end=0.0, spec_num_drafts=10, spec_num_accepted=7, spec_acceptance_rate=0.7,
                          spec_owner=0)
    m = ServingMetrics(SimpleNamespace(stats=snap, counts={"added": 1}), "SmolLM2-135M-Instruct")
    m.request_success.labels(**m.labels, **{names.REASON_LABEL: "length"}).inc()
    m.count_error(429)
    return m.render()[0].decode()


def test_minillm_page_is_flavor_minillm_and_zero_is_not_na():
    """A labelled counter before its first event is a declared family with no sample: the
    server exports it, its value is 0 (not n/a)."""
    from minillm.metrics import EngineSnapshot
    from minillm.serving.prometheus import ServingMetrics

    snap = EngineSnapshot(time=0.0, num_steps=0, num_running=0, num_waiting=0, running_by_class={},
                          waiting_by_class={}, kv_blocks_total=64, kv_blocks_used=0, kv_blocks_cached=0,
                          num_preemptions=0, preemptions_owner=0, last_step_rows=0, last_step_end=None)
    text = ServingMetrics(SimpleNamespace(stats=snap, counts={}), "m").render()[0].decode()
    assert "minillm_request_success_total{" not in text
    src = MetricsSource("http://127.0.0.1:1/metrics", fetch=lambda url: text)
    s = src.poll()
    assert src.flavor == "minillm" and detect_flavor(parse_metrics(minillm_metrics_text())) == "minillm"
    assert (s.finished, s.output_tokens, s.running, s.kv_blocks_total, s.kv_usage) == (0, 0, 0, 64, 0.0)
    assert s.prefix_cache_hits is None, "minillm's server exports no prefix-cache hit counter"
    assert s.ttft == {"p50": None, "p95": None, "p99": None}, "a histogram with nothing in it yet, not n/a"


PROMQL_WORDS = {"sum", "avg", "by", "rate", "histogram_quantile", "le", "or", "and"}


def _metric_names(expr: str) -> tuple[set[str], list[list[str]]]:
    """The metric names a PromQL expression reads: plain selectors, and ``__name__=~"a(b|c)"``
    matchers expanded into their alternatives (one list per matcher)."""
    regexes = [m.group(1) for m in re.finditer(r'__name__=~"([^"]*)"', expr)]
    expanded = []
    for rx in regexes:
        m = re.fullmatch(r"([^()|]*)\(([^()]*)\)([^()|]*)", rx)
        expanded.append([m.group(1) + alt + m.group(3) for alt in m.group(2).split("|")] if m else [rx])
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)  # label matchers, ranges, strings
    tokens = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", bare)) - PROMQL_WORDS
    return tokens, expanded


def test_grafana_dashboard_is_well_formed():
    dash = json.loads(GRAFANA.read_text())
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {o["value"] for o in variables["prefix"]["options"]} == {"minillm_", "vllm:"}
    assert variables["prefix"]["current"]["value"] in {"minillm_", "vllm:"}
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 7
    titles = " ".join(p["title"] for p in panels)
    for what in ("running", "KV cache", "TTFT", "ITL", "tokens/s", "Preemptions", "Prefix cache"):
        assert what in titles, what
    cells = set()
    for p in panels:
        assert p["type"] == "timeseries" and p["datasource"]["uid"] == "${datasource}"
        g = p["gridPos"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells and g["x"] + g["w"] <= 24, f"panel {p['title']!r} overlaps another"
        cells |= area
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and '$model"' in expr, expr
            if "_bucket" in expr:  # a latency: a quantile of the buckets' rate over a minute
                assert expr.startswith("histogram_quantile(") and "sum by (le) (rate(" in expr and "[1m]" in expr


def test_grafana_metric_names_are_exported_by_minillm_or_vllm():
    """With either value of the prefix variable, every name an expression reads is one that
    minillm's server exports (its real /metrics text) or one of vLLM's page above."""
    minillm = set(parse_metrics(minillm_metrics_text()))
    vllm = set(parse_metrics(VLLM_PAGE.substitute(SECOND)))
    known = minillm | vllm
    dash = json.loads(GRAFANA.read_text())
    read = set()
    for p in dash["panels"]:
        for t in p["targets"]:
            for prefix in ("minillm_", "vllm:"):
                expr = t["expr"].replace("${prefix}", prefix)
                assert "$prefix" not in expr and "${" not in expr.replace("$model", "")
                tokens, alternatives = _metric_names(expr)
                assert tokens or alternatives, expr
                unknown = tokens - known
                assert not unknown, f"{p['title']!r}: {sorted(unknown)} exported by neither server"
                for alts in alternatives:
                    assert set(alts) & known, f"{p['title']!r}: none of {alts} is exported"
                read |= tokens | {a for alts in alternatives for a in alts if a in known}
    # the dashboard reads both servers' names, and minillm's core ones
    assert {"minillm_time_to_first_token_seconds_bucket", "minillm_num_requests_running",
            "minillm_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_hits_total"} <= read
