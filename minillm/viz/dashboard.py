"""A live dashboard: what a serving engine is doing, redrawn while it runs.

    dash = Dashboard(EngineSource(engine))              # in-process: the engine's own state
    dash = Dashboard(MetricsSource(url + "/metrics"))   # a server (minillm, vLLM, SGLang), through its Prometheus text
    with dash:                                          # a background thread samples and redraws
        run_the_load()
    dash.figure()                                       # the whole run as a static chart

Eight panels: offered vs served load (requests/s), output tokens/s, TTFT and ITL
p50/p95/p99 over a sliding window, batch size and queue depth (per priority class when
the scheduler has classes), KV blocks used (and cached, with prefix caching),
preemptions, and the acceptance rate of speculative decoding. A panel the source cannot
fill (a server that exports no such metric, an engine without speculation) says "n/a",
and so do such numbers in the text line; a server's flavor (minillm, vLLM, SGLang) and
address are in the title. An engine with an SLO controller (``minillm/slo.py``) has each
change of its token budget marked on the TTFT and ITL panels, the budget in the text line,
and the budget over time on the static figure.

Three modules: ``sources.py`` (``EngineSource``, ``MetricsSource``: the samples),
``panel.py`` (``series``, ``LivePanel``, ``plot_samples``: the drawing) and this one (the
``Dashboard`` that ties them together in a thread, and ``measure_overhead``). Their public
names are importable from here.

Why it does not slow the engine down. The sampler reads the engine's snapshot and the
new tokens of live requests (microseconds). Drawing is the expensive part: on a small CPU
one full matplotlib draw of eight panels takes a few hundred milliseconds, all of it
holding the GIL the engine's thread needs between its torch calls. So the panel is
drawn the way animations are (*blitting*, ``panel.py``): axes and labels once, then only
the lines each frame, and a JPEG (a few ms). The latest numbers go in an HTML line next
to the image, which the browser renders. ``measure_overhead`` checks the cost: engine
throughput with and without a dashboard attached, alternating.

Headless (no display, nbval, a script), everything still runs: frames are drawn and
kept in ``last_frame`` (JPEG bytes); only the widget is not shown.
"""
from __future__ import annotations

import bisect
import html
import threading
import time
from typing import Any, Callable

from minillm.viz.panel import (MAX_LINES, PANELS, LivePanel, headline, missing_panels, plot_samples, series,
                               slo_marks)
from minillm.viz.sources import (METRIC_NAMES, EngineSource, MetricsSource, Sample, detect_flavor,
                                 histogram_quantile, parse_metrics)


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
                    if self.panel.background is None:  # before the first frame: what the source cannot tell
                        self.panel.set_missing(missing_panels(self.samples[-1:]))
                    # Only the samples the window shows (and the smoothing before it): a frame
                    # costs the same after an hour as after a minute.
                    now = self.samples[-1].t
                    first = bisect.bisect_left(self.samples, now - self.panel.window_s - self.smooth_s - 1,
                                               key=lambda x: x.t)
                    self.last_frame = self.panel.draw(series(self.samples[first:], self.smooth_s), now,
                                                      marks=slo_marks(self.samples[first:]))
                if self._image is not None:
                    self._image.value = self.last_frame or b""
                    heading = self.heading()
                    self._text.value = ("<tt style='font-size:11px'>" + (f"<b>{html.escape(heading)}</b> · " if heading
                                        else "") + f"{headline(self.samples[-1])}</tt>")
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

    def heading(self, title: str | None = None) -> str | None:
        """The dashboard's title: ``title`` (else the one it was given), with the server it reads
        when the source says (``MetricsSource.describe``: "vllm server, http://...")."""
        title = title or self.title
        describe = getattr(self.source, "describe", None)
        if describe is None:
            return title
        return f"{title} ({describe()})" if title else describe()

    def figure(self, title: str | None = None):
        """The whole run as a static pyplot figure."""
        return plot_samples(self.samples, self.heading(title), self.smooth_s, self.marks)

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
           "parse_metrics", "detect_flavor", "histogram_quantile", "headline", "missing_panels", "measure_overhead",
           "METRIC_NAMES", "PANELS", "MAX_LINES"]
