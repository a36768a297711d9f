"""What the dashboard draws: ``series`` (panel -> line -> points, from the samples alone),
``LivePanel`` (the eight panels redrawn live by blitting), ``headline`` (the latest numbers
as a line of text) and ``plot_samples`` (a whole run as a static figure).

The live panel is drawn the way matplotlib's animations are (*blitting*, as in its
"Faster rendering by using blitting" guide): axes, ticks and labels are drawn once into a
background (``canvas.copy_from_bbox``); each frame restores it (``restore_region``), draws
only the lines (``ax.draw_artist``) and encodes a JPEG (a few ms). Axes grow (at least
doubling, onto round limits: 1, 2, 5 x 10^k), at most every ``full_redraw_every`` seconds
(lines are clipped meanwhile); a growing panel repaints only the pixels left of its axes,
its tick labels (~5 ms, where redrawing the whole panel with its text and legend cost tens).
"""
from __future__ import annotations

import bisect
import hashlib
import io
import math
import time
from typing import Any, Sequence

from minillm.viz.sources import QUANTILES, Sample


# -- series: what the panels plot ---------------------------------------------------------

def _rate(samples: Sequence[Sample], attr: str, smooth_s: float) -> tuple[list[float], list[float]]:
    """d(counter)/dt at each sample, over the last ``smooth_s`` seconds (a moving difference)."""
    xs, ys, j = [], [], 0
    for i, s in enumerate(samples):
        while samples[j].t < s.t - smooth_s and j < i:
            j += 1
        a = samples[j] if j < i else (samples[i - 1] if i else None)
        if a is None or s.t <= a.t or getattr(s, attr) is None or getattr(a, attr) is None:
            continue  # a counter the source cannot read (None) has no rate
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
        "batch and queue": {"batch": col(lambda s: s.batch_size), "waiting": col(lambda s: s.waiting)},
        "KV blocks": {"used": col(lambda s: s.kv_blocks_used), "cached": col(lambda s: s.kv_blocks_cached)},
        "preemptions": {"total": col(lambda s: s.preemptions)},
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
# The Sample fields each panel draws: a panel whose fields the source never knew (None, or an
# empty latency dict: a server that exports no such metric, an engine without speculation) says n/a.
PANEL_FIELDS = {"load (req/s)": ("finished",), "output tokens/s": ("output_tokens",), "TTFT (s)": ("ttft",),
                "ITL (s)": ("itl",), "batch and queue": ("batch_size", "waiting"), "KV blocks": ("kv_blocks_used",),
                "preemptions": ("preemptions",), "spec acceptance": ("spec_drafts",)}


def missing_panels(samples: Sequence[Sample]) -> list[str]:
    """The panels none of whose fields any of ``samples`` knows: what the dashboard marks n/a."""
    return [name for name, fields in PANEL_FIELDS.items()
            if samples and all(getattr(s, f) in (None, {}) for s in samples for f in fields)]


def headline(s: Sample | None) -> str:
    """The latest numbers as one line of text."""
    if s is None:
        return "no sample yet"

    def n(v):  # None: the source cannot know it (a server that does not export it)
        return "n/a" if v is None else f"{v}"

    def ms(d):  # {}: no such histogram; a None quantile: nothing observed yet
        return "n/a" if not d else "/".join("-" if d.get(f"p{q}") is None else f"{d[f'p{q}'] * 1000:.0f}"
                                            for q in QUANTILES)

    if s.kv_blocks_used is not None:
        kv = f"{s.kv_blocks_used}/{n(s.kv_blocks_total)}"
        if s.kv_usage is not None:
            kv += f" ({s.kv_usage:.0%})"
    else:
        kv = "n/a" if s.kv_usage is None else f"{s.kv_usage:.0%}"
    if s.kv_blocks_cached is not None:
        kv += f" ({s.kv_blocks_cached} cached)"
    acc = "n/a" if s.spec_drafts is None else "-" if not s.spec_drafts else f"{s.spec_accepted / s.spec_drafts:.2f}"
    hits = ("n/a" if s.prefix_cache_hits is None or s.prefix_cache_queries is None
            else "-" if not s.prefix_cache_queries else f"{s.prefix_cache_hits / s.prefix_cache_queries:.0%}")
    classes = "".join(f", {c}: {k}" for c, k in sorted(s.waiting_by_class.items()))
    pct = "/".join(f"p{q}" for q in QUANTILES)
    return (f"t={s.t:.1f}s · offered {n(s.arrived)} / served {n(s.finished)} requests · "
            f"{n(s.output_tokens)} tokens out, {n(s.prompt_tokens)} in · "
            f"batch {n(s.batch_size)}, running {n(s.running)}, waiting {n(s.waiting)}{classes} · "
            f"TTFT {pct} {ms(s.ttft)} ms · ITL {ms(s.itl)} ms · E2E {ms(s.e2e)} ms · KV {kv} · "
            f"prefix hits {hits} · preempted {n(s.preemptions)} · spec acceptance {acc}"
            + ("" if s.token_budget is None else f" · SLO token budget {s.token_budget} ({n(s.slo_adjustments)} changes)"))


