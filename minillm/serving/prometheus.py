"""The server's Prometheus metrics: their names, declared once, and ``ServingMetrics``.

The names are the server's and the dashboard's alike: ``server.py`` exports them at
``/metrics`` (through ``ServingMetrics``), ``minillm/viz/sources.py`` reads them back
(``MetricsSource``). Counters are named without ``_total``: prometheus_client adds it when
it writes them. Importing this module imports neither the engine nor prometheus_client
(a dashboard scraping a remote server needs neither).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .async_llm import AsyncLLM, StreamOutput

# -- names -------------------------------------------------------------------------------------

# Updated as outputs stream (counters and histograms of the server itself).
PROMPT_TOKENS = "minillm_prompt_tokens"
GENERATION_TOKENS = "minillm_generation_tokens"
REQUEST_SUCCESS = "minillm_request_success"  # by finish reason
REQUEST_ERRORS = "minillm_request_errors"  # by HTTP status
REQUEST_ABORTED = "minillm_request_aborted"  # requests the engine accepted and aborted (disconnects, shutdown)
TTFT = "minillm_time_to_first_token_seconds"
ITL = "minillm_inter_token_latency_seconds"
TPOT = "minillm_time_per_output_token_seconds"
E2E = "minillm_e2e_request_latency_seconds"
# Read from the engine's snapshot when scraped.
NUM_RUNNING = "minillm_num_requests_running"
NUM_WAITING = "minillm_num_requests_waiting"
NUM_RUNNING_BY_CLASS = "minillm_num_requests_running_by_class"
NUM_WAITING_BY_CLASS = "minillm_num_requests_waiting_by_class"
KV_BLOCKS_TOTAL = "minillm_kv_cache_blocks_total"
KV_BLOCKS_USED = "minillm_kv_cache_blocks_used"
KV_USAGE_RATIO = "minillm_kv_cache_usage_ratio"
KV_BLOCKS_CACHED = "minillm_kv_cache_blocks_cached"
NUM_PREEMPTIONS = "minillm_num_preemptions"
SPEC_DRAFT_TOKENS = "minillm_spec_decode_num_draft_tokens"
SPEC_ACCEPTED_TOKENS = "minillm_spec_decode_num_accepted_tokens"
SPEC_ACCEPTANCE_RATE = "minillm_spec_decode_acceptance_rate"
# The SLO controller (minillm/slo.py), when the engine runs one.
SLO_TOKEN_BUDGET = "minillm_slo_token_budget"  # the token budget (max_num_batched_tokens) now
SLO_TARGET = "minillm_slo_target_seconds"  # by METRIC_LABEL: ttft, itl
SLO_WINDOW_P95 = "minillm_slo_window_p95_seconds"  # by METRIC_LABEL, at the latest decision
SLO_ADJUSTMENTS = "minillm_slo_adjustments"  # by DIRECTION_LABEL: down, up

# The host KV tier (kv_offload, chapter 9), when the engine has one.
KV_OFFLOAD_BLOCKS = "minillm_kv_offload_blocks"  # by DIRECTION_LABEL: out (device -> host), in (host -> device)
KV_OFFLOAD_BYTES = "minillm_kv_offload_bytes"  # by DIRECTION_LABEL
KV_OFFLOAD_SECONDS = "minillm_kv_offload_copy_seconds"
KV_HOST_BLOCKS_TOTAL = "minillm_kv_host_blocks_total"
KV_HOST_BLOCKS_USED = "minillm_kv_host_blocks_used"
PREFIX_HIT_TOKENS = "minillm_prefix_cache_hit_tokens"  # by TIER_LABEL: device, host

# Labels: every metric carries MODEL_LABEL; the per-class gauges add CLASS_LABEL.
MODEL_LABEL = "model_name"
CLASS_LABEL = "priority_class"
REASON_LABEL = "finished_reason"
STATUS_LABEL = "status"
METRIC_LABEL = "metric"
DIRECTION_LABEL = "direction"
TIER_LABEL = "tier"

# Buckets for a CPU engine (tens of ms per token) up to a saturated GPU (ms): seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0)


# -- the exporter --------------------------------------------------------------------------------

class ServingMetrics:
    """Prometheus metrics of one server, in a registry of its own (two servers in one
    process, as in the tests, do not share counters).

    Engine state (queues, KV blocks, preemptions, speculation) is read from the engine's
    last snapshot (``AsyncLLM.stats``, an ``EngineSnapshot``) when scraped; the request
    counters and latency histograms are updated as outputs stream. Latencies are the
    engine's timestamps (arrival, each token), the same definitions as ``RequestMetrics``.
    """

    def __init__(self, llm: AsyncLLM, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.llm = llm
        self.registry = reg = CollectorRegistry(auto_describe=True)
        labels = {MODEL_LABEL: model_name}
        self.labels = labels
        self.prompt_tokens = Counter(PROMPT_TOKENS, "Prompt tokens of admitted requests",
                                     list(labels), registry=reg).labels(**labels)
        self.generation_tokens = Counter(GENERATION_TOKENS, "Output tokens streamed",
                                         list(labels), registry=reg).labels(**labels)
        self.request_success = Counter(REQUEST_SUCCESS, "Finished requests, by finish reason",
                                       [*labels, REASON_LABEL], registry=reg)
        self.request_errors = Counter(REQUEST_ERRORS, "Requests rejected with an HTTP error, by status",
                                      [*labels, STATUS_LABEL], registry=reg)
        self.ttft = Histogram(TTFT, "Arrival to first output token",
                              list(labels), buckets=TTFT_BUCKETS, registry=reg).labels(**labels)
        self.itl = Histogram(ITL, "Gap between consecutive output tokens",
                             list(labels), buckets=ITL_BUCKETS, registry=reg).labels(**labels)
        self.tpot = Histogram(TPOT, "Mean gap after the first token, per request",
                              list(labels), buckets=ITL_BUCKETS, registry=reg).labels(**labels)
        self.e2e = Histogram(E2E, "Arrival to last token",
                             list(labels), buckets=E2E_BUCKETS, registry=reg).labels(**labels)
        reg.register(_EngineCollector(llm, labels))

    def observe(self, out: StreamOutput) -> None:
        if out.token_ids:
            self.generation_tokens.inc(len(out.token_ids))
        if out.finished and out.output is not None:
            self.request_success.labels(**self.labels, **{REASON_LABEL: out.finish_reason}).inc()
            m = out.output.metrics
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            for gap in m.itls:
                self.itl.observe(gap)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.e2e is not None:
                self.e2e.observe(m.e2e)

    def count_error(self, status: int) -> None:
        """Count a request answered with HTTP ``status``."""
        self.request_errors.labels(**self.labels, **{STATUS_LABEL: str(status)}).inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and counters read from the engine's last snapshot at scrape time."""

    def __init__(self, llm: AsyncLLM, labels: dict[str, str]):
        self.llm, self.labels = llm, labels

    def describe(self):
        return []  # names depend on the engine's features (priority classes, speculation)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self.llm.stats
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge(NUM_RUNNING, "Requests in the running batch", s.num_running)
        yield gauge(NUM_WAITING, "Requests waiting to be admitted", s.num_waiting)
        yield gauge(KV_BLOCKS_TOTAL, "KV cache blocks", s.kv_blocks_total)
        yield gauge(KV_BLOCKS_USED, "KV cache blocks in use", s.kv_blocks_used)
        yield gauge(KV_USAGE_RATIO, "Fraction of KV cache blocks in use", s.kv_usage)
        yield gauge(KV_BLOCKS_CACHED, "KV cache blocks holding a cached prefix", s.kv_blocks_cached)
        for by_class, name, what in ((s.waiting_by_class, NUM_WAITING_BY_CLASS, "waiting"),
                                     (s.running_by_class, NUM_RUNNING_BY_CLASS, "running")):
            if by_class:
                g = GaugeMetricFamily(name, f"Requests {what}, per priority class", labels=[*names, CLASS_LABEL])
                for cls, n in sorted(by_class.items()):
                    g.add_metric([*values, cls], n)
                yield g
        yield counter(NUM_PREEMPTIONS, "Requests preempted to free KV blocks", s.num_preemptions)
        yield counter(REQUEST_ABORTED, "Requests aborted before they finished (client gone, shutdown)",
                      self.llm.counts.get("abort", 0))
        if s.slo is not None:
            yield from self._slo(s.slo, names, values)
        if s.kv_offload is not None:
            yield from self._offload(s.kv_offload, names, values)
        if s.spec_num_drafts is not None:
            yield counter(SPEC_DRAFT_TOKENS, "Drafted tokens sent to verification", s.spec_num_drafts)
            yield counter(SPEC_ACCEPTED_TOKENS, "Drafted tokens accepted", s.spec_num_accepted)
            if s.spec_acceptance_rate is not None:
                yield gauge(SPEC_ACCEPTANCE_RATE, "Chance that one reached draft is accepted",
                            s.spec_acceptance_rate)

    @staticmethod
    def _offload(o, names, values):
        """The host KV tier's pool, copies each way and hits per tier (an ``OffloadSnapshot``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, doc, v in ((KV_HOST_BLOCKS_TOTAL, "Blocks of the host KV pool", o.host_blocks_total),
                             (KV_HOST_BLOCKS_USED, "Host KV blocks holding a cached prefix", o.host_blocks_used)):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, v)
            yield g
        for name, doc, pair, label in (
                (KV_OFFLOAD_BLOCKS, "KV blocks copied between the device and the host pool", (o.blocks_out, o.blocks_in),
                 DIRECTION_LABEL),
                (KV_OFFLOAD_BYTES, "KV bytes copied between the device and the host pool", (o.bytes_out, o.bytes_in),
                 DIRECTION_LABEL),
                (PREFIX_HIT_TOKENS, "Prompt tokens found in the prefix cache, per tier",
                 (o.device_hit_tokens, o.host_hit_tokens), TIER_LABEL)):
            c = CounterMetricFamily(name, doc, labels=[*names, label])
            for key, v in zip(("out", "in") if label == DIRECTION_LABEL else ("device", "host"), pair):
                c.add_metric([*values, key], v)
            yield c
        c = CounterMetricFamily(KV_OFFLOAD_SECONDS, "Host seconds spent copying KV blocks between the tiers",
                                labels=names)
        c.add_metric(values, o.copy_seconds)
        yield c

    @staticmethod
    def _slo(slo, names, values):
        """The SLO controller's budget, targets, window p95s and adjustments (a ``SloSnapshot``)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = GaugeMetricFamily(SLO_TOKEN_BUDGET, "Token budget the SLO controller set (max_num_batched_tokens)",
                              labels=names)
        g.add_metric(values, slo.token_budget)
        yield g
        for name, doc, by_metric in ((SLO_TARGET, "SLO target, p95 seconds", (slo.ttft_target, slo.itl_target)),
                                     (SLO_WINDOW_P95, "p95 over the SLO controller's window at its latest decision",
                                      (slo.ttft_p95, slo.itl_p95))):
            g = GaugeMetricFamily(name, doc, labels=[*names, METRIC_LABEL])
            for metric, v in zip(("ttft", "itl"), by_metric):
                if v is not None:
                    g.add_metric([*values, metric], v)
            yield g
        c = CounterMetricFamily(SLO_ADJUSTMENTS, "Token budget changes of the SLO controller, by direction",
                                labels=[*names, DIRECTION_LABEL])
        c.add_metric([*values, "down"], slo.num_decreases)
        c.add_metric([*values, "up"], slo.num_increases)
        yield c


__all__ = ["ServingMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "E2E_BUCKETS"]
