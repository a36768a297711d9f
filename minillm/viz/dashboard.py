"""A live dashboard: what a serving engine is doing, redrawn while it runs.

    dash = Dashboard(EngineSource(engine))              # in-process: the engine's own state
    dash = Dashboard(MetricsSource(url + "/metrics"))   # a server, through its Prometheus text
    with dash:                                          # a background thread samples and redraws
        run_the_load()
    dash.figure()                                       # the whole run as a static chart

Eight panels: offered vs served load (requests/s), output tokens/s, TTFT and ITL
p50/p95/p99 over a sliding window, batch size and queue depth (per priority class when
the scheduler has classes), KV blocks used (and cached, with prefix caching),
preemptions, and the acceptance rate of speculative decoding.

Why it does not slow the engine down. The sampler reads a few counters and the new
tokens of live requests (microseconds). Drawing is the expensive part: on a small CPU
one full matplotlib draw of eight panels takes a few hundred milliseconds, all of it
holding the GIL the engine's thread needs between its torch calls. So the panel is
drawn the way animations are (*blitting*): axes, ticks and labels are drawn once into a
background image; each frame restores that image, draws only the lines (as paths,
straight into the renderer) and encodes a JPEG (a few ms). Axes grow (at least doubling,
onto round limits: 1, 2, 5 x 10^k), at most every ``full_redraw_every`` seconds (lines are
clipped meanwhile); a growing panel repaints only the pixels left of its axes, its tick
labels (~5 ms, where redrawing the whole panel with its text and legend cost tens). The
latest numbers go in an HTML line next to the image, which the browser renders.
``measure_overhead`` checks the cost: engine throughput with and without a dashboard
attached, alternating.

Headless (no display, nbval, a script), everything still runs: frames are drawn and
kept in ``last_frame`` (JPEG bytes); only the widget is not shown.
"""
from __future__ import annotations

import bisect
import hashlib
import io
import math
import threading
import time
import urllib.parse
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from minillm.bench.summary import percentiles

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


# -- sources ------------------------------------------------------------------------------

class _Monotone:
    """A counter that restarts with a new owner (another engine, ``reset_stats``'s new
    counters) made cumulative again: ``owner`` is the object holding it."""

    def __init__(self) -> None:
        self.offset = self.last = 0
        self.owner: int | None = None

    def __call__(self, raw: int | None, owner: Any) -> int | None:
        if raw is None:
            return None
        if id(owner) != self.owner or raw < self.last:  # a new counter, from zero: count on from where it was
            self.offset += self.last
            self.owner, self.last = id(owner), 0
        self.last = raw
        return self.offset + raw


class EngineSource:
    """Samples an ``LLMEngine`` in this process, from any thread, without touching it.

    Requests are found in the scheduler's queues at each poll (``track`` adds them
    explicitly: a request that arrives and finishes between two polls is otherwise
    missed). A finished request is read one last time, then forgotten (its counts stay).
    Reads are plain attribute reads: safe under the GIL while the engine steps elsewhere.
    """

    def __init__(self, engine: Any, window_s: float = 10.0, clock: Callable[[], float] = time.perf_counter):
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
        e, s = self.engine, self.engine.scheduler
        bm = s.block_manager
        cached = getattr(bm, "num_cached_blocks", None)
        by_class = getattr(s, "num_waiting_by_class", None)
        try:
            by_class = dict(by_class() if callable(by_class) else by_class or {})
        except RuntimeError:
            by_class = {}
        records = e.step_records
        last = records[-1] if records else None
        spec = e.spec_stats
        return Sample(
            t=now - self.t0, arrived=arrived + self.done_count, finished=self.done_count,
            output_tokens=live_tokens + self.done_tokens, running=running, waiting=waiting,
            batch_size=last.num_rows if last is not None and now - last.end < 1.0 else 0,
            kv_blocks_used=bm.num_blocks - bm.num_free_blocks,
            kv_blocks_cached=cached() if callable(cached) else cached, kv_blocks_total=bm.num_blocks,
            preemptions=self.preemptions(s.num_preemptions, s),
            spec_drafts=self.drafts(None if spec is None else spec.num_drafts, spec),
            spec_accepted=self.accepted(None if spec is None else spec.num_accepted, spec),
            waiting_by_class=by_class, ttft=self.ttft.quantiles(now),
            itl=self.itl.quantiles(now))


