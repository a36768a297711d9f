"""A load step, with and without the SLO controller: does it bring the p95s back on target?

    python -m minillm.bench.slo_step                      # the "itl" scenario, ~2.5 minutes on 2 cores
    python -m minillm.bench.slo_step --scenario ttft --json slo_ttft.json   # ~5 minutes

One engine in this process (the real model, paged, chunked prefill, no prefix caching),
open-loop Poisson arrivals of long prompts (300-600 tokens) at ``--rate`` requests/s that
double at ``--step-at`` seconds. The rate is by default a fraction (``--load``) of the
capacity measured first (``itl``: a full batch at a budget of 1024, offline; ``ttft``:
below), not a number of requests a second: a shared 2-core
machine's speed changes with what else runs on it, and a fixed rate would be an overload
one day and idle the next. The same arrivals and prompts run twice: once with a fixed token
budget, once with ``EngineConfig.slo`` (``minillm/slo.py``) moving it from the same start.
Printed: p95 TTFT (by arrival) and p95 ITL (by token time) per ``--bucket`` seconds for
both runs against the targets, the controller's budget at the end of each bucket; for each
target, when after the step the controlled run's windowed p95 (the controller's own
definition: the last ``window_s`` seconds, waiting requests counted at their age) was back
under it for good, and how much of the time after the step each run spent over it;
throughput of both; the controller's events.

Two scenarios, the two sides of the budget's trade (chapter 4: TTFT against ITL):

* ``itl`` (default): the budget starts large (1024), the ITL target is 0.5 s and the TTFT's
  6 s; load 0.35 -> 0.7 of the capacity. After the step, steps that prefill whole prompts
  stall every stream; the controller cuts the budget until the ITL is back under target.
* ``ttft``: the budget starts small (32 tokens, smooth streams), the TTFT target is 4 s and
  the ITL's a loose 2 s, with room to grow to 1024; 90 s of arrivals. The rate comes from
  two capacities measured first, with the queue never empty (``sustained_capacity``):
  the start budget's and the ceiling's; after the step it lands halfway between them. A
  fixed 32 tokens a step then cannot prefill the prompts as fast as they come (each step
  also pays for its decodes): the queue grows and TTFT with it, for as long as the step
  lasts. The controller gives prompts more tokens a step while the ITL has room.

A smaller budget does not lower TTFT here: it slows prefill (the ``ttft`` scenario's fixed
run measures it). What lowers TTFT is more prefill per step, while the ITL allows it.
The numbers are one run on a shared machine, the two runs one after the other: a change in
what else runs on it between them or during one (seen here: capacity 0.9 and 1.6 requests/s
an hour apart) can be larger than the effect. Compare with the buckets before the step.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict
from typing import Any, Sequence

from minillm.bench import loadgen
from minillm.sampling_params import SamplingParams
from minillm.slo import SloController, p95

SCENARIOS: dict[str, dict[str, Any]] = {
    "itl": dict(budget=1024, max_budget=None, slo_ttft=6.0, slo_itl=0.5, load=0.35, duration=60.0),
    "ttft": dict(budget=32, max_budget=1024, slo_ttft=4.0, slo_itl=2.0, load="between", duration=90.0),
}
CALIBRATION_BUDGET = 1024  # the capacity the load is a fraction of: a full batch at this budget


def step_arrivals(rate: float, step_at: float, duration: float, seed: int = 0) -> list[float]:
    """Poisson arrivals (seconds from 0): ``rate``/s before ``step_at``, ``2 * rate`` after, until ``duration``."""
    if not 0 < step_at < duration:
        raise ValueError(f"step_at must be inside (0, duration) = (0, {duration}), got {step_at!r}")
    before = [t for t in loadgen.poisson_arrivals(rate, 1 + math.ceil(4 * rate * step_at), seed) if t < step_at]
    after = loadgen.poisson_arrivals(2 * rate, 1 + math.ceil(8 * rate * (duration - step_at)), seed + 1)
    return before + [step_at + t for t in after if step_at + t < duration]


def long_prompts(tokenizer, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` tokens, cut at random places from the chapter-5 passages."""
    from minillm.bench.prompts import GROUNDED

    stream = tokenizer(" ".join(GROUNDED) * (1 + 4 * hi // 1000)).input_ids
    rng = random.Random(f"slo_step:{seed}")
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(stream) - length)
        out.append(list(stream[start:start + length]))
    return out


def run(engine: Any, prompts: Sequence[list[int]], offsets: Sequence[float], output_tokens: int) -> dict[str, Any]:
    """Arrivals at ``offsets`` (seconds after the start) into ``engine``, stepped until all finish.
    Returns the requests, the start (engine clock) and the budget after every step."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.run([engine.make_request(list(prompts[0][:64]), warm, request_id="warmup")])  # first-call costs
    if engine.slo_controller is not None:  # a fresh controller: the warm-up is not the run's traffic
        engine.slo_controller = SloController(engine.config.slo, engine.scheduler, engine.config.engine,
                                              engine.max_model_len)
    sched = engine.scheduler
    start = engine.clock.now()
    requests = [engine.make_request(list(prompts[i % len(prompts)]), params, arrival_time=start + off,
                                    request_id=f"r{i}") for i, off in enumerate(offsets)]
    pending = list(reversed(requests))
    budgets = [(0.0, sched.max_num_batched_tokens)]
    while pending or engine.has_unfinished():
        now = engine.clock.now()
        while pending and pending[-1].arrival_time <= now:
            sched.add(pending.pop())
        if engine.has_unfinished():
            engine.step()
            if sched.max_num_batched_tokens != budgets[-1][1]:
                budgets.append((engine.clock.now() - start, sched.max_num_batched_tokens))
        else:
            time.sleep(max(0.0, min(pending[-1].arrival_time - engine.clock.now(), 0.05)))
    return dict(requests=requests, start=start, budgets=budgets)


def bucket_table(result: dict[str, Any], bucket: float, end: float) -> list[dict[str, Any]]:
    """p95 TTFT of the requests that arrived in each bucket, p95 ITL of the gaps that ended in it,
    and the budget at its end."""
    reqs, start, budgets = result["requests"], result["start"], result["budgets"]
    rows = []
    for k in range(math.ceil(end / bucket)):
        a, b = k * bucket, (k + 1) * bucket
        ttft = [r.metrics.ttft for r in reqs if a <= r.arrival_time - start < b]
        itl = [t1 - t0 for r in reqs for t0, t1 in zip(r.metrics.token_times, r.metrics.token_times[1:])
               if a <= t1 - start < b]
        budget = [v for t, v in budgets if t <= b][-1]
        rows.append(dict(t=a, arrivals=len(ttft), ttft_p95=p95(ttft), itl_p95=p95(itl), budget=budget))
    return rows


def windowed_p95(result: dict[str, Any], metric: str, t: float, window: float) -> float | None:
    """The controller's view at ``t`` seconds: p95 over the last ``window`` s (TTFT: first tokens in
    it, and the arrived requests still without one at their age; ITL: gaps that ended in it)."""
    start = result["start"]
    now, since = start + t, start + t - window
    vals = []
    for r in result["requests"]:
        m = r.metrics
        if metric == "ttft":
            if m.first_token_time is not None and since <= m.first_token_time <= now:
                vals.append(m.ttft)
            elif r.arrival_time <= now and (m.first_token_time is None or m.first_token_time > now):
                vals.append(now - r.arrival_time)
        else:
            times = m.token_times
            vals += [t1 - t0 for t0, t1 in zip(times, times[1:]) if since <= t1 <= now]
    return p95(vals)


def recovery(result: dict[str, Any], metric: str, target: float, step_at: float, end: float, window: float,
             every: float = 1.0) -> dict[str, Any]:
    """After the step: the share of time the windowed p95 was over ``target``, and from when on
    (seconds after the step) it stayed under it (None: it never did, or was over at the end)."""
    ts = [step_at + i * every for i in range(int((end - step_at) / every) + 1)]
    over = [(t, (v := windowed_p95(result, metric, t, window)) is not None and v > target) for t in ts]
    back = None
    for t, o in reversed(over):
        if o:
            break
        back = t
    ever_over = any(o for _, o in over)
    return dict(over_share=sum(o for _, o in over) / len(over), ever_over=ever_over,
                back_under_at=None if back is None or not ever_over else back - step_at)


def throughput(result: dict[str, Any]) -> float:
    reqs = result["requests"]
    end = max(r.metrics.finish_time for r in reqs)
    return sum(len(r.output_token_ids) for r in reqs) / (end - result["start"])


def load_result(result: dict[str, Any], label: str, slo_ttft: float, slo_tpot: float) -> loadgen.LoadResult:
    """One run of ``run`` as the load generator's ``LoadResult`` (per-request records), so
    ``minillm.bench.ab.compare`` can set two runs of the same arrivals side by side."""
    start, records = result["start"], []
    for r in result["requests"]:
        m = r.metrics
        times = m.token_times
        records.append(dict(ok=m.finish_time is not None, status=200, arrival=r.arrival_time - start, lag=0.0,
                            ttft=m.ttft, tpot=m.tpot, e2e=m.e2e, itls=[b - a for a, b in zip(times, times[1:])],
                            output_tokens=len(r.output_token_ids), prompt_tokens=r.num_prompt_tokens))
    end = max(r.metrics.finish_time for r in result["requests"])
    first = min(r.arrival_time for r in result["requests"])
    return loadgen.LoadResult(url=f"in-process engine ({label})", rate=None, records=records, duration=end - first,
                              slo_ttft=slo_ttft, slo_tpot=slo_tpot, label=label)


def sustained_capacity(engine: Any, prompts: Sequence[list[int]], output_tokens: int, batches: int = 4) -> float:
    """Requests/s that ``engine`` finishes with its queue never empty: ``batches`` x ``max_num_seqs``
    requests queued at once, the finishes counted between the ``max_num_seqs``-th and the
    ``max_num_seqs``-th from the end, when a full batch runs at both ends (the ramp-up and the
    tail, where fewer run, left out; a full batch in flight at both ends, so the work done
    in between is about that many requests')."""
    n = engine.scheduler.max_num_seqs
    if batches < 3:
        raise ValueError(f"batches must be >= 3 (a full batch before, during and after the count), got {batches}")
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    reqs = [engine.make_request(list(prompts[i % len(prompts)]), params) for i in range(batches * n)]
    engine.run(reqs)
    done = sorted(r.metrics.finish_time for r in reqs)
    first, last = n - 1, len(done) - n - 1
    return (last - first) / (done[last] - done[first])


def calibrate(common: dict[str, Any], budgets: Sequence[int], weights: Any, tokenizer: Any,
              prompts: Sequence[list[int]], output_tokens: int, rounds: int = 2) -> dict[int, float]:
    """``sustained_capacity`` with each token budget, the budgets measured in alternating order
    ``rounds`` times: the mean for each."""
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    engines = {b: build_engine(EngineConfig(**dict(common, max_num_batched_tokens=b)), weights=weights,
                               tokenizer=tokenizer) for b in budgets}
    warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for eng in engines.values():
        eng.run([eng.make_request(list(prompts[0][:64]), warm)])
    got: dict[int, list[float]] = {b: [] for b in budgets}
    for r in range(rounds):
        for b in (budgets if r % 2 == 0 else list(budgets)[::-1]):
            got[b].append(sustained_capacity(engines[b], prompts[8 * r:], output_tokens))
    return {b: sum(v) / len(v) for b, v in got.items()}


def _s(v: float | None, target: float | None = None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" + ("*" if target is not None and v > target else " ")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minillm.bench.slo_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=list(SCENARIOS), default="itl", help="presets (module docstring)")
    ap.add_argument("--rate", type=float, help="requests/s before the step (doubles after it); default: the "
                    "scenario's fraction of the capacity measured first")
    ap.add_argument("--load", type=float, help="instead of --rate: the fraction of the measured capacity")
    ap.add_argument("--step-at", type=float, default=30.0, help="seconds: when the rate doubles")
    ap.add_argument("--duration", type=float, help="seconds of arrivals (default: the scenario's, 60 or 90)")
    ap.add_argument("--budget", type=int, help="max_num_batched_tokens at the start (both runs)")
    ap.add_argument("--max-budget", type=int, help="the controller's ceiling (default: the scenario's)")
    ap.add_argument("--slo-ttft", type=float, help="p95 TTFT target, seconds")
    ap.add_argument("--slo-itl", type=float, help="p95 ITL target, seconds")
    ap.add_argument("--window", type=float, default=6.0, help="the controller's window_s (decides every half)")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", default="300,600", help="lo,hi prompt lengths")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--bucket", type=float, default=5.0, help="seconds per row of the table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    sc = dict(SCENARIOS[args.scenario])
    for key in ("rate", "load", "budget", "max_budget", "slo_ttft", "slo_itl", "duration"):
        if getattr(args, key) is not None:
            sc[key] = getattr(args, key)
    args.duration = sc["duration"]
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
        step_arrivals(1.0, args.step_at, args.duration, args.seed)  # checks step_at and duration
    except ValueError as e:
        ap.error(str(e))
    from minillm import loader
    from minillm.config import EngineConfig
    from minillm.engine import build_engine

    t0 = time.perf_counter()
    weights, tokenizer = loader.load_weights(), loader.load_tokenizer()
    prompts = long_prompts(tokenizer, 32, lo, hi, args.seed)
    slo = dict(ttft_p95=sc["slo_ttft"], itl_p95=sc["slo_itl"], window_s=args.window, max_budget=sc["max_budget"])
    common = dict(engine="paged", enable_chunked_prefill=True, enable_prefix_caching=False, max_model_len=1024,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=sc["budget"])
    capacity = None
    if args.rate is None and sc["load"] == "between":
        # The step lands halfway between what the start budget and the ceiling serve: too much for a
        # fixed small budget, not for one the controller raises.
        capacity = calibrate(common, [sc["budget"], sc["max_budget"]], weights, tokenizer, prompts,
                             args.output_tokens)
        sc["rate"] = round(sum(capacity.values()) / 4, 3)
        print(f"capacity (req/s with the queue never empty, {args.max_num_seqs} at a time, mean of 2 alternated): "
              + ", ".join(f"budget {b}: {c:.2f}" for b, c in capacity.items())
              + f"; after the step {2 * sc['rate']:g} req/s, halfway between; doubling at {args.step_at:g} s",
              flush=True)
    elif args.rate is None:  # this machine's speed now (other programs share its cores): a load relative to it
        from minillm.bench.sweep import measure_capacity

        eng = build_engine(EngineConfig(**dict(common, max_num_batched_tokens=CALIBRATION_BUDGET)), weights=weights,
                           tokenizer=tokenizer)
        measure_capacity(eng, prompts[:1], 2)  # warm-up
        capacity = measure_capacity(eng, prompts, args.output_tokens)
        sc["rate"] = round(sc["load"] * capacity, 3)
        print(f"capacity {capacity:.2f} req/s (a full batch of {args.max_num_seqs}, budget {CALIBRATION_BUDGET}, "
              f"offline); load {sc['load']:g} x capacity = {sc['rate']:g} req/s, doubling at {args.step_at:g} s",
              flush=True)
    offsets = step_arrivals(sc["rate"], args.step_at, args.duration, args.seed)
    results, engines = {}, {}
    for name, extra in (("fixed", {}), ("slo", dict(slo=slo))):
        engines[name] = eng = build_engine(EngineConfig(**common, **extra), weights=weights, tokenizer=tokenizer)
        print(f"{name}: {len(offsets)} requests, {sc['rate']:g} -> {2 * sc['rate']:g} req/s at {args.step_at:g} s, "
              f"budget {sc['budget']}" + (f", slo {slo}" if extra else ""), flush=True)
        results[name] = run(eng, prompts, offsets, args.output_tokens)
    end = max(max(r.metrics.finish_time for r in res["requests"]) - res["start"] for res in results.values())
    tables = {n: bucket_table(res, args.bucket, end) for n, res in results.items()}
    tt, it = sc["slo_ttft"], sc["slo_itl"]
    print(f"\np95 per {args.bucket:g} s bucket (* over target: TTFT {tt} s, ITL {it} s); rate doubles at "
          f"{args.step_at:g} s; TTFT by arrival, ITL by token time")
    print(f"{'t':>5} {'arr':>4} | {'TTFT fixed':>10} {'TTFT slo':>9} | {'ITL fixed':>9} {'ITL slo':>8} | budget slo")
    for a, b in zip(*tables.values()):
        print(f"{a['t']:5.0f} {a['arrivals']:4d} | {_s(a['ttft_p95'], tt):>10} {_s(b['ttft_p95'], tt):>9} | "
              f"{_s(a['itl_p95'], it):>9} {_s(b['itl_p95'], it):>8} | {b['budget']}")
    arrivals_end = args.duration
    rec = {n: {m: recovery(res, m, target, args.step_at, arrivals_end, args.window)
               for m, target in (("ttft", tt), ("itl", it)) if target is not None}
           for n, res in results.items()}
    print(f"\nafter the step (windowed p95 over the last {args.window:g} s, checked every second until the "
          f"arrivals stop at {arrivals_end:g} s):")
    for m, target in (("ttft", tt), ("itl", it)):
        f, s = rec["fixed"][m], rec["slo"][m]
        back = ("never over" if not s["ever_over"] else "not back under" if s["back_under_at"] is None
                else f"back under for good {s['back_under_at']:.0f} s after the step")
        print(f"  {m.upper():4} target {target} s: fixed over {f['over_share']:.0%} of the time; "
              f"slo over {s['over_share']:.0%}, {back}")
    tput = {n: throughput(res) for n, res in results.items()}
    print(f"throughput (output tok/s): fixed {tput['fixed']:.1f}, slo {tput['slo']:.1f}")
    ctl = engines["slo"].slo_controller
    print(f"controller: {ctl.num_decisions} decisions, {ctl.num_decreases} down, {ctl.num_increases} up; events:")
    for e in ctl.events:
        print(f"  t={e.time - results['slo']['start']:6.1f} s  {e.old_budget:5d} -> {e.new_budget:5d}  {e.reason} "
              f"(p95 TTFT {_s(e.ttft_p95)} s, ITL {_s(e.itl_p95)} s)")
    wall = time.perf_counter() - t0
    print(f"took {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(args=vars(args), scenario=sc, capacity_req_s=capacity, tables=tables, recovery=rec, throughput_tok_s=tput,
                           events=[dict(asdict(e), time=e.time - results["slo"]["start"]) for e in ctl.events],
                           budgets={n: res["budgets"] for n, res in results.items()}, wall_s=wall), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["SCENARIOS", "step_arrivals", "long_prompts", "run", "bucket_table", "windowed_p95", "recovery",
           "throughput", "main"]
