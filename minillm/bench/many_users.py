"""Chapter 6's targets, measured side by side in one process on the real model.

    python -m minillm.bench.many_users [--json PATH] [--threads N] [--quick]

Two experiments, each one workload run twice with one setting flipped, so every figure
is a ratio within one run of this script (the machine's noise cancels, mostly):

* ``prefix_caching``: ``shared-prefix`` (32 requests, a 512-token system prompt, short
  distinct questions, all at t=0) on the paged engine with prefix caching off, then on.
  Targets: prefill tokens computed with caching <= 0.25x without; TTFT p50 >= 2x
  better; every request's tokens identical.
* ``priority``: ``mixed-priority`` (interactive chat arriving Poisson over a background
  of long batch jobs; the chat rate set from this machine's decode speed so the chat
  arrives while the batch jobs run) under FCFS, then under the priority policy (default
  queue timeouts), both with prefix caching (a preempted batch job recomputes from the
  cache) and chunked prefill (a 512-token budget) on. Targets: interactive TTFT p95 >= 3x better with priority; total throughput
  (output tokens / wall time) within 10% of FCFS; what the batch class pays is reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from minillm.bench.compare import run_minillm
from minillm.bench.summary import RunResult, summarize
from minillm.bench.workload import Workload, make_workload, workload_from_lengths
from minillm.threads import keeps_torch_threads

TARGETS = {"prefill_ratio_max": 0.25, "ttft_p50_speedup_min": 2.0, "interactive_ttft_p95_speedup_min": 3.0,
           "throughput_ratio_min": 0.9}


def _run(workload: Workload, weights, tokenizer, progress: bool, **options: Any) -> RunResult:
    options.setdefault("max_model_len", workload.default_max_model_len())
    return run_minillm("paged", workload, weights, tokenizer, progress=progress, **options)


def prefix_caching_experiment(weights, tokenizer, num_requests: int = 32, system_len: int = 512,
                              output_len: int = 16, max_num_seqs: int = 32, progress: bool = False,
                              **options: Any) -> dict[str, Any]:
    """shared-prefix with caching off, then on: the runs' summaries and the target ratios.

    ``max_num_seqs`` defaults to the number of requests: every request in one wave, so the
    TTFT compares prefill work, not how many waves of decodes a request queues behind
    (with 8 slots and 32 offline requests both runs wait ~3 waves, and the TTFT ratio
    shrinks to about 2x on a CPU)."""
    wl = make_workload("shared-prefix", num_requests, seed=0, tokenizer=tokenizer, system_len=system_len,
                       output_len=output_len)
    runs = {name: _run(wl, weights, tokenizer, progress, max_num_seqs=max_num_seqs, enable_prefix_caching=on,
                       **options)
            for name, on in (("off", False), ("on", True))}
    s = {k: summarize(r, workload=wl.name) for k, r in runs.items()}
    same = sum(a == b for a, b in zip(runs["off"].output_token_ids, runs["on"].output_token_ids))
    return dict(workload=wl.describe(), runs=runs, summaries=s,
                prefill_ratio=s["on"]["prefill_tokens_computed"] / s["off"]["prefill_tokens_computed"],
                ttft_p50_speedup=s["off"]["ttft_s"]["p50"] / s["on"]["ttft_s"]["p50"],
                hit_rate=s["on"]["prefix_hit_rate"], identical=same, num_requests=len(wl))


def priority_experiment(weights, tokenizer, num_requests: int = 24, max_num_seqs: int = 4, progress: bool = False,
                        workload_params: dict[str, Any] | None = None, max_num_batched_tokens: int = 512,
                        **options: Any) -> dict[str, Any]:
    """mixed-priority under FCFS, then the priority policy (prefix caching and chunked prefill on in both).

    The chat requests' arrival rate is set from this machine's speed, so that they arrive
    while the batch jobs run: a calibration run measures a decode step of ``max_num_seqs``
    batch jobs, and the chat requests are spread over the time the batch jobs need.
    """
    params = dict(batch_fraction=0.25, batch_prompt=384, batch_output=96, chat_prompt=48, chat_output=16)
    params.update(workload_params or {})
    num_batch = round(num_requests * params["batch_fraction"])
    if "interactive_rate" not in params:
        cal = workload_from_lengths([params["batch_prompt"]] * max_num_seqs, [12] * max_num_seqs, tokenizer)
        res = _run(cal, weights, tokenizer, False, max_num_seqs=max_num_seqs,
                   max_model_len=cal.default_max_model_len() + params["batch_output"])
        t_dec = statistics.median(s.duration for s in res.steps if max(s.num_new_tokens) == 1)
        waves = -(-num_batch // max_num_seqs)
        params["interactive_rate"] = (num_requests - num_batch) / (waves * params["batch_output"] * t_dec)
    wl = make_workload("mixed-priority", num_requests, seed=0, tokenizer=tokenizer, **params)
    options.setdefault("enable_prefix_caching", True)
    options.setdefault("enable_chunked_prefill", True)
    runs = {p: _run(wl, weights, tokenizer, progress, max_num_seqs=max_num_seqs, scheduling_policy=p,
                    max_num_batched_tokens=max_num_batched_tokens, **options)
            for p in ("fcfs", "priority")}
    s = {k: summarize(r, workload=wl.name) for k, r in runs.items()}
    inter = {k: v["per_class"]["interactive"] for k, v in s.items()}
    batch = {k: v["per_class"]["batch"] for k, v in s.items()}
    same = sum(a == b for a, b in zip(runs["fcfs"].output_token_ids, runs["priority"].output_token_ids))
    return dict(workload=wl.describe(), interactive_rate=params["interactive_rate"], runs=runs, summaries=s,
                interactive_ttft_p95_speedup=inter["fcfs"]["ttft_s"]["p95"] / inter["priority"]["ttft_s"]["p95"],
                throughput_ratio=s["priority"]["output_tokens_per_s"] / s["fcfs"]["output_tokens_per_s"],
                batch_ttft_p50_ratio=batch["priority"]["ttft_s"]["p50"] / batch["fcfs"]["ttft_s"]["p50"],
                batch_e2e_p50_ratio=batch["priority"]["e2e_s"]["p50"] / batch["fcfs"]["e2e_s"]["p50"],
                preemptions={k: v["preemptions"] for k, v in s.items()}, identical=same, num_requests=len(wl),
                settings=dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              enable_chunked_prefill=options["enable_chunked_prefill"],
                              enable_prefix_caching=options["enable_prefix_caching"]))


def report(pc: dict[str, Any] | None, pr: dict[str, Any] | None) -> tuple[str, dict[str, bool]]:
    """A text report of both experiments and which targets they met."""
    lines, met = [], {}
    if pc is not None:
        off, on = pc["summaries"]["off"], pc["summaries"]["on"]
        lines += [f"prefix caching: {pc['workload']}",
                  f"  prefill tokens computed   off {off['prefill_tokens_computed']:6d}   on {on['prefill_tokens_computed']:6d}"
                  f"   ratio {pc['prefill_ratio']:.3f}  (target <= {TARGETS['prefill_ratio_max']})",
                  f"  TTFT p50                  off {off['ttft_s']['p50']:6.2f}s  on {on['ttft_s']['p50']:6.2f}s"
                  f"  speedup {pc['ttft_p50_speedup']:.2f}x  (target >= {TARGETS['ttft_p50_speedup_min']}x)",
                  f"  hit rate {pc['hit_rate']:.3f}; throughput off {off['output_tokens_per_s']:.1f}, "
                  f"on {on['output_tokens_per_s']:.1f} tok/s; identical outputs {pc['identical']}/{pc['num_requests']}"]
        met["prefill_ratio"] = pc["prefill_ratio"] <= TARGETS["prefill_ratio_max"]
        met["ttft_p50_speedup"] = pc["ttft_p50_speedup"] >= TARGETS["ttft_p50_speedup_min"]
        met["prefix_identical"] = pc["identical"] == pc["num_requests"]
    if pr is not None:
        f, p = pr["summaries"]["fcfs"], pr["summaries"]["priority"]
        lines += [f"priority: {pr['workload']} (interactive {pr['interactive_rate']:.2f} req/s; {pr['settings']})"]
        for cls in f["per_class"]:
            a, b = f["per_class"][cls], p["per_class"][cls]
            lines.append(f"  {cls:12s} TTFT p50/p95/p99 fcfs {a['ttft_s']['p50']:.2f}/{a['ttft_s']['p95']:.2f}/"
                         f"{a['ttft_s']['p99']:.2f}s  priority {b['ttft_s']['p50']:.2f}/{b['ttft_s']['p95']:.2f}/"
                         f"{b['ttft_s']['p99']:.2f}s  timeouts {a['timeouts_hit']} -> {b['timeouts_hit']}"
                         f"  SLO {a['slo_attainment']:.2f} -> {b['slo_attainment']:.2f}")
        lines += [f"  interactive TTFT p95 speedup {pr['interactive_ttft_p95_speedup']:.2f}x  "
                  f"(target >= {TARGETS['interactive_ttft_p95_speedup_min']}x)",
                  f"  throughput fcfs {f['output_tokens_per_s']:.1f}  priority {p['output_tokens_per_s']:.1f} tok/s  "
                  f"ratio {pr['throughput_ratio']:.3f}  (target >= {TARGETS['throughput_ratio_min']})",
                  f"  the batch class pays: TTFT p50 x{pr['batch_ttft_p50_ratio']:.2f}, E2E p50 "
                  f"x{pr['batch_e2e_p50_ratio']:.2f}; preemptions {pr['preemptions']}; identical outputs "
                  f"{pr['identical']}/{pr['num_requests']}"]
        met["interactive_ttft_p95_speedup"] = (pr["interactive_ttft_p95_speedup"]
                                               >= TARGETS["interactive_ttft_p95_speedup_min"])
        met["throughput_within_10pct"] = pr["throughput_ratio"] >= TARGETS["throughput_ratio_min"]
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'MISSED'}" for k, v in met.items()))
    return "\n".join(lines), met


@keeps_torch_threads()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.many_users", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH", help="write both experiments' summaries and ratios as JSON")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--only", choices=["prefix", "priority"], default=None, help="run one experiment")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    import torch

    from minillm import loader

    if args.threads:
        torch.set_num_threads(args.threads)
    weights, tok = loader.load_weights(), loader.load_tokenizer()
    progress = not args.no_progress
    pc = prefix_caching_experiment(weights, tok, progress=progress) if args.only in (None, "prefix") else None
    if pc is not None:
        print(report(pc, None)[0], file=sys.stderr, flush=True)  # as soon as it is measured
    pr = priority_experiment(weights, tok, progress=progress) if args.only in (None, "priority") else None
    text, met = report(pc, pr)
    print(text)
    if args.json:
        def strip(x):
            return None if x is None else {k: v for k, v in x.items() if k != "runs"}
        with open(args.json, "w") as f:
            json.dump({"prefix_caching": strip(pc), "priority": strip(pr), "targets_met": met,
                       "torch_threads": torch.get_num_threads()}, f, indent=2, default=str)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