# Prometheus metric names the server exports (minillm/serving/server.py); each field is
# the first of its candidates found, so vLLM's names (``vllm:``) work as well.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "arrived": ("minillm_requests_received", "vllm:request_received"),  # absent: finished + in flight
    "finished": ("minillm_request_success", "vllm:request_success"),
    "output_tokens": ("minillm_generation_tokens", "vllm:generation_tokens"),
    "running": ("minillm_num_requests_running", "vllm:num_requests_running"),
    "waiting": ("minillm_num_requests_waiting", "vllm:num_requests_waiting"),
    "batch_size": ("minillm_batch_size",),  # absent: the running requests
    "kv_blocks_used": ("minillm_kv_cache_blocks_used",),
    "kv_blocks_cached": ("minillm_kv_cache_blocks_cached",),
    "kv_blocks_total": ("minillm_kv_cache_blocks_total",),
    "preemptions": ("minillm_num_preemptions", "vllm:num_preemptions"),
    "spec_drafts": ("minillm_spec_decode_num_draft_tokens", "vllm:spec_decode_num_draft_tokens"),
    "spec_accepted": ("minillm_spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens"),
    "waiting_by_class": ("minillm_num_requests_waiting_by_class",),
    "ttft": ("minillm_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
    "itl": ("minillm_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
}


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}.

    Uses ``prometheus_client.parser`` when installed, else a small parser of the same
    format (``name{label="v",...} value`` lines; ``#`` lines are comments)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:  # pragma: no cover - prometheus_client is a dependency of the server
        text_string_to_metric_families = None
    if text_string_to_metric_families is not None:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
        return out
    for line in text.splitlines():  # pragma: no cover
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, labels = head, {}
        if "{" in head:
            name, rest = head.split("{", 1)
            for part in rest.rstrip("}").split(","):
                if "=" in part:
                    k, v = part.split("=", 1)
                    labels[k.strip()] = v.strip().strip('"')
        out.setdefault(name, []).append((labels, float(value)))
    return out


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The q-quantile (0..1) of a histogram given as cumulative (upper bound, count) pairs,
    interpolated linearly inside the bucket, as Prometheus' ``histogram_quantile`` does.
    None when the histogram is empty. A quantile in the +Inf bucket returns the largest
    finite bound (the histogram knows no more)."""
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
        self.t0 = time.perf_counter()
        self.history: deque[tuple[float, dict[str, list[tuple[float, float]]]]] = deque()
        self.base: dict[str, float] = {}  # counter values at the first scrape: a dashboard counts from there

    def _get(self, url: str) -> str:
        host = urllib.parse.urlsplit(url).hostname or ""
        # A server on this machine is reached directly, never through an http_proxy of the environment.
        opener = _DIRECT if host in ("127.0.0.1", "localhost", "::1") else urllib.request.build_opener()
        with opener.open(url, timeout=self.timeout) as resp:
            return resp.read().decode()

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
        by_class = {labels.get("priority_class", labels.get("class", "?")): int(v)
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


# -- series: what the panels plot ---------------------------------------------------------

def _rate(samples: Sequence[Sample], attr: str, smooth_s: float) -> tuple[list[float], list[float]]:
    """d(counter)/dt at each sample, over the last ``smooth_s`` seconds (a moving difference)."""
    xs, ys, j = [], [], 0
    for i, s in enumerate(samples):
        while samples[j].t < s.t - smooth_s and j < i:
            j += 1
        a = samples[j] if j < i else (samples[i - 1] if i else None)
        if a is None or s.t <= a.t:
            continue
        xs.append(s.t)
        ys.append((getattr(s, attr) - getattr(a, attr)) / (s.t - a.t))
    return xs, ys


def _acceptance(samples: Sequence[Sample], smooth_s: float) -> tuple[list[float], list[float]]:
    xs, ys, j = [], [], 0
    for i, s in enumerate(samples):
        if s.spec_drafts is None:
            continue
        while samples[j].t < s.t - smooth_s and j < i:
            j += 1
        a = samples[j]
        checked = s.spec_drafts - (a.spec_drafts or 0)
        if checked > 0:
            xs.append(s.t)
            ys.append((s.spec_accepted - (a.spec_accepted or 0)) / checked)
    return xs, ys


def series(samples: Sequence[Sample], smooth_s: float = 2.0) -> dict[str, dict[str, tuple[list, list]]]:
    """Panel -> line -> (x, y): everything the dashboard draws, from the samples alone."""
    ts = [s.t for s in samples]

    def col(fn):
        pts = [(s.t, fn(s)) for s in samples]
        pts = [(t, v) for t, v in pts if v is not None]
        return [t for t, _ in pts], [v for _, v in pts]

    panels = {
        "load (req/s)": {"offered": _rate(samples, "arrived", smooth_s), "served": _rate(samples, "finished", smooth_s)},
        "output tokens/s": {"tok/s": _rate(samples, "output_tokens", smooth_s)},
        "TTFT (s)": {f"p{q}": col(lambda s, q=q: s.ttft.get(f"p{q}")) for q in QUANTILES},
        "ITL (s)": {f"p{q}": col(lambda s, q=q: s.itl.get(f"p{q}")) for q in QUANTILES},
        "batch and queue": {"batch": (ts, [s.batch_size for s in samples]),
                            "waiting": (ts, [s.waiting for s in samples])},
        "KV blocks": {"used": col(lambda s: s.kv_blocks_used), "cached": col(lambda s: s.kv_blocks_cached)},
        "preemptions": {"total": (ts, [s.preemptions for s in samples])},
        "spec acceptance": {"accepted/drafted": _acceptance(samples, smooth_s)},
    }
    classes = sorted({c for s in samples for c in s.waiting_by_class})
    for c in classes if len(classes) > 1 else ():  # one class is the "waiting" line again
        panels["batch and queue"][f"waiting {c}"] = (ts, [s.waiting_by_class.get(c, 0) for s in samples])
    return panels


# Y axis strips already drawn, by (look, panel, limits): axes grow onto round limits
# (_nice_ceiling), so a later dashboard in the same process (the next run of a sweep)
# repaints a grown axis by copying pixels. ~40 KB each, at most this many:
_AXIS_STRIPS: dict[tuple, Any] = {}
_AXIS_STRIPS_MAX = 256

PANELS = ("load (req/s)", "output tokens/s", "TTFT (s)", "ITL (s)", "batch and queue", "KV blocks",
          "preemptions", "spec acceptance")
MAX_LINES = 5  # lines per panel the live renderer keeps (batch, waiting, three classes)


def headline(s: Sample | None) -> str:
    """The latest numbers as one line of text."""
    if s is None:
        return "no sample yet"

    def ms(d, k):
        v = d.get(k)
        return "-" if v is None else f"{v * 1000:.0f}"

    kv = "-" if s.kv_blocks_used is None else f"{s.kv_blocks_used}/{s.kv_blocks_total}"
    if s.kv_blocks_cached is not None:
        kv += f" ({s.kv_blocks_cached} cached)"
    acc = ("-" if not s.spec_drafts else f"{s.spec_accepted / s.spec_drafts:.2f}")
    classes = "".join(f", {c}: {n}" for c, n in sorted(s.waiting_by_class.items()))
    return (f"t={s.t:.1f}s · offered {s.arrived} / served {s.finished} requests · {s.output_tokens} tokens · "
            f"batch {s.batch_size}, running {s.running}, waiting {s.waiting}{classes} · "
            f"TTFT p50/p95/p99 {ms(s.ttft, 'p50')}/{ms(s.ttft, 'p95')}/{ms(s.ttft, 'p99')} ms · "
            f"ITL {ms(s.itl, 'p50')}/{ms(s.itl, 'p95')}/{ms(s.itl, 'p99')} ms · KV {kv} · "
            f"preempted {s.preemptions} · spec acceptance {acc}")


# -- drawing --------------------------------------------------------------------------------

def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten that is >= ``value`` (> 0): an axis grows
    onto round limits, the same ones run after run."""
    if not math.isfinite(value) or value <= 0:
        return value
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        if step * power >= value * (1 - 1e-12):
            return step * power
    return 10 * power


def _compact(value: float, pos: Any = None) -> str:
    """A tick label of at most ~5 characters: 0.05, 800, 4000, 12k, 3M."""
    for above, unit, suffix in ((1e9, 1e9, "G"), (1e6, 1e6, "M"), (1e4, 1e3, "k")):  # 4000 stays 4000
        if abs(value) >= above:
            return f"{value / unit:g}{suffix}"
    return f"{value:g}"


class LivePanel:
    """The eight panels, drawn by blitting into an Agg canvas (no pyplot, no display).

    Safe to use from one background thread: it owns its own ``Figure``."""

    def __init__(self, figsize=(11.0, 4.8), dpi: int = 64, full_redraw_every: float = 4.0, window_s: float = 60.0):
        import matplotlib.colors as mcolors
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FuncFormatter

        self.fig = Figure(figsize=figsize, dpi=dpi)
        self.canvas = FigureCanvasAgg(self.fig)
        self.axes = dict(zip(PANELS, self.fig.subplots(2, 4).flat))
        self.lines: dict[str, list] = {}
        for i, (name, ax) in enumerate(self.axes.items()):
            # y given: the title's place is fixed, not searched for at every draw (same pixels).
            ax.set_title(name, fontsize=8, y=1.0)
            # Few tick labels: text is most of the cost of a full redraw.
            ax.tick_params(labelsize=7, labelbottom=i >= 4)
            ax.locator_params(nbins=3)
            # Compact labels ("0.05", "800", "12k", "3M"), never an offset text ("1e6") above the axes.
            ax.yaxis.set_major_formatter(FuncFormatter(_compact))
            # A fixed window of the last ``window_s`` seconds: the x axis never moves, only the lines do.
            ax.set_xlim(-window_s, 0)
            ax.set_ylim(0, 1.0)
            self.lines[name] = [ax.plot([], [], lw=1.2, animated=True)[0] for _ in range(MAX_LINES)]
        # What ``_draw_lines`` draws each line with (the Line2D objects serve the legends).
        self._styles = {line: (mcolors.to_rgba(line.get_color(), line.get_alpha()), line.get_linewidth(),
                               line.get_solid_capstyle(), line.get_solid_joinstyle())
                        for lines in self.lines.values() for line in lines}
        for ax in list(self.axes.values())[4:]:
            ax.set_xlabel("seconds ago", fontsize=7)
        self.window_s = window_s
        self.fig.subplots_adjust(left=0.05, right=0.99, top=0.93, bottom=0.11, wspace=0.28, hspace=0.38)
        self.full_redraw_every = full_redraw_every
        self.last_full = -math.inf
        self.full_redraws = 0  # whole-figure draws (the first frame)
        self.panel_redraws = 0  # single panels redrawn because their axis grew
        self.cached_strips = 0  # ... of which were taken from an earlier panel's drawing
        self._look: bytes | None = None  # set by the first frame (_freeze_layout)
        self.background = None
        self._strips: dict = {}  # per panel: the pixels an axis growth repaints (see _redraw_panels)
        self._legend_keys: dict[str, tuple] = {}
        self._legend_changed: set[str] = set()  # panels whose legend changed since the last repaint
        self._axis_strips: dict = {}  # per panel: the pixels a growth alone repaints (no legend change)
        self._legend_x0: dict[str, float] = {}  # per panel: the left edge of its legend, in pixels
        self._affine: dict | None = None  # per panel: data -> pixels (changes only when its y axis does)

    def set_ymax(self, panel: str, ymax: float) -> None:
        """A known upper limit (e.g. the KV cache's blocks), so the axis need not grow into it."""
        self.axes[panel].set_ylim(0, ymax)
        self._affine = None

    def _visible(self, x: list, y: list, now: float) -> tuple[list, list]:
        """The points of the last ``window_s`` seconds, x as seconds before ``now``."""
        i = bisect.bisect_left(x, now - self.window_s)
        x, y = x[i:], y[i:]
        if len(x) > 400:  # a line never needs more points than the panel has pixels
            step = len(x) // 200
            x, y = x[::step], y[::step]
        return [t - now for t in x], y

    def _limits(self, data: dict[str, dict[str, tuple[list, list]]], now: float) -> list[str]:
        """Grow any y axis that its visible data outgrew. The panels whose limit (or legend) changed."""
        changed = []
        for name, ax in self.axes.items():
            ymax = max((max(y) for x, y in (self._visible(*xy, now) for xy in data[name].values()) if y),
                       default=0.0)
            y0, y1 = ax.get_ylim()
            if ymax > y1:
                ax.set_ylim(y0, _nice_ceiling(max(2 * y1, 1.5 * ymax)))
                changed.append(name)
            keys = tuple(data[name])[:MAX_LINES]
            if keys != self._legend_keys.get(name) and len(keys) > 1:
                self._legend_keys[name] = keys
                for line, key in zip(self.lines[name], keys):
                    line.set_label(key)
                handles = self.lines[name][:len(keys)]
                ax.legend(handles, keys, fontsize=6, loc="upper left", frameon=False)
                self._legend_changed.add(name)
                if name not in changed:
                    changed.append(name)
        return changed

    def _freeze_layout(self) -> None:
        """After the first full draw: fix where everything sits, and each panel's y strip.

        The axes never move (the figure is never resized and the x axes are fixed), so the
        axis labels are pinned where matplotlib first put them (it would otherwise measure
        every tick label again at each draw to place them). A panel's *strip* is what a
        growing y axis changes, in whole pixels: from the right edge of the panel on its left
        (the figure's edge for the first column) across its tick labels and its axes, and
        from just under the bottom spine up to the figure's top, or to under the tick marks
        of the panel above (its title is in the strip and is drawn again with it)."""
        from matplotlib.transforms import Bbox, IdentityTransform

        renderer = self.canvas.get_renderer()
        for ax in self.axes.values():
            for axis in (ax.xaxis, ax.yaxis):
                pos = axis.label.get_transform().transform(axis.label.get_position())
                axis.set_label_coords(*pos, transform=IdentityTransform())
        names = list(self.axes)
        for k, name in enumerate(names):
            ax = self.axes[name]
            left = math.ceil(self.axes[names[k - 1]].bbox.x1 + 2) if k % 4 else 0
            # Up to the figure's top (first row) or to under the tick marks of the panel above:
            # a tick label at the top of the axis reaches above it, next to the title.
            if k < 4:
                top = math.floor(self.fig.bbox.y1)
            else:
                above = self.axes[names[k - 4]]
                tick_px = above.xaxis.get_major_ticks()[0].tick1line.get_markersize() * self.fig.dpi / 72
                top = math.floor(above.bbox.y0 - tick_px - 2)
            bottom = math.floor(ax.bbox.y0 - 2)
            self._strips[name] = Bbox([[left, bottom], [math.ceil(ax.bbox.x1 + 2), top]])
            # A growth alone changes only the tick labels and marks left of the axes: the strip
            # stops a pixel inside the left spine, short of the legend (upper left, half its font
            # size in), which it then need not draw (~9 ms of text each).
            self._axis_strips[name] = Bbox([[left, bottom], [math.ceil(ax.bbox.x0 + 1), top]])
        self._legend_x0 = {name: ax.get_legend().get_window_extent(renderer).x0
                           for name, ax in self.axes.items() if ax.get_legend() is not None}
        # What this panel looks like: its first frame's pixels. Panels that look the same
        # (same size, style, fonts) draw the same y axis strip for the same limits.
        self._look = hashlib.blake2b(self.canvas.buffer_rgba(), digest_size=16).digest()
        self._legend_changed.clear()

    def _redraw_panels(self, names: list[str]) -> None:
        """Redraw the y axis of the panels in ``names`` (and changed legends) into the background.

        For each: paint its strip blank, draw its face, spines, y axis, x tick marks (and
        legend) again, and keep only the strip's pixels of the result (what those artists
        drew outside it, e.g. the lower part of the tick marks, was already there). The
        strip is the narrow one left of the axes unless the panel's legend changed: a
        legend is ~9 ms of text per panel, the y axis ~4. Title, x tick labels and the
        other panels are left as they were. All eight panels grown: ~42 ms here (~136 ms
        with their legends, 250-300 ms redrawn whole with their text, which also measured
        every label to place it); ``tests/test_dashboard.py`` checks that the pixels are
        those of a full draw, for both strips."""
        from matplotlib.patches import Rectangle

        renderer = self.canvas.get_renderer()
        strips = []
        for name in names:
            ax = self.axes[name]
            # The whole strip with the legend when the legend changed, or when it reaches into
            # the narrow strip (it does not with the defaults); else the narrow strip, no legend.
            wide = name in self._legend_changed or self._legend_x0.get(name, math.inf) < self._axis_strips[name].x1
            key = None if wide else (self._look, name, ax.get_ylim())
            if key in _AXIS_STRIPS:  # drawn before, by a panel that looks the same
                strips.append(_AXIS_STRIPS[key])
                self.cached_strips += 1
                continue
            legend = ax.get_legend() if wide else None
            box = self._strips[name] if wide else self._axis_strips[name]
            self.canvas.restore_region(self.background)
            patch = Rectangle((box.x0, box.y0), box.width, box.height, transform=None,
                              facecolor=self.fig.get_facecolor(), edgecolor="none")
            patch.set_figure(self.fig)
            patch.draw(renderer)
            # in ax.draw's order: the face first, then by zorder (axes 1.5, spines 2.5, title 3, legend 5)
            ax.patch.draw(renderer)
            ticks = [(ax.xaxis.get_zorder(), t.tick1line) for t in ax.xaxis.get_major_ticks() if t.get_visible()]
            rest = [(a.get_zorder(), a) for a in (*ax.spines.values(), ax.yaxis, ax.title, legend) if a is not None]
            for _, artist in sorted(ticks + rest, key=lambda za: za[0]):
                artist.draw(renderer)
            if legend is not None:
                self._legend_x0[name] = legend.get_window_extent(renderer).x0
            strips.append(self.canvas.copy_from_bbox(box))
            if key is not None and len(_AXIS_STRIPS) < _AXIS_STRIPS_MAX:
                _AXIS_STRIPS[key] = strips[-1]
        self.canvas.restore_region(self.background)
        for strip in strips:
            self.canvas.restore_region(strip)
        self.background = self.canvas.copy_from_bbox(self.fig.bbox)
        self._legend_changed.difference_update(names)

    def draw(self, data: dict[str, dict[str, tuple[list, list]]], now: float, fmt: str = "jpeg") -> bytes:
        """One frame: lines only, after redrawing any panel whose axis must grow (rate-limited)."""
        if self.background is None:
            self._limits(data, now)
            self._affine = None
            self.canvas.draw()  # everything but the animated lines: the background
            self.background = self.canvas.copy_from_bbox(self.fig.bbox)
            self._freeze_layout()
            self.last_full = now
            self.full_redraws += 1
        elif now - self.last_full >= self.full_redraw_every:
            changed = self._limits(data, now)
            if changed:
                self._affine = None
                self._redraw_panels(changed)
                self.last_full = now
                self.panel_redraws += len(changed)
        self.canvas.restore_region(self.background)
        self._draw_lines(data, now)
        return self.encode(fmt)

    def _draw_lines(self, data: dict[str, dict[str, tuple[list, list]]], now: float) -> None:
        """Each panel's lines as paths straight into the renderer, clipped to the panel.

        ``ax.draw_artist(line)`` would do the same through ``Line2D.draw``, whose Python
        bookkeeping (caches, transforms, a graphics context per line) cost ~4x the
        rasterising here: about half of a frame, on a thread that shares the GIL with the
        engine. The styles (colour, width, caps, joins) are the lines' own."""
        import numpy as np
        from matplotlib.path import Path
        from matplotlib.transforms import IdentityTransform

        renderer = self.canvas.get_renderer()
        identity = IdentityTransform()
        if self._affine is None:  # data -> pixels (the axes are linear); new after an axis grew
            self._affine = {name: ax.transData.get_affine().get_matrix().copy() for name, ax in self.axes.items()}
        gc = renderer.new_gc()
        shape = None
        try:
            gc.set_antialiased(True)
            for k, (name, ax) in enumerate(self.axes.items()):
                m = self._affine[name]
                gc.set_clip_rectangle(ax.bbox)
                for line, (x, y) in zip(self.lines[name], list(data[name].values())[:MAX_LINES]):
                    xs, ys = self._visible(x, y, now)
                    if len(xs) < 2:
                        continue
                    pts = np.empty((len(xs), 2))
                    pts[:, 0] = xs
                    pts[:, 1] = ys
                    pts = pts @ m[:2, :2].T + m[:2, 2]
                    color, lw, cap, join = self._styles[line]
                    gc.set_foreground(color, isRGBA=True)
                    gc.set_linewidth(lw)
                    if (cap, join) != shape:  # the same for every line: set once
                        gc.set_capstyle(cap)
                        gc.set_joinstyle(join)
                        shape = (cap, join)
                    renderer.draw_path(gc, Path(pts), identity)
                if k == 3:  # halfway: let the engine's thread take the GIL (the encoder releases it at the end)
                    time.sleep(0)
        finally:
            gc.restore()

    def encode(self, fmt: str = "jpeg") -> bytes:
        from PIL import Image

        w, h = self.canvas.get_width_height()
        buf = io.BytesIO()
        if fmt == "jpeg":  # the opaque RGBA buffer read as RGBX: no RGB copy (same bytes out)
            img = Image.frombuffer("RGBX", (w, h), self.canvas.buffer_rgba(), "raw", "RGBX", 0, 1)
            img.save(buf, format="JPEG", quality=85)
        else:
            img = Image.frombuffer("RGBA", (w, h), self.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
            img.save(buf, format="PNG", compress_level=1)
        return buf.getvalue()


def plot_samples(samples: Sequence[Sample], title: str | None = None, smooth_s: float = 2.0, marks=()):
    """A static matplotlib figure of a whole run (pyplot: it shows in a notebook).

    ``marks``: (time, label) pairs drawn as vertical lines, e.g. where each rate of a sweep began."""
    import matplotlib.pyplot as plt

    data = series(samples, smooth_s)
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.5))
    for (name, lines), ax in zip(data.items(), axes.flat):
        for key, (x, y) in lines.items():
            if x:
                ax.plot(x, y, lw=1.2, label=key)
        for t, label in marks:
            ax.axvline(t, color="gray", lw=0.6, ls=":")
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=8)
        if sum(1 for x, _ in lines.values() if x) > 1:
            ax.legend(fontsize=7, frameon=False)
    for ax in axes[1]:
        ax.set_xlabel("seconds")
    if samples and samples[-1].kv_blocks_total:
        axes[1][1].axhline(samples[-1].kv_blocks_total, color="k", lw=0.6, ls="--")
    shown = None
    for t, label in marks:  # many marks (a sweep): name each group once, by its first word
        text = label if len(marks) <= 6 else label.split()[0]
        if text != shown:
            axes[0][0].annotate(text, (t, 1), xytext=(2, -2), textcoords="offset points", fontsize=7,
                                xycoords=("data", "axes fraction"), rotation=90, va="top")
            shown = text
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# -- the dashboard -------------------------------------------------------------------------

