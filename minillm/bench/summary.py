"""Serving metrics: what each request saw, what each step did, and the summary numbers.

Per request (``RequestMetrics`` in request.py holds the timestamps):

    arrival ---- first token ---- token ---- token ... ---- last token = finish
    TTFT  = first token - arrival               (queueing + prefill)
    ITL   = each gap between consecutive tokens  (one per decode step the request lived through)
    TPOT  = (last token - first token) / (n - 1) (one request's mean ITL)
    E2E   = finish - arrival

A *decode stall* is a step in which a request that was decoding (it had its first
token, not yet its last) produced no token: it waited, e.g. for a long prompt's prefill
step (chapter 4). ``decode_stall_steps`` counts such steps.

Per step (``StepRecord``): which requests ran and how many tokens each fed, how many
batch slots sat idle or padded, how much KV memory was reserved and how much of it held
real tokens, and the step's wall time.

Slot utilization, the one definition every engine in this project is measured with:
a step has B batch slots (``max_num_seqs``).

* A *varlen* step (minillm's forward, transformers' continuous batching) gives each
  slot exactly the tokens it feeds: a slot feeding n tokens occupies n token-slots, an
  empty slot occupies 1 (it could have decoded a token). Total = sum(n) + (B - rows).
* A *padded* step (static batching, transformers ``generate``) is a [B, W] rectangle,
  W = the longest row: every slot occupies W token-slots, Total = B * W.

Useful token-slots are the tokens a request actually needs: prompt tokens being
prefilled, and one token per request that is still generating. Rows of a static batch
whose request already finished are idle, not useful.

    slot_utilization = sum of useful token-slots / sum of total token-slots   (over all steps)

So 1.0 means every slot did needed work in every step; a batch of 8 waiting for one
long request while 7 slots idle runs at 1/8.

KV memory, the same definitions for the contiguous and the paged engines:

* *reserved* (``StepRecord.kv_reserved_bytes``): after the step, the KV memory held by
  the requests holding KV space: a ``max_model_len`` region per running request in the
  contiguous engines, the request's blocks in the paged one. Not the whole cache: free
  slots or blocks are not waste, they can still be handed out.
* *used* (``kv_used_bytes``): the part of it holding cached tokens.

    kv_waste_fraction = time average over steps of (reserved - used) / reserved

each step weighted by its duration (steps that reserve nothing are left out).

    max_concurrency = max over steps of the requests running after the step

(each of them holds its KV). For the same KV bytes, the paged engine's is higher: it
reserves what requests use, not what they might.

Prefix caching (chapter 6). Each admission needs K/V for every token the request has
(its prompt; prompt + outputs when it recomputes after a preemption): those are the
*prefill tokens requested*. The prefix cache already holds some of them (*hits*, whole
blocks); the rest are computed.

    prefix_hit_rate          = hit tokens / prefill tokens requested
    prefill_tokens_computed  = prefill tokens requested - hit tokens

``cached_blocks_over_time`` gives, per step, the blocks holding a cached prefix and how
many of them are free (evictable).

Per priority class (``class_metrics``): TTFT and queue wait (arrival -> first
scheduled) percentiles, *timeouts hit* (requests that waited longer than their class's
queue timeout) and *SLO attainment*: the share of the class's requests that met their
SLO, by default a queue wait within the class's queue timeout; give ``ttft_slo_s``
(class -> seconds) to judge TTFT instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from minillm.config import DEFAULT_QUEUE_TIMEOUTS, PRIORITY_CLASSES, queue_timeout
from minillm.metrics import StepRecord
from minillm.request import RequestMetrics

PERCENTILES = (50, 95, 99)


def percentiles(values: Iterable[float], ps: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """{"p50": ..., "p95": ..., "p99": ...} with linear interpolation; None when empty."""
    xs = sorted(v for v in values if v is not None)
    out: dict[str, float | None] = {}
    for p in ps:
        if not xs:
            out[f"p{p}"] = None
            continue
        k = (len(xs) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    return out


def slot_utilization(steps: Iterable[StepRecord]) -> float:
    useful = total = 0
    for s in steps:
        useful += s.num_tokens
        total += s.token_slots
    return useful / total if total else 0.0


def kv_waste_fraction(steps: Iterable[StepRecord]) -> float | None:
    """Reserved-but-unused share of the KV memory requests hold, averaged over time.

    Per step ``(kv_reserved_bytes - kv_used_bytes) / kv_reserved_bytes``; the run's value
    weights each step by its duration. Steps that reserve nothing are left out; records
    without durations count once each. None when no step reserved anything (e.g.
    transformers' continuous batching, whose reservations are not recorded).
    """
    fractions: list[tuple[float, float]] = []  # (weight, waste) per step
    for s in steps:
        if s.kv_reserved_bytes > 0:
            fractions.append((s.duration, (s.kv_reserved_bytes - s.kv_used_bytes) / s.kv_reserved_bytes))
    if not fractions:
        return None
    total = sum(w for w, _ in fractions)
    if total <= 0:
        return sum(f for _, f in fractions) / len(fractions)
    return sum(w * f for w, f in fractions) / total


def max_concurrency(steps: Iterable[StepRecord]) -> int:
    """The most requests running at once: the peak over steps of ``num_running`` (the
    requests in the running set after the step, each holding its KV space)."""
    return max((s.num_running for s in steps), default=0)


def prefix_cache_stats(steps: Iterable[StepRecord]) -> dict[str, Any]:
    """Prefill tokens requested, hit in the prefix cache and computed; hit rate; peak cached blocks."""
    steps = list(steps)
    requested = sum(s.prefill_tokens_requested for s in steps)
    hits = sum(s.prefix_hit_tokens for s in steps)
    return dict(prefill_tokens_requested=requested, prefix_hit_tokens=hits,
                prefill_tokens_computed=requested - hits,
                prefix_hit_rate=hits / requested if requested else None,
                cached_blocks_peak=max((s.num_cached_blocks for s in steps), default=0))


def cached_blocks_over_time(steps: Sequence[StepRecord], start: float | None = None
                            ) -> tuple[list[float], list[int], list[int]]:
    """(time since ``start`` of each step's end, cached blocks, of which evictable) per step."""
    t0 = steps[0].start if start is None and steps else (start or 0.0)
    return ([s.end - t0 for s in steps], [s.num_cached_blocks for s in steps],
            [s.num_evictable_blocks for s in steps])


def _class_order(name: str) -> tuple:
    return (PRIORITY_CLASSES.get(name, int(name) if name.lstrip("-").isdigit() else 99), name)


def class_metrics(metrics: Sequence[RequestMetrics], queue_timeouts: dict[str, float] | None = None,
                  ttft_slo_s: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """Per priority class: count, TTFT and queue-wait percentiles, timeouts hit, SLO attainment.

    ``queue_timeouts``: class -> seconds (default: the engine defaults, 50 / 200 / 1000 ms).
    SLO attainment is the share of the class's requests whose queue wait stayed within
    the class's timeout, or, with ``ttft_slo_s``, whose TTFT stayed within that.
    """
    timeouts = {**DEFAULT_QUEUE_TIMEOUTS, **(queue_timeouts or {})}
    groups: dict[str, list[RequestMetrics]] = {}
    for m in metrics:
        groups.setdefault(m.priority_class, []).append(m)
    out: dict[str, dict[str, Any]] = {}
    for name in sorted(groups, key=_class_order):
        ms = groups[name]
        level = PRIORITY_CLASSES.get(name, int(name) if name.lstrip("-").isdigit() else 1)
        limit = queue_timeout(timeouts, level)
        waits = [m.queue_wait for m in ms if m.queue_wait is not None]
        hit = sum(1 for w in waits if w > limit)
        if ttft_slo_s is not None and name in ttft_slo_s:
            attained = sum(1 for m in ms if m.ttft is not None and m.ttft <= ttft_slo_s[name]) / len(ms)
        else:  # None when the run recorded no queue waits (e.g. the transformers baselines)
            attained = sum(1 for w in waits if w <= limit) / len(ms) if waits else None
        out[name] = dict(num_requests=len(ms), ttft_s=percentiles(ttfts(ms)), queue_wait_s=percentiles(waits),
                         e2e_s=percentiles(e2es(ms)), queue_timeout_s=limit, timeouts_hit=hit,
                         slo_attainment=attained,
                         output_tokens=sum(len(m.token_times) for m in ms))
    return out


@dataclass
class RunResult:
    """One engine run on one workload: everything the summary and the charts need."""

    engine: str
    metrics: list[RequestMetrics]  # per request, in workload order
    output_token_ids: list[list[int]]
    steps: list[StepRecord]
    start: float  # when the first request could arrive (perf_counter)
    end: float  # when the last request finished
    num_slots: int
    kv_cache_bytes: int  # KV memory the engine allocated
    num_prompt_tokens: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def output_tokens(self) -> int:
        return sum(len(t) for t in self.output_token_ids)

    @property
    def throughput(self) -> float:
        """Output tokens per second of wall time."""
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def ttfts(metrics: Iterable[RequestMetrics]) -> list[float]:
    return [m.ttft for m in metrics if m.ttft is not None]


def tpots(metrics: Iterable[RequestMetrics]) -> list[float]:
    return [m.tpot for m in metrics if m.tpot is not None]


def e2es(metrics: Iterable[RequestMetrics]) -> list[float]:
    return [m.e2e for m in metrics if m.e2e is not None]


def itls(metrics: Iterable[RequestMetrics]) -> list[float]:
    return [x for m in metrics for x in m.itls]


def decode_stall_steps(steps: Iterable[Any], metrics: Iterable[RequestMetrics]) -> int:
    """Steps in which a running, decoding request produced no token.

    A token produced by a step is stamped with the step's ``end``. Request r is decoding
    during step s when its first token came from an earlier step and its last token from
    s or a later one: ``first < s.end <= last``. A step counts once, however many
    requests it stalled. (A preempted request counts as stalled until it is back.)
    """
    spans = [(m.token_times[0], m.token_times[-1], set(m.token_times)) for m in metrics if m.token_times]
    return sum(1 for s in steps
               if any(first < s.end <= last and s.end not in produced for first, last, produced in spans))


def summarize(result: RunResult, **context: Any) -> dict[str, Any]:
    """The benchmark's JSON object for one run (``context``: workload name, seed, ...)."""
    steps = result.steps
    reserved_peak = max((s.kv_reserved_bytes for s in steps), default=0)
    out: dict[str, Any] = {"engine": result.engine, **context}
    out.update(
        num_requests=len(result.metrics),
        prompt_tokens=sum(result.num_prompt_tokens),
        output_tokens=result.output_tokens,
        wall_s=result.wall_s,
        output_tokens_per_s=result.throughput,
        forward_passes=len(steps),
        slot_utilization=slot_utilization(steps) if steps else None,
        mean_running=(sum(s.num_rows for s in steps) / len(steps)) if steps else None,
        ttft_s=percentiles(ttfts(result.metrics)),
        tpot_s=percentiles(tpots(result.metrics)),
        itl_s={**percentiles(itls(result.metrics)), "max": max(itls(result.metrics), default=None)},
        e2e_s=percentiles(e2es(result.metrics)),
        kv_reserved_bytes=result.kv_cache_bytes,
        kv_reserved_bytes_peak=reserved_peak,
        kv_used_bytes_peak=max((s.kv_used_bytes for s in steps), default=0),
        # KV memory (see the module docstring): waste of what requests hold, how many ran at once
        kv_waste_fraction=kv_waste_fraction(steps),
        max_concurrency=max_concurrency(steps),
        preemptions=sum(m.num_preemptions for m in result.metrics),
        # Chunked prefill (chapter 4): the largest step, and steps that left a decode waiting
        max_step_tokens=max((s.num_tokens for s in steps), default=0),
        decode_stall_steps=decode_stall_steps(steps, result.metrics),
        # Chapter 6: the prefix cache, and latency per priority class
        **prefix_cache_stats(steps),
        per_class=class_metrics(result.metrics, result.extra.get("queue_timeouts")),
    )
    out.update(result.extra)
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of summaries, one row per engine."""
    cols = [
        ("engine", "engine", "{}"),
        ("tok/s", "output_tokens_per_s", "{:.1f}"),
        ("wall s", "wall_s", "{:.1f}"),
        ("out tok", "output_tokens", "{}"),
        ("fwd", "forward_passes", "{}"),
        ("slot util", "slot_utilization", "{:.3f}"),
        ("TTFT p50", ("ttft_s", "p50"), "{:.2f}"),
        ("TTFT p99", ("ttft_s", "p99"), "{:.2f}"),
        ("TPOT p50", ("tpot_s", "p50"), "{:.3f}"),
        ("TPOT p99", ("tpot_s", "p99"), "{:.3f}"),
        ("ITL p99", ("itl_s", "p99"), "{:.3f}"),
        ("stalls", "decode_stall_steps", "{}"),
        ("KV res MB", "kv_reserved_bytes", "{:.0f}"),
        ("KV used MB", "kv_used_bytes_peak", "{:.0f}"),
        ("KV waste", "kv_waste_fraction", "{:.3f}"),
        ("max run", "max_concurrency", "{}"),
        ("preempt", "preemptions", "{}"),
        ("hit rate", "prefix_hit_rate", "{:.3f}"),
        ("prefill tok", "prefill_tokens_computed", "{}"),
    ]

    def cell(row, key, fmt):
        v = row.get(key[0], {}).get(key[1]) if isinstance(key, tuple) else row.get(key)
        if v is None:
            return "-"
        if isinstance(key, str) and key.startswith("kv_") and "bytes" in key:
            v = v / 2**20
        return fmt.format(v)

    table = [[c[0] for c in cols]] + [[cell(r, c[1], c[2]) for c in cols] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(cols))]
    lines = ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(line, widths)))
             for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_class_table(rows: Sequence[dict[str, Any]]) -> str:
    """Per-class latency of several runs: one line per (run, class) from ``summarize``'s per_class."""
    head = f"{'run':>14s} {'class':>12s} {'n':>4s} {'TTFT p50':>9s} {'p95':>7s} {'p99':>7s} {'wait p95':>9s} " \
           f"{'timeouts':>8s} {'SLO':>5s}"
    lines = [head, "-" * len(head)]
    for row in rows:
        label = row.get("label") or f"{row['engine']}/{row.get('scheduling_policy', 'fcfs')}"
        for name, c in row["per_class"].items():
            t, w = c["ttft_s"], c["queue_wait_s"]
            f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            lines.append(f"{label:>14s} {name:>12s} {c['num_requests']:4d} {f(t['p50']):>9s} {f(t['p95']):>7s} "
                         f"{f(t['p99']):>7s} {f(w['p95']):>9s} {c['timeouts_hit']:8d} {f(c['slo_attainment']):>5s}")
    return "\n".join(lines)


__all__ = ["RunResult", "percentiles",
           "slot_utilization", "summarize", "format_table", "ttfts", "tpots", "e2es", "itls",
           "kv_waste_fraction", "max_concurrency", "decode_stall_steps", "prefix_cache_stats",
           "cached_blocks_over_time", "class_metrics", "format_class_table"]
