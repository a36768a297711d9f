"""Latency under load: open-loop Poisson traffic at rising rates, for several engines.

    points = sweep_engines(lab, ["paged", "paged+ngram"], rates=[0.5, 1, 2, 4], num_requests=8,
                           output_tokens=16)
    saturation_knee(points_of(points, "paged"))          # the rate where latency takes off
    spec_crossover(points_of(points, "paged"), points_of(points, "paged+ngram"))
    plot_latency_vs_load(points)

*Open loop*: requests arrive at Poisson times whatever the engine is doing (independent
users), unlike a closed loop (a fixed number of clients, each waiting for its answer),
which slows its own arrivals down when the engine is slow and so hides the queueing.
Each run adds a request to the engine when its arrival time comes and steps the engine
meanwhile, as a server does; the engine runs in this process, so the numbers are the
engine's own (``sweep_server`` measures the same through the HTTP server and the load
generator, ``minillm.bench.loadgen``).

Each point's ``summary`` has the keys of ``minillm.bench.loadgen.LoadResult.summary()``:
rate, throughput_tok_s (output tokens / (last finish - first arrival)), ttft_p50/p95/p99,
tpot_p50, itl_p95, e2e_p50, goodput (requests per second that met both SLOs: TTFT <=
slo_ttft and TPOT <= slo_tpot), num_ok, num_failed.

The *saturation knee* is the lowest rate whose median TTFT is more than ``factor`` (2) times
the median TTFT at the lowest rate: queueing, not computing, now sets the latency.
Speculation *stops paying* at the lowest rate from which on its TPOT (or the metric
given) is no better than the baseline's.

    python -m minillm.bench.sweep --configs all --rates 0.25,0.5,1,2,3 --num-requests 16 \\
        --output-tokens 32 --json sweep.json --plot sweep.png
    python -m minillm.bench.sweep --capacity-fractions 0.25,0.5,0.75,1,1.5 ...   # rates from this machine

Chapter 7's exercises plug in here (``minillm/seams.py``): ``poisson_arrivals`` makes every
run's arrival times (through ``arrival_offsets``), ``goodput`` counts each run's goodput
(``summarize_requests``), and ``next_token_budget`` is the rule of ``slo_token_budget``, the
controller that ``run_open_loop(..., slo_itl=...)`` applies between engine steps (the rule
is ``minillm/slo.py``'s, which the engine itself runs with ``EngineConfig.slo``).
"""
from __future__ import annotations

import argparse
import json
import math
import numbers
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from minillm.bench import loadgen
from minillm.bench.summary import percentiles
from minillm.sampling_params import SamplingParams
from minillm.slo import check_budget_settings, checked_budget, slo_token_budget

# The engines of the sweep: EngineConfig options on top of the common ones (max_num_seqs, ...).
NGRAM = dict(method="ngram", num_speculative_tokens=4)
CONFIGS: dict[str, dict[str, Any]] = {
    "continuous": dict(engine="continuous"),
    "paged": dict(engine="paged"),
    "paged+chunked": dict(engine="paged", enable_chunked_prefill=True, max_num_batched_tokens=64),
    "paged+ngram": dict(engine="paged", speculative=dict(NGRAM, disable_by_batch_size=None)),
    "paged+ngram+off-switch": dict(engine="paged", speculative=dict(NGRAM, disable_by_batch_size=4)),
}
SUMMARY_KEYS = ("rate", "throughput_tok_s", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "itl_p95", "e2e_p50",
                "goodput", "num_ok", "num_failed")


@dataclass
class RatePoint:
    """One engine at one offered rate."""

    config: str
    rate: float
    summary: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)  # preemptions, acceptance, mean batch, ...

    def __getitem__(self, key: str) -> Any:
        return self.summary[key] if key in self.summary else self.extra[key]


# -- checks ---------------------------------------------------------------------------------

