"""Charts of engine runs, and an interactive explorer for teaching.

Everything here reads ``RunResult``s (summary.py): real runs, transformers baselines and
simulated runs (cost_model.py) look the same, so every chart works for all of them.

    plot_timeline          Gantt chart: batch slots x steps, one colour per request;
                           prefill cells hatched, slots held by a finished request grey
    plot_utilization       useful share of each step's token-slots over time
    plot_kv_memory         KV bytes reserved vs holding real tokens, over time
    plot_latency_cdfs      TTFT / TPOT / E2E distributions of several runs
    plot_throughput_vs_batch  output tokens/s against max batch size
    plot_block_tables      paged KV: each request's logical blocks -> physical blocks of the pool
    explorer               ipywidgets: engine, max batch, skew, arrival rate -> instant
                           redraw from the cost model; a button checks a point for real
"""
from __future__ import annotations

import contextlib

from typing import Any, Callable, Mapping, Sequence

from minillm.metrics import StepRecord
from minillm.bench.summary import RunResult, e2es, slot_utilization, tpots, ttfts

IDLE_COLOR = "#d0d0d0"


def _plt():
    import matplotlib.pyplot as plt

    return plt


def request_color(request_id: str):
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    try:
        k = int(request_id)
    except ValueError:
        k = sum(map(ord, request_id))
    return cmap(_PALETTE[(k * 7) % len(_PALETTE)])  # neighbours in arrival order get distant colours


_PALETTE = [i for i in range(20) if i not in (14, 15)]  # tab20 without its greys (grey means idle)


def assign_lanes(steps: Sequence[StepRecord], num_slots: int | None = None) -> dict[str, int]:
    """A batch-slot lane for each request: the lowest lane free over the steps it holds.

    A request holds its lane from the first step it runs to the last step it runs or
    keeps a slot (``held_ids``: static batching's finished members). A lane frees for the
    step after its holder's last step, as a KV slot does.
    """
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in steps:
        for rid in [*s.request_ids, *s.held_ids]:
            first.setdefault(rid, s.step)
            last[rid] = s.step
    lane_free_at: list[int] = []  # lane -> first step it is free again
    lanes: dict[str, int] = {}
    for rid in sorted(first, key=lambda r: (first[r], last[r])):
        for i, free in enumerate(lane_free_at):
            if free <= first[rid]:
                lanes[rid] = i
                lane_free_at[i] = last[rid] + 1
                break
        else:
            lanes[rid] = len(lane_free_at)
            lane_free_at.append(last[rid] + 1)
    return lanes


def _runs(cells: list[tuple[float, float, Any]]):
    """Merge consecutive cells with the same key into (start, width, key) runs."""
    out: list[list[Any]] = []
    for x0, x1, key in cells:
        if out and out[-1][2] == key and abs(out[-1][0] + out[-1][1] - x0) < 1e-12:
            out[-1][1] = x1 - out[-1][0]
        else:
            out.append([x0, x1 - x0, key])
    return out