# The panels where the SLO controller's budget changes are marked (the p95s it watches).
SLO_PANELS = ("TTFT (s)", "ITL (s)")


def slo_marks(samples: Sequence[Sample]) -> list[float]:
    """The times of the samples at which the SLO controller had changed the budget since the
    sample before (``Sample.slo_adjustments`` grew): one mark per change seen."""
    out, last = [], None
    for s in samples:
        n = s.slo_adjustments
        if n is not None and last is not None and n > last:
            out.append(s.t)
        if n is not None:
            last = n
    return out


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
        for ax in list(self.axes.values())[4:]:
            ax.set_xlabel("seconds ago", fontsize=7)
        self.window_s = window_s
        # The SLO controller's budget changes: dotted verticals on the panels of the p95s it watches.
        self.mark_lines = {name: self.axes[name].plot([], [], color="C3", lw=0.8, ls=":", animated=True)[0]
                           for name in SLO_PANELS}
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

    def set_ymax(self, panel: str, ymax: float) -> None:
        """A known upper limit (e.g. the KV cache's blocks), so the axis need not grow into it."""
        self.axes[panel].set_ylim(0, ymax)

    def set_missing(self, panels: Sequence[str]) -> None:
        """Title these panels "n/a" (nothing the source knows to draw in them); before the first frame,
        which draws the titles into the background."""
        for name in panels:
            self.axes[name].set_title(f"{name}: n/a", fontsize=8, y=1.0)

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

    def draw(self, data: dict[str, dict[str, tuple[list, list]]], now: float, fmt: str = "jpeg",
             marks: Sequence[float] = ()) -> bytes:
        """One frame: lines only, after redrawing any panel whose axis must grow (rate-limited).
        ``marks``: times of the SLO controller's budget changes (``slo_marks``), drawn as verticals."""
        if self.background is None:
            self._limits(data, now)
            self.canvas.draw()  # everything but the animated lines: the background
            self.background = self.canvas.copy_from_bbox(self.fig.bbox)
            self._freeze_layout()
            self.last_full = now
            self.full_redraws += 1
        elif now - self.last_full >= self.full_redraw_every:
            changed = self._limits(data, now)
            if changed:
                self._redraw_panels(changed)
                self.last_full = now
                self.panel_redraws += len(changed)
        self.canvas.restore_region(self.background)
        self._draw_lines(data, now)
        self._draw_marks(marks, now)
        return self.encode(fmt)

    def _draw_marks(self, marks: Sequence[float], now: float) -> None:
        shown = [t - now for t in marks if now - self.window_s <= t <= now]
        if not shown:
            return
        for name, line in self.mark_lines.items():
            y0, y1 = self.axes[name].get_ylim()
            xs = [x for t in shown for x in (t, t, math.nan)]
            line.set_data(xs, [y for _ in shown for y in (y0, y1, math.nan)])
            self.axes[name].draw_artist(line)

    def _draw_lines(self, data: dict[str, dict[str, tuple[list, list]]], now: float) -> None:
        """Each panel's lines onto the restored background, by ``ax.draw_artist`` (clipped to the panel).

        Measured against drawing the same paths straight into the renderer (what this did
        before, with the same pixels): ~1.2 ms more per frame (5.5 vs 4.3 ms of CPU), 0.2%
        of one core at 2.5 frames per second: too little to keep a renderer of our own for."""
        for k, (name, ax) in enumerate(self.axes.items()):
            for line, (x, y) in zip(self.lines[name], list(data[name].values())[:MAX_LINES]):
                line.set_data(*self._visible(x, y, now))
                ax.draw_artist(line)
            if k == 3:  # halfway: let the engine's thread take the GIL (the encoder releases it at the end)
                time.sleep(0)

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
    missing = missing_panels(samples)
    fig, axes = plt.subplots(2, 4, figsize=(14, 5.5))
    for (name, lines), ax in zip(data.items(), axes.flat):
        if name in missing:
            ax.text(0.5, 0.5, "n/a", transform=ax.transAxes, ha="center", va="center", color="gray", fontsize=14)
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
    budget = [(s.t, s.token_budget) for s in samples if s.token_budget is not None]
    if budget:  # the SLO controller's budget (tokens per step) on an axis of its own
        twin = axes[1][0].twinx()
        twin.step([t for t, _ in budget], [b for _, b in budget], where="post", color="C3", lw=1.0)
        twin.set_ylabel("token budget", fontsize=8, color="C3")
        twin.tick_params(labelsize=7, colors="C3")
        twin.set_ylim(0, 1.1 * max(b for _, b in budget))
    for t in slo_marks(samples):
        for ax in axes.flat:
            if ax.get_title() in SLO_PANELS:
                ax.axvline(t, color="C3", lw=0.6, ls=":")
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


__all__ = ["LivePanel", "series", "plot_samples", "headline", "missing_panels", "slo_marks", "PANELS",
           "PANEL_FIELDS", "SLO_PANELS", "MAX_LINES"]