def check_rate(rate: Any, name: str = "rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"{name} must be a finite number of requests per second > 0, got {rate!r}")
    return float(rate)


def check_rates(rates: Sequence[Any]) -> list[float]:
    if isinstance(rates, (str, bytes)) or not isinstance(rates, Sequence) or not rates:
        raise ValueError(f"rates must be a non-empty list of requests per second, got {rates!r}")
    return [check_rate(r, "every rate") for r in rates]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _check_configs(configs: Sequence[str] | dict[str, dict]) -> dict[str, dict]:
    if isinstance(configs, dict):
        return dict(configs)
    if isinstance(configs, str):
        configs = list(CONFIGS) if configs == "all" else [c.strip() for c in configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        raise ValueError(f"unknown config {', '.join(map(repr, bad)) or 'list (empty)'}; valid configs: "
                         f"{', '.join(CONFIGS)}, 'all', or a dict name -> EngineConfig options")
    return {c: CONFIGS[c] for c in configs}


# -- arrivals and the numbers of one run -------------------------------------------------------

def arrival_offsets(rate: float, n: int, seed: int = 0) -> list[float]:
    """Seconds after the start at which ``n`` Poisson arrivals at ``rate`` per second come:
    the first at 0, then exponential gaps of mean 1 / rate. The load generator's own
    (``minillm.bench.loadgen.poisson_arrivals``), so an in-process sweep and one through the
    server see the same arrivals; with one seed, every rate scales the same pattern. A plugged
    ``poisson_arrivals`` (chapter 7) makes them."""
    return loadgen.poisson_arrivals(check_rate(rate), _positive_int("n", n), seed)


def representative_seed(n: int, tolerance: float = 0.1, start: int = 0) -> int:
    """The first seed from ``start`` whose ``n`` Poisson arrivals have a mean gap within
    ``tolerance`` of 1 / rate. With a handful of requests a Poisson sample can be a burst or
    a trickle (seed 0's first six arrivals fall within 0.4 / rate); a sweep should vary the
    load, not the luck of one sample."""
    _positive_int("n", n)
    if n < 2:
        return start
    for seed in range(start, start + 10_000):
        t = arrival_offsets(1.0, n, seed)
        if abs(t[-1] / (n - 1) - 1.0) <= tolerance:
            return seed
    raise ValueError(f"no seed in [{start}, {start + 10_000}) has a mean gap within {tolerance} of 1 / rate")


def meets_slo(ttft: float | None, tpot: float | None, slo_ttft: float, slo_tpot: float) -> bool:
    """A request meets the SLO when its TTFT and its TPOT are within the targets (a
    one-token answer has no TPOT: only its TTFT counts)."""
    return ttft is not None and ttft <= slo_ttft and (tpot is None or tpot <= slo_tpot)


def summarize_requests(requests: Sequence[Any], rate: float, start: float, slo_ttft: float = 1.0,
                       slo_tpot: float = 0.2) -> dict[str, Any]:
    """The sweep's numbers of one run, from the requests' own timestamps (``RequestMetrics``).

    The goodput is ``loadgen.goodput``'s on one record per request (one that did not finish
    counts as failed), so a plugged ``goodput`` (chapter 7) counts it."""
    ms = [r.metrics for r in requests]
    finished = [m.finish_time is not None and m.first_token_time is not None for m in ms]
    done = [m for m, ok in zip(ms, finished) if ok]
    end = max((m.finish_time for m in done), default=start)
    wall = end - start
    tokens = sum(len(r.output_token_ids) for r in requests)
    ttft = percentiles([m.ttft for m in done])
    records = [{"ok": ok, "ttft": m.ttft if ok else None, "tpot": m.tpot if ok else None}
               for m, ok in zip(ms, finished)]
    good = loadgen.goodput(records, slo_ttft, slo_tpot, wall) if wall > 0 else 0.0
    return dict(rate=rate, throughput_tok_s=tokens / wall if wall > 0 else 0.0,
                ttft_p50=ttft["p50"], ttft_p95=ttft["p95"], ttft_p99=ttft["p99"],
                tpot_p50=percentiles([m.tpot for m in done], (50,))["p50"],
                itl_p95=percentiles([x for m in done for x in m.itls], (95,))["p95"],
                e2e_p50=percentiles([m.e2e for m in done], (50,))["p50"],
                goodput=good, num_ok=len(done), num_failed=len(ms) - len(done))


def run_open_loop(engine: Any, prompts: Sequence[Sequence[int]], rate: float, num_requests: int,
                  output_tokens: int, seed: int = 0, slo_ttft: float = 1.0, slo_tpot: float = 0.2,
                  on_request: Callable[[Any], None] | None = None,
                  controller: Callable[[int, float | None], int] | None = None,
                  control_every: float = 1.0, *, slo_itl: float | None = None, min_budget: int | None = None,
                  max_budget: int | None = None) -> tuple[dict[str, Any], list]:
    """Poisson arrivals at ``rate`` into ``engine``, stepped in this thread until all finish.

    Prompt i is ``prompts[i % len(prompts)]``; each request generates exactly
    ``output_tokens`` (greedy, EOS ignored: the same work at every rate).
    ``on_request`` sees each request when it is made (a dashboard's ``source.track``).
    ``controller(budget, itl_p95) -> budget``, if given, is called every ``control_every``
    seconds with the scheduler's token budget and the p95 ITL of the last interval; what it
    returns becomes the budget. ``slo_itl`` (seconds) instead runs the SLO controller,
    ``slo_token_budget`` with that target, between ``min_budget`` (default: the scheduler's
    ``max_num_seqs``, one step's decodes) and ``max_budget`` (default: the budget at the
    start); a plugged ``next_token_budget`` (chapter 7) makes its decisions. The budgets set
    are in ``summary["budgets"]`` as (seconds, budget) pairs, and every decision in
    ``summary["controls"]`` as (seconds, budget, p95 ITL, next budget): the inputs and the
    output of each call, so the rule can be checked on them after the run.
    Returns (summary, requests).
    """
    rate = check_rate(rate)
    _positive_int("num_requests", num_requests)
    _positive_int("output_tokens", output_tokens)
    if not prompts:
        raise ValueError("prompts must hold at least one prompt")
    sched = engine.scheduler
    settings = None
    if slo_itl is not None:
        if controller is not None:
            raise ValueError("give controller= (your own rule) or slo_itl= (the SLO controller), not both")
        settings = dict(target=slo_itl, min_budget=sched.max_num_seqs if min_budget is None else min_budget,
                        max_budget=sched.max_num_batched_tokens if max_budget is None else max_budget)
        _check_budget_settings(**settings)

        def controller(budget: int, itl_p95: float | None) -> int:
            return slo_token_budget(budget, itl_p95, settings["target"], min_budget=settings["min_budget"],
                                    max_budget=settings["max_budget"])
    elif min_budget is not None or max_budget is not None:
        raise ValueError("min_budget and max_budget bound the SLO controller: give slo_itl= with them")
    if isinstance(control_every, bool) or not isinstance(control_every, (int, float)) or not control_every >= 0:
        raise ValueError(f"control_every must be a number of seconds >= 0, got {control_every!r}")
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    offsets = arrival_offsets(rate, num_requests, seed)
    start = time.perf_counter()
    pending = []
    for i, off in enumerate(offsets):
        r = engine.make_request(list(prompts[i % len(prompts)]), params, arrival_time=start + off,
                                request_id=f"r{i}")
        pending.append(r)
        if on_request is not None:
            on_request(r)
    requests = list(pending)
    pending.reverse()  # pop() takes the next arrival
    budgets, controls, last_control = [(0.0, sched.max_num_batched_tokens)], [], start
    while pending or engine.has_unfinished():
        now = time.perf_counter()
        while pending and pending[-1].arrival_time <= now:
            sched.add(pending.pop())  # the request arrives: it joins the queue
        if controller is not None and now - last_control >= control_every:
            budget, itl_p95 = sched.max_num_batched_tokens, recent_itl_p95(requests, last_control)
            new_budget = controller(budget, itl_p95)
            if isinstance(new_budget, bool) or not isinstance(new_budget, numbers.Integral) or new_budget < 1:
                raise ValueError(f"the controller returned {new_budget!r} for budget {budget} and p95 ITL "
                                 f"{itl_p95!r}: return the next token budget, an integer >= 1")
            new_budget = int(new_budget)
            controls.append((now - start, budget, itl_p95, new_budget))
            if new_budget != sched.max_num_batched_tokens:
                sched.max_num_batched_tokens = new_budget
                budgets.append((now - start, new_budget))
            last_control = now
        if engine.has_unfinished():
            engine.step()
        elif pending:  # idle until the next arrival
            time.sleep(max(0.0, min(pending[-1].arrival_time - time.perf_counter(), 0.05)))
    summary = summarize_requests(requests, rate, start, slo_ttft, slo_tpot)
    if controller is not None:
        summary["budgets"], summary["controls"] = budgets, controls
    if settings is not None:
        summary["controller"] = settings
    return summary, requests


# -- an SLO-driven controller ------------------------------------------------------------------
# The rule lives with the engine's controller (minillm/slo.py: the same AIMD rule, which
# ``EngineConfig.slo`` runs inside the engine); its name here stays for chapter 7.
_check_budget_settings = check_budget_settings
_checked_budget = checked_budget


def recent_itl_p95(requests: Sequence[Any], since: float) -> float | None:
    """p95 of the inter-token gaps that ended after ``since`` (perf_counter seconds)."""
    gaps = [b - a for r in requests for a, b in zip(r.metrics.token_times, r.metrics.token_times[1:]) if b > since]
    return percentiles(gaps, (95,))["p95"]


def _extra(engine: Any, requests: Sequence[Any], steps_before: int) -> dict[str, Any]:
    steps = engine.step_records[steps_before:]
    out = dict(preemptions=sum(r.metrics.num_preemptions for r in requests), steps=len(steps),
               mean_batch=sum(s.num_rows for s in steps) / len(steps) if steps else 0.0)
    if engine.spec_stats is not None:
        st = engine.spec_stats
        out.update(acceptance_rate=st.acceptance_rate, spec_steps=st.spec_steps,
                   tokens_per_target_forward=st.tokens_per_target_forward)
    return out


# -- sweeps ---------------------------------------------------------------------------------------

def measure_capacity(engine: Any, prompts: Sequence[Sequence[int]], output_tokens: int) -> float:
    """Requests per second of ``engine`` on one full batch (``max_num_seqs`` requests at once,
    offline): the most an open-loop run can be served at, on this machine, now."""
    _positive_int("output_tokens", output_tokens)
    n = engine.scheduler.max_num_seqs
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    reqs = [engine.make_request(list(prompts[i % len(prompts)]), params) for i in range(n)]
    t0 = time.perf_counter()
    engine.run(reqs)
    return n / (time.perf_counter() - t0)


def sweep_engines(lab: Any, configs: Sequence[str] | dict[str, dict] = ("paged",), rates: Sequence[float] = (1.0,), *,
                  num_requests: int = 8, output_tokens: int = 16, prompts: Sequence[Sequence[int]] | None = None,
                  seed: int = 0, max_num_seqs: int = 8, max_model_len: int = 512, slo_ttft: float = 1.0,
                  slo_tpot: float = 0.2, dashboard: Any = None, progress: bool = True,
                  **common: Any) -> list[RatePoint]:
    """Every config at every rate, in this process. ``lab``: a ``minillm.course.notebook.Lab``
    (weights loaded once). ``prompts`` default: the grounded chat prompts of chapter 5
    (answers that copy from the prompt, where prompt lookup can pay).

    ``dashboard``: a ``Dashboard`` on an ``EngineSource`` whose engine is swapped for each
    config (its samples continue; a mark names each run).
    """
    rates = check_rates(rates)
    configs = _check_configs(configs)
    _positive_int("num_requests", num_requests)
    _positive_int("output_tokens", output_tokens)
    if prompts is None:
        from minillm.bench.prompts import chat_prompts

        prompts = chat_prompts(lab.tokenizer, "grounded", num_requests)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(configs) * len(rates), desc="config x rate")
    points = []
    try:
        for name, options in configs.items():
            opts = dict(common, max_num_seqs=max_num_seqs, max_model_len=max_model_len, **options)
            engine = lab.engine(**opts)
            warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            engine.run([engine.make_request(list(prompts[0]), warm, request_id="warmup")])  # first-call costs
            track = None
            if dashboard is not None:
                dashboard.source.engine = engine
                track = lambda r: dashboard.source.track([r])  # noqa: E731
            for rate in rates:
                if engine.speculator is not None:
                    engine.speculator.reset_stats()
                if dashboard is not None:
                    dashboard.mark(f"{name} {rate:g}/s")
                before = len(engine.step_records)
                summary, reqs = run_open_loop(engine, prompts, rate, num_requests, output_tokens, seed,
                                              slo_ttft, slo_tpot, on_request=track)
                points.append(RatePoint(name, rate, summary, _extra(engine, reqs, before)))
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return points


def sweep_server(url: str, rates: Sequence[float], *, config: str = "server", **load_options: Any) -> list[RatePoint]:
    """The same sweep through an OpenAI-compatible server, with ``minillm.bench.loadgen``
    (``load_options``: num_requests, output_tokens, prompts, seed, slo_ttft, slo_tpot, ...)."""
    from minillm.bench import loadgen

    rates = check_rates(rates)
    points = []
    for rate in rates:
        res = loadgen.run_load(url, rate=rate, **load_options)
        points.append(RatePoint(config, rate, dict(res.summary(), rate=rate)))
    return points


# -- reading a sweep -------------------------------------------------------------------------------

def points_of(points: Sequence[RatePoint], config: str) -> list[RatePoint]:
    """One config's points, by rate."""
    out = sorted((p for p in points if p.config == config), key=lambda p: p.rate)
    if not out:
        raise ValueError(f"no points for config {config!r}; configs in this sweep: "
                         f"{', '.join(sorted({p.config for p in points}))}")
    return out


def saturation_knee(points: Sequence[RatePoint], metric: str = "ttft_p50", factor: float = 2.0) -> float | None:
    """The lowest rate whose ``metric`` exceeds ``factor`` x its value at the lowest rate
    (None: latency never took off in this sweep)."""
    if not factor > 1:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    pts = sorted(points, key=lambda p: p.rate)
    if not pts:
        raise ValueError("no points")
    base = pts[0].summary[metric]
    if base is None:
        return None
    return next((p.rate for p in pts[1:] if p.summary[metric] is not None and p.summary[metric] > factor * base),
                None)


def spec_crossover(base: Sequence[RatePoint], spec: Sequence[RatePoint], metric: str = "tpot_p50",
                   higher_is_better: bool = False) -> dict[str, Any]:
    """Where speculation stops paying: per rate, spec's ``metric`` relative to the baseline's
    (``ratio`` < 1 is better for a latency), and ``stops_paying_at``, the lowest rate from which
    on speculation is no better (None: it pays at every rate measured; the lowest rate: never)."""
    b = {p.rate: p.summary[metric] for p in base}
    s = {p.rate: p.summary[metric] for p in spec}
    rates = sorted(set(b) & set(s))
    if not rates:
        raise ValueError("the two sweeps share no rate")
    ratio = {r: (s[r] / b[r] if b[r] else None) for r in rates}
    better = {r: ratio[r] is not None and (ratio[r] > 1 if higher_is_better else ratio[r] < 1) for r in rates}
    stops = None
    for i, r in enumerate(rates):
        if not any(better[x] for x in rates[i:]):
            stops = r
            break
    return dict(metric=metric, ratio=ratio, pays=better, stops_paying_at=stops)


def format_points(points: Sequence[RatePoint]) -> str:
    """A plain-text table: one row per (config, rate)."""
    cols = [("config", None, "{}"), ("rate", "rate", "{:g}"), ("tok/s", "throughput_tok_s", "{:.1f}"),
            ("TTFT p50", "ttft_p50", "{:.2f}"), ("TTFT p95", "ttft_p95", "{:.2f}"), ("TPOT p50", "tpot_p50", "{:.3f}"),
            ("ITL p95", "itl_p95", "{:.3f}"), ("E2E p50", "e2e_p50", "{:.2f}"), ("goodput", "goodput", "{:.2f}"),
            ("batch", "mean_batch", "{:.1f}"), ("accept", "acceptance_rate", "{:.2f}")]
    rows = [[c[0] for c in cols]]
    for p in points:
        row = []
        for title, key, fmt in cols:
            v = p.config if key is None else (p.summary.get(key, p.extra.get(key)))
            row.append("-" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_latency_vs_load(points: Sequence[RatePoint], metrics: Sequence[str] = ("ttft_p50", "tpot_p50", "e2e_p50"),
                         knees: dict[str, float | None] | None = None, title: str | None = None):
    """One panel per latency metric against the offered rate, one line per config; and the
    served throughput against the offered rate (the diagonal is "keeps up")."""
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(p.config for p in points))
    fig, axes = plt.subplots(1, len(metrics) + 1, figsize=(4 * (len(metrics) + 1), 3.4))
    for c in configs:
        pts = points_of(points, c)
        x = [p.rate for p in pts]
        for ax, m in zip(axes, metrics):
            ax.plot(x, [p.summary[m] for p in pts], "o-", ms=3, label=c)
        axes[-1].plot(x, [p.summary["throughput_tok_s"] for p in pts], "o-", ms=3, label=c)
    for ax, m in zip(axes, metrics):
        ax.set_title(m.replace("_", " "), fontsize=9)
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("seconds")
        for c, k in (knees or {}).items():
            if k is not None:
                ax.axvline(k, color="gray", lw=0.6, ls=":")
    axes[0].legend(fontsize=7)
    axes[-1].set_title("served output tokens/s", fontsize=9)
    axes[-1].set_xlabel("offered rate (req/s)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# -- command line ---------------------------------------------------------------------------------

def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.bench.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="all", help=f"'all' or a comma list of: {', '.join(CONFIGS)}")
    ap.add_argument("--rates", default="0.25,0.5,1,2,3", help="comma list of requests per second")
    ap.add_argument("--capacity-fractions", help="instead of --rates: fractions of the capacity measured first "
                    "(a full batch on the paged engine, offline), e.g. 0.25,0.5,0.75,1,1.5")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=None,
                    help="arrival seed (default: the first whose mean gap is within 10%% of 1 / rate)")
    ap.add_argument("--slo-ttft", type=float, default=1.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--json", help="write the points (and knees, crossovers) here")
    ap.add_argument("--plot", help="write the latency-vs-load figure here (png)")
    args = ap.parse_args(argv)
    try:
        spec = args.capacity_fractions or args.rates
        rates = check_rates([float(x) for x in spec.split(",") if x.strip()])
        configs = _check_configs(args.configs)
        _positive_int("--output-tokens", args.output_tokens)
        _positive_int("--num-requests", args.num_requests)
    except ValueError as e:
        ap.error(str(e))
    from minillm.course.notebook import Lab
    from minillm.bench.prompts import chat_prompts

    t0 = time.perf_counter()
    if args.seed is None:
        args.seed = representative_seed(args.num_requests)
    lab = Lab()
    capacity = None
    if args.capacity_fractions:
        eng = lab.engine("paged", max_num_seqs=args.max_num_seqs, max_model_len=512)
        prompts = chat_prompts(lab.tokenizer, "grounded", args.num_requests)
        measure_capacity(eng, prompts[:1], 2)  # warm-up
        capacity = measure_capacity(eng, prompts, args.output_tokens)
        rates = [round(f * capacity, 3) for f in rates]
        print(f"capacity {capacity:.2f} req/s (paged, batch {args.max_num_seqs}); rates {rates}")
    points = sweep_engines(lab, configs, rates, num_requests=args.num_requests, output_tokens=args.output_tokens,
                           max_num_seqs=args.max_num_seqs, seed=args.seed, slo_ttft=args.slo_ttft,
                           slo_tpot=args.slo_tpot)
    print(format_points(points))
    knees = {c: saturation_knee(points_of(points, c)) for c in configs}
    print("saturation knee (TTFT p50 > 2x its low-load value), req/s:", knees)
    cross = {}
    if "paged" in configs:
        for c in configs:
            if "ngram" in c:
                cross[c] = {m: spec_crossover(points_of(points, "paged"), points_of(points, c), m)
                            for m in ("tpot_p50", "e2e_p50")}
                print(f"{c} vs paged, stops paying at (req/s):",
                      {m: v["stops_paying_at"] for m, v in cross[c].items()})
    print(f"sweep took {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(points=[asdict(p) for p in points], knees=knees, crossover=cross, capacity=capacity,
                           wall_s=time.perf_counter() - t0, args=vars(args)), f, indent=1, default=str)
    if args.plot:
        plot_latency_vs_load(points, knees=knees).savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CONFIGS", "RatePoint", "arrival_offsets", "meets_slo", "summarize_requests", "run_open_loop",
           "sweep_engines", "sweep_server", "points_of", "saturation_knee", "spec_crossover", "format_points",
           "plot_latency_vs_load", "check_rate", "check_rates", "SUMMARY_KEYS", "measure_capacity", "representative_seed", "slo_token_budget", "recent_itl_p95"]