def plot_timeline(result: RunResult | Sequence[StepRecord], ax=None, x: str = "step", title: str | None = None,
                  max_steps: int | None = None, num_slots: int | None = None):
    """Gantt chart of batch slots over steps (``x='step'``) or wall time (``x='time'``).

    Coloured: a request's row in that step (hatched when it prefills); grey: a slot kept
    by a request that already finished (static batching waits for its group); white:
    an empty slot.
    """
    from matplotlib.patches import Patch

    plt = _plt()
    steps = list(result.steps if isinstance(result, RunResult) else result)
    if max_steps is not None:
        steps = steps[:max_steps]
    if num_slots is None:
        num_slots = result.num_slots if isinstance(result, RunResult) else max((s.num_slots for s in steps), default=1)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 0.35 * max(num_slots, 4) + 1.2))
    lanes = assign_lanes(steps, num_slots)
    t0 = steps[0].start if steps else 0.0
    per_lane: dict[int, list[tuple[float, float, Any]]] = {}
    prev_end = 0.0
    for s in steps:
        # In time, a step's cell starts where the previous one ended (the scheduling time
        # between forwards belongs to the step), so a request's bar has no hairline gaps;
        # a real pause (waiting for arrivals) stays visible.
        if x == "step":
            x0, x1 = s.step, s.step + 1
        else:
            x0, x1 = s.start - t0, s.end - t0
            if 0 < x0 - prev_end < 0.1 * (x1 - x0):
                x0 = prev_end
            prev_end = x1
        for rid, n in zip(s.request_ids, s.num_new_tokens):
            per_lane.setdefault(lanes[rid], []).append((x0, x1, (rid, n > 1)))
        for rid in s.held_ids:
            per_lane.setdefault(lanes[rid], []).append((x0, x1, (None, False)))
    for lane, cells in per_lane.items():
        for start, width, (rid, prefill) in _runs(cells):
            color = IDLE_COLOR if rid is None else request_color(rid)
            ax.broken_barh([(start, width)], (lane - 0.4, 0.8), facecolors=color,
                           hatch="////" if prefill else None, edgecolor="black" if prefill else color, linewidth=0.3)
    n_lanes = max([num_slots, *[v + 1 for v in lanes.values()]]) if lanes else num_slots
    ax.set_ylim(-0.6, n_lanes - 0.4)
    ax.set_yticks(range(n_lanes))
    ax.set_ylabel("batch slot")
    ax.set_xlabel("engine step" if x == "step" else "time (s)")
    ax.invert_yaxis()
    if steps:
        ax.set_xlim(0, steps[-1].step + 1 if x == "step" else steps[-1].end - t0)
    util = slot_utilization(steps) if steps else 0.0
    ax.set_title(title or f"{getattr(result, 'engine', 'run')}: {len(steps)} steps, slot utilization {util:.0%}")
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch="////", label="prefill"),
                       Patch(facecolor=IDLE_COLOR, label="slot held, request finished"),
                       Patch(facecolor="white", edgecolor="#999999", label="empty slot")],
              loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize="small", framealpha=0.9)
    return ax


def _results(results: RunResult | Sequence[RunResult] | Mapping[str, RunResult]) -> dict[str, RunResult]:
    if isinstance(results, RunResult):
        return {results.engine: results}
    if isinstance(results, Mapping):
        return dict(results)
    return {r.engine: r for r in results}


def plot_utilization(results, ax=None, window: int = 1):
    """Useful share of each step's token-slots against time (``window``: moving average)."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    for name, r in _results(results).items():
        if not r.steps:
            continue
        t0 = r.start
        xs = [s.end - t0 for s in r.steps]
        ys = [s.utilization for s in r.steps]
        if window > 1:
            ys = [sum(ys[max(0, i - window + 1):i + 1]) / len(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]
        ax.step(xs, ys, where="post", label=f"{name} (overall {slot_utilization(r.steps):.0%})")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("useful / total token-slots")
    ax.set_title("slot utilization over time")
    ax.legend(fontsize="small")
    return ax


def plot_kv_memory(results, ax=None):
    """KV memory held by requests (solid) and the part holding real tokens (dashed)."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    for name, r in _results(results).items():
        if not r.steps:
            continue
        xs = [s.end - r.start for s in r.steps]
        line, = ax.step(xs, [s.kv_reserved_bytes / 2**20 for s in r.steps], where="post", label=f"{name} reserved")
        ax.step(xs, [s.kv_used_bytes / 2**20 for s in r.steps], where="post", linestyle="--", color=line.get_color(),
                label=f"{name} used")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV cache (MiB)")
    ax.set_title("KV memory: reserved vs holding tokens")
    ax.legend(fontsize="small")
    return ax


def _cdf(ax, values, label):
    xs = sorted(values)
    if xs:
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot_latency_cdfs(results, axes=None):
    """CDFs of TTFT, TPOT and end-to-end latency, one line per run."""
    plt = _plt()
    if axes is None:
        _, axes = plt.subplots(1, 3, figsize=(13, 3.2))
    for name, r in _results(results).items():
        for ax, values in zip(axes, (ttfts(r.metrics), tpots(r.metrics), e2es(r.metrics))):
            _cdf(ax, values, name)
    for ax, label in zip(axes, ("TTFT (s)", "TPOT (s / token)", "end-to-end latency (s)")):
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize="small")
    return axes


