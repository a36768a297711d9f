"""Where the dashboard's numbers come from: ``EngineSource`` (an engine in this process,
read through its snapshot) and ``MetricsSource`` (a server's ``/metrics`` page, scraped
over HTTP). Both return a ``Sample`` per ``poll()``; ``dashboard.py`` draws them.

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
    p50/p95/p99 (seconds) of what was observed in the source's window (None: nothing yet)."""

    t: float  # seconds since the source started
    arrived: int  # requests offered so far
    finished: int  # requests completed (or aborted) so far
    output_tokens: int  # tokens generated so far
    running: int
    waiting: int  # arrived, not running yet
    batch_size: int  # rows of the latest step
    kv_blocks_used: int | None = None
    kv_blocks_cached: int | None = None
    kv_blocks_total: int | None = None
    preemptions: int = 0
    spec_drafts: int | None = None  # drafted tokens sent to verification (None: no speculation)
    spec_accepted: int | None = None
    waiting_by_class: dict[str, int] = field(default_factory=dict)
    ttft: dict[str, float | None] = field(default_factory=dict)
    itl: dict[str, float | None] = field(default_factory=dict)


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
        self.done_count = self.done_tokens = 0
        self.ttft, self.itl = _Window(window_s), _Window(window_s)
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
        arrived = waiting = running = live_tokens = 0
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
                del self.live[key], self.seen_tokens[key]
                continue
            arrived += 1
            live_tokens += len(r.output_token_ids)
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
            kv_blocks_total=snap.kv_blocks_total,
            preemptions=self.preemptions(snap.num_preemptions, snap.preemptions_owner),
            spec_drafts=self.drafts(snap.spec_num_drafts, snap.spec_owner),
            spec_accepted=self.accepted(snap.spec_num_accepted, snap.spec_owner),
            waiting_by_class=dict(snap.waiting_by_class), ttft=self.ttft.quantiles(now),
            itl=self.itl.quantiles(now))


# -- a server, through /metrics ----------------------------------------------------------------

# What each field of a Sample is read from: the first of its candidate names found. minillm's
# own are declared once, in minillm/serving/prometheus.py (the server exports them from
# there); vLLM's (``vllm:``) are read as well.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "arrived": ("vllm:request_received",),  # absent (minillm's server): finished + in flight
    "finished": (names.REQUEST_SUCCESS, "vllm:request_success"),
    "output_tokens": (names.GENERATION_TOKENS, "vllm:generation_tokens"),
    "running": (names.NUM_RUNNING, "vllm:num_requests_running"),
    "waiting": (names.NUM_WAITING, "vllm:num_requests_waiting"),
    "batch_size": (),  # none exported: the running requests
    "kv_blocks_used": (names.KV_BLOCKS_USED,),
    "kv_blocks_cached": (names.KV_BLOCKS_CACHED,),
    "kv_blocks_total": (names.KV_BLOCKS_TOTAL,),
    "preemptions": (names.NUM_PREEMPTIONS, "vllm:num_preemptions"),
    "spec_drafts": (names.SPEC_DRAFT_TOKENS, "vllm:spec_decode_num_draft_tokens"),
    "spec_accepted": (names.SPEC_ACCEPTED_TOKENS, "vllm:spec_decode_num_accepted_tokens"),
    "waiting_by_class": (names.NUM_WAITING_BY_CLASS,),
    "ttft": (names.TTFT, "vllm:time_to_first_token_seconds"),
    "itl": (names.ITL, "vllm:inter_token_latency_seconds"),
}

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}, parsed by
    ``prometheus_client.parser``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


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
    """Samples a server by scraping its ``/metrics`` (Prometheus text format).

    Counters and gauges are read as they are; TTFT and ITL percentiles come from the
    histograms' growth over the last ``window_s`` seconds (two scrapes apart), so they
    describe recent requests, not the whole life of the server.
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
        for name in self.names.get(field_name, ()):
            for sfx in suffixes:
                if name + sfx in metrics:
                    return metrics[name + sfx]
        return None

    def _value(self, metrics: dict, field_name: str) -> float | None:
        rows = self._find(metrics, field_name)
        return None if rows is None else sum(v for _, v in rows)

    def _buckets(self, metrics: dict, field_name: str) -> list[tuple[float, float]]:
        rows = self._find(metrics, field_name, ("_bucket",)) or []
        merged: dict[float, float] = {}
        for labels, v in rows:
            le = float(labels.get("le", "inf").replace("+Inf", "inf"))
            merged[le] = merged.get(le, 0.0) + v
        return sorted(merged.items())

    def _window_quantiles(self, now: float, key: str, current: list[tuple[float, float]]) -> dict[str, float | None]:
        old = None
        for t, hist in self.history:  # the oldest scrape still inside the window
            if t >= now - self.window_s:
                old = hist.get(key)
                break
        if old:
            before = dict(old)
            current = [(b, c - before.get(b, 0.0)) for b, c in current]
        return {f"p{q}": histogram_quantile(q / 100, current) for q in QUANTILES}

    def poll(self) -> Sample:
        now = time.perf_counter() - self.t0
        metrics = parse_metrics(self.fetch(self.url))

        def counter(name: str) -> int:
            v = self._value(metrics, name)
            return 0 if v is None else int(round(v - self.base.get(name, 0.0)))

        if not self.history:
            # The first scrape: counters count from here. A labelled counter (finished, by
            # reason) appears only at its first event: absent means 0, not "start later".
            for name in ("arrived", "finished", "output_tokens", "preemptions", "spec_drafts", "spec_accepted"):
                self.base[name] = self._value(metrics, name) or 0.0

        def gauge(name: str) -> int | None:
            v = self._value(metrics, name)
            return None if v is None else int(round(v))

        hists = {k: self._buckets(metrics, k) for k in ("ttft", "itl")}
        lat = {k: self._window_quantiles(now, k, h) for k, h in hists.items()}
        self.history.append((now, hists))
        while self.history and self.history[0][0] < now - 2 * self.window_s:
            self.history.popleft()
        by_class = {labels.get(names.CLASS_LABEL, labels.get("class", "?")): int(v)
                    for labels, v in (self._find(metrics, "waiting_by_class") or [])}
        running, waiting = gauge("running") or 0, gauge("waiting") or 0
        finished = counter("finished")
        arrived = counter("arrived") if self._find(metrics, "arrived") is not None else finished + running + waiting
        spec_drafts = self._value(metrics, "spec_drafts")
        return Sample(
            t=now, arrived=max(arrived, finished), finished=finished, output_tokens=counter("output_tokens"),
            running=running, waiting=waiting,
            batch_size=gauge("batch_size") if gauge("batch_size") is not None else running,
            kv_blocks_used=gauge("kv_blocks_used"), kv_blocks_cached=gauge("kv_blocks_cached"),
            kv_blocks_total=gauge("kv_blocks_total"), preemptions=counter("preemptions"),
            spec_drafts=None if spec_drafts is None else counter("spec_drafts"),
            spec_accepted=None if spec_drafts is None else counter("spec_accepted"),
            waiting_by_class=by_class, ttft=lat["ttft"], itl=lat["itl"])


__all__ = ["Sample", "EngineSource", "MetricsSource", "parse_metrics", "histogram_quantile", "METRIC_NAMES",
           "QUANTILES"]