class Dashboard:
    """Samples a source and redraws the panel at ``1 / interval`` Hz (default 0.4 s: 2.5 Hz) from a background thread.

    ``display=True`` shows an ipywidgets panel (an image and a line of numbers) when a
    notebook frontend is there; without one it still samples and draws. Errors in the
    thread never reach the engine: they are kept in ``errors`` (and drawing goes on).
    """

    def __init__(self, source: Any, interval: float = 0.4, smooth_s: float = 2.0, display: bool = True,
                 title: str | None = None, draw: bool = True, panel_options: dict | None = None):
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.01 <= interval <= 60:
            raise ValueError(f"interval must be a number of seconds in [0.01, 60] (0.4 redraws 2.5 times a "
                             f"second), got {interval!r}")
        if not hasattr(source, "poll"):
            raise ValueError(f"source must have a poll() method returning a Sample (EngineSource, MetricsSource), "
                             f"got {type(source).__name__}")
        self.source, self.interval, self.smooth_s, self.title = source, float(interval), smooth_s, title
        self.samples: list[Sample] = []
        self.marks: list[tuple[float, str]] = []
        self.errors: list[str] = []
        self.frame_times: list[float] = []  # seconds each frame took (sample + draw + encode)
        self.frame_at: list[float] = []  # perf_counter when each frame was ready
        self.cpu_s = 0.0  # CPU seconds the ticks used (their own thread's time: not the engine's)
        self.loop_cpu_s = 0.0  # ... of which the background thread's, while the run went on
        self.last_frame: bytes | None = None
        self.draw_enabled = draw
        self.panel = LivePanel(**(panel_options or {})) if draw else None
        self.widget = self._make_widget() if display else None
        self._image = self._text = None
        if self.widget is not None:
            self._text, self._image = self.widget.children
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _make_widget():
        try:
            import ipywidgets as w
        except ImportError:
            return None
        return w.VBox([w.HTML(value="<tt>starting…</tt>"), w.Image(format="jpeg")])

    # -- life cycle ---------------------------------------------------------------
    def start(self) -> "Dashboard":
        if self._thread is not None:
            raise RuntimeError("this dashboard is already running")
        if self.widget is not None:
            try:
                from IPython.display import display

                display(self.widget)
            except Exception as e:  # no frontend (a script): keep drawing, show nothing
                self.errors.append(f"display: {type(e).__name__}: {e}")
        self._stop.clear()
        self.tick()
        self._thread = threading.Thread(target=self._loop, name="minillm-dashboard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> "Dashboard":
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.tick()  # the final state
        return self

    def __enter__(self) -> "Dashboard":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def mark(self, label: str) -> None:
        """A vertical line at the current time in the static figure (e.g. 'rate 2/s')."""
        t = self.samples[-1].t if self.samples else 0.0
        self.marks.append((t, label))

    def _loop(self) -> None:
        # Ticks on a fixed grid (start + k * interval): the rate holds whatever a frame costs,
        # as long as a frame costs less than the interval.
        next_at = time.perf_counter() + self.interval
        while not self._stop.wait(max(0.0, next_at - time.perf_counter())):
            self.tick(loop=True)
            next_at += self.interval
            now = time.perf_counter()
            if next_at < now:  # behind (a slow full redraw): one frame now, no burst
                next_at = now

    def tick(self, loop: bool = False) -> None:
        """Sample once and redraw (the thread calls this with ``loop=True``; start and stop
        add one frame each, which the redraw rate leaves out)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            try:
                self.samples.append(self.source.poll())
            except Exception as e:  # e.g. the server is not up yet
                self.errors.append(f"poll: {type(e).__name__}: {e}")
                return
            try:
                if self.draw_enabled:
                    total = self.samples[-1].kv_blocks_total
                    if self.panel.background is None and total:
                        self.panel.set_ymax("KV blocks", 1.05 * total)
                    # Only the samples the window shows (and the smoothing before it): a frame
                    # costs the same after an hour as after a minute.
                    now = self.samples[-1].t
                    first = bisect.bisect_left(self.samples, now - self.panel.window_s - self.smooth_s - 1,
                                               key=lambda x: x.t)
                    self.last_frame = self.panel.draw(series(self.samples[first:], self.smooth_s), now)
                if self._image is not None:
                    self._image.value = self.last_frame or b""
                    self._text.value = f"<tt style='font-size:11px'>{headline(self.samples[-1])}</tt>"
            except Exception as e:
                self.errors.append(f"draw: {type(e).__name__}: {e}")
            t1 = time.perf_counter()
            cpu = time.thread_time() - c0
            self.cpu_s += cpu
            self.frame_times.append(t1 - t0)
            if loop:
                self.frame_at.append(t1)
                self.loop_cpu_s += cpu

    # -- what it measured ------------------------------------------------------------------
    @property
    def redraws(self) -> int:
        """Frames the background thread drew."""
        return len(self.frame_at)

    @property
    def redraw_hz(self) -> float:
        """Frames per second of the background thread (first to last of its frames)."""
        t = self.frame_at
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0

    @property
    def full_redraws(self) -> int:
        return self.panel.full_redraws if self.panel is not None else 0

    @property
    def panel_redraws(self) -> int:
        return self.panel.panel_redraws if self.panel is not None else 0

    def figure(self, title: str | None = None):
        """The whole run as a static pyplot figure."""
        return plot_samples(self.samples, title or self.title, self.smooth_s, self.marks)

    def summary(self) -> dict[str, Any]:
        ft = sorted(self.frame_times)
        return dict(redraws=self.redraws, redraw_hz=self.redraw_hz, full_redraws=self.full_redraws,
                    panel_redraws=self.panel_redraws, cached_strips=self.panel.cached_strips if self.panel else 0,
                    cpu_s=self.cpu_s,
                    loop_cpu_s=self.loop_cpu_s,
                    frame_ms_p50=1000 * ft[len(ft) // 2] if ft else None,
                    frame_ms_max=1000 * ft[-1] if ft else None, errors=list(self.errors))


# -- what it costs ---------------------------------------------------------------------------

def measure_overhead(engine: Any, make_requests: Callable[[Any], list], rounds: int = 3,
                     interval: float = 0.4, **dashboard_options: Any) -> dict[str, Any]:
    """Engine throughput with and without a dashboard attached, in one process, alternating.

    ``make_requests(engine)`` returns a fresh list of requests (the same work each call);
    each run is ``engine.run`` on them, timed, in output tokens per second. Runs go in
    pairs, A B then B A (without, with; with, without; ...), so a drift of the machine's
    load hits both sides alike. Returns:

    * ``ratio``: the median over pairs of (with / without) throughput; 1.0 = no cost;
    * ``cpu_share``: the CPU seconds the dashboard's thread used during the timed runs, per
      second of them: the fraction of one core it took (independent of other processes).
      The first frame (axes and labels drawn in full, a few hundred ms of CPU) is drawn by
      ``start()`` before the run, and the last by ``stop()`` after it: both are left out,
      and reported as ``setup_cpu_s`` (per dashboard);
    * ``redraw_hz``: the slowest redraw rate of the runs with it; the raw numbers.
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    dashboard_options.setdefault("display", False)
    pairs, dashes, walls = [], [], []
    for i in range(rounds):
        tput = {}
        for with_dash in ((False, True) if i % 2 == 0 else (True, False)):
            reqs = make_requests(engine)
            dash = Dashboard(EngineSource(engine), interval=interval, **dashboard_options) if with_dash else None
            if dash is not None:
                dash.start()
            t0 = time.perf_counter()
            outs = engine.run(reqs)
            wall = time.perf_counter() - t0
            if dash is not None:
                dash.stop()
                dashes.append(dash.summary())
                walls.append(wall)
            tput[with_dash] = sum(len(o.token_ids) for o in outs) / wall
        pairs.append((tput[False], tput[True]))
    ratios = sorted(w / wo for wo, w in pairs)
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return dict(ratio=median, ratios=ratios, tok_s_without=[p[0] for p in pairs], tok_s_with=[p[1] for p in pairs],
                cpu_share=sum(d["loop_cpu_s"] for d in dashes) / sum(walls),
                setup_cpu_s=sum(d["cpu_s"] - d["loop_cpu_s"] for d in dashes) / len(dashes),
                redraw_hz=min(d["redraw_hz"] for d in dashes), dashboards=dashes)


__all__ = ["Sample", "EngineSource", "MetricsSource", "Dashboard", "LivePanel", "series", "plot_samples",
           "parse_metrics", "histogram_quantile", "headline", "measure_overhead", "METRIC_NAMES", "PANELS"]