def plot_throughput_vs_batch(points: Mapping[str, Sequence[tuple[int, float]]], ax=None):
    """``points``: engine -> [(max_num_seqs, output tokens/s), ...]."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.5))
    for name, pts in points.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max batch size (max_num_seqs)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput vs max batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


def plot_block_tables(tables: Mapping[str, Sequence[int]], num_blocks: int, block_size: int,
                      num_tokens: Mapping[str, int] | None = None, ax=None, title: str | None = None,
                      pool_columns: int | None = None, arrows: bool | None = None):
    """Block tables drawn: each request's logical blocks (left) -> physical blocks of the pool (right).

    ``tables``: request id -> its block table (``request.block_ids``). ``num_tokens``:
    request id -> tokens it has in the cache; the last block of each request is then
    filled in proportion (the rest of it is the request's only waste). The pool shows
    every physical block, coloured by its holder (white: free). Arrows join each logical
    block to its physical block (by default only while there are few enough to read).
    """
    import math

    from matplotlib.patches import Rectangle

    plt = _plt()
    num_tokens = num_tokens or {}
    ids = list(tables)
    width = max((len(t) for t in tables.values()), default=1)
    if pool_columns is None:  # a roughly square pool, at most 16 wide
        pool_columns = min(16, max(4, math.ceil(math.sqrt(num_blocks))))
    cols = max(1, min(pool_columns, num_blocks))
    rows = -(-num_blocks // cols)
    x0 = width + 2.5  # where the pool starts
    if ax is None:
        _, ax = plt.subplots(figsize=(min(14, 0.45 * (x0 + cols) + 1.5), 0.45 * max(len(ids), rows) + 1.4))
    owner: dict[int, str] = {}  # physical block -> the request holding it
    for i, rid in enumerate(ids):
        color = request_color(rid)
        table = list(tables[rid])
        n = num_tokens.get(rid)
        ax.text(-0.3, i, f"req {rid}", ha="right", va="center", fontsize="small")
        for j, b in enumerate(table):
            owner[b] = rid
            fill = 1.0
            if n is not None:
                fill = min(max(n - j * block_size, 0), block_size) / block_size
            ax.add_patch(Rectangle((j + 0.05, i - 0.4), 0.9, 0.8, facecolor="white", edgecolor=color, linewidth=1.2))
            if fill:
                ax.add_patch(Rectangle((j + 0.05, i - 0.4), 0.9 * fill, 0.8, facecolor=color, edgecolor="none"))
            ax.text(j + 0.5, i, str(b), ha="center", va="center", fontsize="x-small")
    for b in range(num_blocks):
        cx, cy = x0 + b % cols, b // cols
        holder = owner.get(b)
        face = request_color(holder) if holder else "white"
        ax.add_patch(Rectangle((cx + 0.05, cy - 0.4), 0.9, 0.8, facecolor=face, edgecolor="#888888", linewidth=0.6))
        ax.text(cx + 0.5, cy, str(b), ha="center", va="center", fontsize="x-small",
                color="black" if holder else "#888888")
    if arrows is None:
        arrows = len(owner) <= 48
    if arrows:
        for i, rid in enumerate(ids):
            for j, b in enumerate(tables[rid]):
                ax.annotate("", xy=(x0 + b % cols + 0.05, b // cols), xytext=(j + 0.95, i),
                            arrowprops=dict(arrowstyle="->", color=request_color(rid), alpha=0.55, lw=0.9,
                                            connectionstyle="arc3,rad=-0.08"))
    ax.text(width / 2, -0.9, "block table: logical block -> physical id", ha="center", fontsize="small")
    ax.text(x0 + cols / 2, -0.9, f"physical pool: {num_blocks} blocks of {block_size} tokens", ha="center",
            fontsize="small")
    ax.set_xlim(-2.2, x0 + cols + 0.2)
    ax.set_ylim(max(len(ids), rows) - 0.4, -1.3)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return ax


def summary_line(r: RunResult) -> str:
    from minillm.bench.summary import percentiles

    ttft = percentiles(ttfts(r.metrics))
    return (f"{r.engine}: {r.throughput:.1f} output tok/s, {len(r.steps)} steps, slot utilization "
            f"{slot_utilization(r.steps):.0%}, TTFT p50 {ttft['p50']:.2f} s / p99 {ttft['p99']:.2f} s")


def explorer(cost, num_requests: int = 32, seed: int = 0, short_tokens: int = 20,
             confirm: Callable[[dict[str, Any]], RunResult] | None = None, max_model_len: int | None = None):
    """Sliders -> a simulated run of the real scheduler (``cost_model.simulate``), redrawn.

    ``cost``: a fitted ``CostModel``. ``confirm(settings)``, when given, runs the real
    engine at the sliders' point and returns its RunResult; the button shows it next to
    the simulation. Settings keys: engine, max_num_seqs, long_tokens, rate, num_requests, seed.
    """
    import ipywidgets as W
    from IPython.display import display

    from minillm.bench.cost_model import simulate
    from minillm.bench.workload import make_workload

    plt = _plt()
    engine = W.ToggleButtons(options=["static", "continuous"], value="continuous", description="engine")
    batch = W.IntSlider(value=8, min=1, max=32, description="max batch")
    skew = W.IntSlider(value=800, min=short_tokens, max=1600, step=20, description="long req. tokens",
                       style={"description_width": "initial"})
    rate = W.FloatSlider(value=0.0, min=0.0, max=20.0, step=0.5, description="arrivals/s (0=offline)",
                         style={"description_width": "initial"})
    button = W.Button(description="Confirm on the real model", icon="check")
    out = W.Output()
    note = W.HTML()

    def settings() -> dict[str, Any]:
        return dict(engine=engine.value, max_num_seqs=batch.value, long_tokens=skew.value, rate=rate.value,
                    num_requests=num_requests, seed=seed)

    def workload_for(s):
        return make_workload("skewed", s["num_requests"], s["seed"], short_tokens=short_tokens,
                             long_tokens=s["long_tokens"], rate=s["rate"] or None)

    def redraw(*_, into=out):
        s = settings()
        wl = workload_for(s)
        sim = simulate(wl, s["engine"], s["max_num_seqs"], max_model_len=max_model_len, cost=cost)
        with into if into is not None else contextlib.nullcontext():
            if into is not None:
                into.clear_output(wait=True)
            fig = plt.figure(figsize=(12, 6.5))
            grid = fig.add_gridspec(2, 2, height_ratios=[1.3, 1])
            plot_timeline(sim, fig.add_subplot(grid[0, :]))
            plot_utilization(sim, fig.add_subplot(grid[1, 0]))
            ax = fig.add_subplot(grid[1, 1])
            _cdf(ax, ttfts(sim.metrics), "TTFT")
            _cdf(ax, e2es(sim.metrics), "E2E")
            ax.set_xlabel("seconds (simulated)")
            ax.set_title("latency CDF")
            ax.legend(fontsize="small")
            fig.tight_layout()
            plt.show()
            print(summary_line(sim))
        return sim

    def check(_):
        if confirm is None:
            note.value = "<i>no real engine attached (pass confirm=...)</i>"
            return
        s = settings()
        note.value = "<i>running the real model...</i>"
        sim = simulate(workload_for(s), s["engine"], s["max_num_seqs"], max_model_len=max_model_len, cost=cost)
        real = confirm(s)
        note.value = (f"<b>measured</b> {real.throughput:.1f} tok/s, slot utilization "
                      f"{slot_utilization(real.steps):.0%} &nbsp;|&nbsp; <b>simulated</b> {sim.throughput:.1f} tok/s, "
                      f"{slot_utilization(sim.steps):.0%}")

    for w in (engine, batch, skew, rate):
        w.observe(redraw, names="value")
    button.on_click(check)
    ui = W.VBox([W.HBox([engine, batch]), W.HBox([skew, rate]), W.HBox([button, note]), out])
    display(ui)
    # The first figure is an ordinary output of the cell, so a saved notebook shows it;
    # a moved control redraws inside the widget, under the controls.
    note.value = "<i>move a control: the chart is redrawn here</i>"
    redraw(into=None)
    return ui


# -- chapter 6: the prefix cache and priority classes ----------------------------------------

def plot_prefix_tables(tables: Mapping[str, Sequence[int]], hashes: Mapping[str, Sequence[int]], num_blocks: int,
                       evictable: Sequence[int] = (), ax=None, title: str | None = None):
    """Block tables with the hash chain: each request's blocks, left to right, name their
    physical block (big) and the chained hash of their full block (small, ``#xxxx``; a
    partial block has none). A physical block has one colour wherever it appears, so a
    shared prefix is a run of equal colours across rows. The pool on the right: blocks held
    by one request, shared by several (bold edge), evictable (free but cached: hatched), free.
    """
    from matplotlib.patches import Rectangle

    plt = _plt()
    ids = list(tables)
    width = max((len(t) for t in tables.values()), default=1)
    holders: dict[int, int] = {}
    for t in tables.values():
        for b in t:
            holders[b] = holders.get(b, 0) + 1
    cmap = plt.get_cmap("tab20")
    color = lambda b: cmap(b % 20)  # noqa: E731
    cols = min(16, max(4, num_blocks))
    rows = -(-num_blocks // cols)
    x0 = width + 1.5
    if ax is None:
        _, ax = plt.subplots(figsize=(min(15, 0.62 * (x0 + cols) + 1.5), 0.62 * max(len(ids), rows) + 1.4))
    for i, rid in enumerate(ids):
        ax.text(-0.3, i, f"req {rid}", ha="right", va="center", fontsize="small")
        hs = list(hashes.get(rid, []))
        for j, b in enumerate(tables[rid]):
            shared = holders[b] > 1
            ax.add_patch(Rectangle((j + 0.04, i - 0.42), 0.92, 0.84, facecolor=color(b), alpha=0.85,
                                   edgecolor="black" if shared else "none", linewidth=1.6 if shared else 0))
            ax.text(j + 0.5, i - 0.08, str(b), ha="center", va="center", fontsize="small", weight="bold")
            label = f"#{hs[j] & 0xFFFF:04x}" if j < len(hs) else "partial"
            ax.text(j + 0.5, i + 0.25, label, ha="center", va="center", fontsize=6)
    evict = set(evictable)
    for b in range(num_blocks):
        cx, cy = x0 + b % cols, b // cols
        if b in holders:
            face, hatch, edge = color(b), None, "black" if holders[b] > 1 else "#888888"
        elif b in evict:
            face, hatch, edge = "#f3f3f3", "////", "#888888"
        else:
            face, hatch, edge = "white", None, "#bbbbbb"
        ax.add_patch(Rectangle((cx + 0.05, cy - 0.4), 0.9, 0.8, facecolor=face, hatch=hatch, edgecolor=edge,
                               linewidth=1.4 if holders.get(b, 0) > 1 else 0.6))
        ax.text(cx + 0.5, cy, str(b), ha="center", va="center", fontsize="x-small")
    ax.text(width / 2, -0.95, "block tables: physical id, #hash of the full block", ha="center", fontsize="small")
    ax.text(x0 + cols / 2, -0.95, "pool: held, shared (bold), evictable (hatched), free", ha="center",
            fontsize="small")
    ax.set_xlim(-2.0, x0 + cols + 0.2)
    ax.set_ylim(max(len(ids), rows) - 0.4, -1.4)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    return ax


def plot_cached_blocks(results, ax=None):
    """Blocks holding a cached prefix over time (solid) and, of those, the free, evictable ones (dashed)."""
    from minillm.bench.summary import cached_blocks_over_time

    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    for k, (name, r) in enumerate(_results(results).items()):
        t, cached, evictable = cached_blocks_over_time(r.steps, r.start)
        c = f"C{k}"
        ax.step(t, cached, where="post", color=c, label=f"{name}: cached")
        ax.step(t, evictable, where="post", color=c, ls="--", label=f"{name}: of which evictable")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("KV blocks")
    ax.set_title("the prefix cache over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


CLASS_COLORS = {"interactive": "tab:red", "standard": "tab:blue", "batch": "tab:gray"}


def plot_class_ttft_cdfs(results, ax=None, metric: str = "ttft"):
    """CDFs of TTFT (or ``metric="e2e"``) per priority class: colour = class, line style = run."""
    plt = _plt()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    styles = ["-", "--", ":", "-."]
    for k, (name, r) in enumerate(_results(results).items()):
        groups: dict[str, list[float]] = {}
        for m in r.metrics:
            v = m.ttft if metric == "ttft" else m.e2e
            if v is not None:
                groups.setdefault(m.priority_class, []).append(v)
        for cls, values in groups.items():
            xs = sorted(values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", ls=styles[k % len(styles)],
                    color=CLASS_COLORS.get(cls, None), label=f"{cls}, {name}")
    ax.set_xscale("log")
    ax.set_xlabel(("TTFT" if metric == "ttft" else "end-to-end latency") + " (s, log scale)")
    ax.set_ylabel("fraction of the class's requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return ax


__all__ = ["plot_prefix_tables", "plot_cached_blocks", "plot_class_ttft_cdfs", "plot_timeline", "plot_utilization", "plot_kv_memory", "plot_latency_cdfs", "plot_throughput_vs_batch",
           "explorer", "assign_lanes", "request_color", "summary_line", "plot_block_tables"]
