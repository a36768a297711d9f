"""Does the A/B tell the truth? Two identical servers, then a clearly worse one.

    python -m minillm.bench.ab_measure              # ~6 minutes on 2 cores, the real model
    python -m minillm.bench.ab_measure --quick      # 3 + 1 traces, ~2 minutes
    python -m minillm.bench.ab_measure --same-server --skip worse   # (a) with one server named twice
    python -m minillm.bench.ab_measure --json ab_measure.json

Two servers, each in a process of its own (``serve_in_background`` in a spawned process,
SmolLM2-135M in fp32 on the CPU, the same as two ``python -m minillm serve``);
``loadgen.run_ab`` replays one trace against both, one after the other in alternating
order (``--rounds`` 3: A B B A A B), and ``ab.compare`` gives the verdicts with its
two-level bootstrap (replays, then requests).

(a) *Identical configurations* (the server's default paged engine, twice): ``--replays``
    (10) seeded traces, each of ``--num-requests`` (12) short instructions at Poisson
    ``--rate`` (3/s, below this machine's saturation: a saturated queue turns a 2% speed
    difference into seconds of TTFT), 16 tokens each. Target: every metric says "no
    difference" in at least 9 of 10 traces.
(b) *A clearly worse configuration*: long prompts arriving while short requests decode
    (the ``long-prompt-arrival`` workload, chapter 4). A: chunked prefill with a 64-token
    step budget; B: the same scheduler with a 2048-token budget, so a long prompt is
    prefilled in one step and every decode waits for it: chunked prefill in effect off.
    Target: B "worse" on TPOT p50, TPOT p95 and ITL p95 in every trace (B's ITL p50 and
    its long requests' TTFT may well be better: that is the trade chunked prefill makes).

Each trace is written as a JSON-lines file and replayed through ``--trace``'s reader, as
``python -m minillm load --trace T --url A --url B --rounds 3`` would. The log line of
each A/B lists every replay's ITL p50 in the order they ran: how much one server moves
from one replay to the next on this machine, next to the difference between the two.

What it measured on 2 cores (a full run, 6 minutes): (a) "no difference" on every metric in
9 of 10 traces (the tenth: ITL p95 "better"), each server's ITL p50 within 1-2% of the
other's replay after replay; (b) B worse on all three decode metrics in 3 of 3 traces.
With both servers in one process, (a) had failed: 9/10 in one full run and 2/10 and 7/10
on ITL p50 in two others, A (built first) 2-12% slower in ITL p50 in every replay of
several traces in a row. Two engines built alike and driven directly, alternating in one
process, ran within 1% of each other: the difference came with sharing the interpreter
(which of the two servers' threads is to blame was not measured), not from the engines. ITL p50, whose interval is the narrowest (hundreds of gaps), is the first to
see such a difference, or the drift of a shared machine (one server's ITL p50 moves 20-50%
within a minute when other jobs start).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from minillm.bench import ab
from minillm.bench.loadgen import ab_order, make_requests, poisson_arrivals, run_ab

BASE = dict(engine="paged", device="cpu", dtype="float32", max_model_len=2048, max_num_seqs=8)
# (b): room for every request of its trace (16 sequences), so a long prompt is admitted when it
# arrives rather than when a short request happens to finish; only the step budget differs.
CHUNKED = dict(BASE, max_num_seqs=16, enable_chunked_prefill=True, max_num_batched_tokens=64)
UNCHUNKED = dict(BASE, max_num_seqs=16, enable_chunked_prefill=True, max_num_batched_tokens=2048)
# (b)'s trace: 8 short requests from t=0 (16 tokens each), two ~1024-token prompts arriving at
# 0.6 s and 0.9 s, when every short request has its first tokens and is still decoding. On
# B each short request then waits for whole prefills: 1 or 2 of its 15 gaps are stalls (two
# prefills back to back may reach the client as one gap), 7-13% of all gaps: past ITL p95.
LONG_PROMPT = dict(num_requests=10, short_output=16, num_long=2, long_prompt=1024, long_output=2,
                   first_arrival_s=0.6, arrival_gap_s=0.3)
DECODE_METRICS = ("TPOT p50", "TPOT p95", "ITL p95")  # where a prefill that stalls decodes shows


def write_trace(path: Path, prompts: list, outputs: list[int], arrivals: list[float]) -> Path:
    path.write_text("".join(json.dumps({"arrival": round(a, 6), "prompt": p, "output_tokens": o}) + "\n"
                            for p, o, a in zip(prompts, outputs, arrivals)))
    return path


def poisson_trace(path: Path, seed: int, num_requests: int, rate: float, output_tokens: int) -> Path:
    """The load generator's default requests (short instructions), Poisson arrivals: seeded."""
    reqs = make_requests(num_requests, output_tokens, seed=seed)
    return write_trace(path, [r.prompt for r in reqs], [r.output_tokens for r in reqs],
                       poisson_arrivals(rate, num_requests, seed))


def long_prompt_trace(path: Path, seed: int) -> Path:
    """The ``long-prompt-arrival`` workload (token-id prompts, its own scripted arrivals)."""
    from minillm.bench.workload import make_workload
    from minillm.loader import load_tokenizer

    params = dict(LONG_PROMPT)
    wl = make_workload("long-prompt-arrival", params.pop("num_requests"), seed=seed, tokenizer=load_tokenizer(),
                       **params)
    return write_trace(path, [r.prompt_token_ids for r in wl.requests], [r.max_tokens for r in wl.requests],
                       [r.arrival_time for r in wl.requests])


def _serve(config: dict[str, Any], conn: Any) -> None:
    """A server process's body: build the engine, serve, send the URL, wait for the word to stop."""
    from minillm.serving.server import serve_in_background

    handle = serve_in_background(log_level="error", **config)
    conn.send(handle.url)
    conn.recv()
    handle.stop()


class _ServerProcess:
    """A server in a process of its own (its own interpreter, GIL and torch threads)."""

    def __init__(self, config: dict[str, Any], ctx: Any):
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(config, child), daemon=True)
        self.proc.start()
        if not self._conn.poll(600):
            self.stop()
            raise RuntimeError(f"a server for {config} did not start within 600 s")
        self.url = self._conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _servers(config_a: dict[str, Any], config_b: dict[str, Any] | None) -> list[_ServerProcess]:
    """Two servers, each in a process of its own; ``config_b`` None: one server, named twice.

    Two servers in one process share its interpreter: the idle one's threads (HTTP, engine
    loop, encoder) then run beside the busy one's, and two engines built alike measured
    2-12% apart, the first built slower, replay after replay. In processes of their own the
    only thing they share is the machine."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    a = _ServerProcess(config_a, ctx)
    try:
        return [a, _ServerProcess(config_b, ctx) if config_b else a]
    except BaseException:
        a.stop()
        raise


def run_experiment(name: str, config_a: dict[str, Any], config_b: dict[str, Any] | None, traces: list[Path],
                   rounds: int, n_boot: int, log: Any) -> list[dict[str, Any]]:
    """One A/B per trace between two servers built from ``config_a`` and ``config_b`` (None:
    one server against itself)."""
    a, b = _servers(config_a, config_b)
    out = []
    try:
        for i, trace in enumerate(traces):
            t0 = time.perf_counter()
            runs_a, runs_b = run_ab(a.url, b.url, trace=trace, rounds=rounds, seed=i)
            rows = ab.compare(runs_a, runs_b, n_boot=n_boot, seed=i)
            failed = sum(r.summary()["num_failed"] for r in runs_a + runs_b)
            verdicts = {r.metric: r.verdict for r in rows}
            # Each replay's own ITL p50 (ms), in the order they ran: how much one server moves between replays.
            queues = {"A": iter(runs_a), "B": iter(runs_b)}
            order = ab_order(rounds)
            replays = [(side, next(queues[side]).summary()) for side in order]
            log(f"[{name} {i + 1}/{len(traces)}] {time.perf_counter() - t0:.0f} s, {failed} failed; ITL p50 per replay "
                + " ".join(f"{side}:{s['itl_p50'] * 1000:.1f}" for side, s in replays) + "; "
                + ", ".join(f"{m}: {v}" for m, v in verdicts.items() if v != "n/a"))
            out.append(dict(trace=trace.name, rows=rows, failed=failed, requests=len(runs_a[0].records),
                            table=ab.format_ab_table(rows),
                            replays=[dict(side=side, **{k: v for k, v in s.items() if k != "label"})
                                     for side, s in replays]))
    finally:
        for server in {id(a): a, id(b): b}.values():
            server.stop()
    return out


def tally(results: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per metric, how many replays gave each verdict."""
    counts: dict[str, dict[str, int]] = {}
    for res in results:
        for r in res["rows"]:
            if r.verdict != "n/a":
                c = counts.setdefault(r.metric, {v: 0 for v in ab.VERDICTS})
                c[r.verdict] += 1
    return counts


def format_tally(counts: dict[str, dict[str, int]], n: int) -> str:
    lines = [f"{'metric':<16}{'no difference':>15}{'better':>8}{'worse':>7}   (of {n} replays)"]
    for metric, c in counts.items():
        lines.append(f"{metric:<16}{c['no difference']:>15}{c['better']:>8}{c['worse']:>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.ab_measure", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 identical-config replays and 1 worse-config replay")
    p.add_argument("--replays", type=int, default=None, help="(a) seeded replays of identical configs (default 10)")
    p.add_argument("--worse-replays", type=int, default=None, help="(b) seeded replays of the worse config "
                                                                   "(default 3)")
    p.add_argument("--rounds", type=int, default=3, help="replays per side in one A/B: A B, B A, A B, ... (default 3)")
    p.add_argument("--num-requests", type=int, default=12, help="(a) requests per trace (default 12)")
    p.add_argument("--rate", type=float, default=3.0, help="(a) Poisson arrivals, requests/s (default 3)")
    p.add_argument("--output-tokens", type=int, default=16, help="(a) tokens per request (default 16)")
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples per metric (default 2000)")
    p.add_argument("--skip", choices=["identical", "worse"], default=None, help="leave one experiment out")
    p.add_argument("--same-server", action="store_true",
                   help="(a) with one server named twice instead of two identical ones: what is left is the "
                        "measurement's own noise, without any difference between two engine instances")
    p.add_argument("--json", default=None, help="write every A/B's rows and the tallies here")
    args = p.parse_args(argv)
    replays = args.replays or (3 if args.quick else 10)
    worse_replays = args.worse_replays or (1 if args.quick else 3)
    for name in ("rounds", "num_requests", "n_boot"):
        if getattr(args, name) < 1 or replays < 1 or worse_replays < 1:
            raise ValueError(f"--{name.replace('_', '-')}, --replays and --worse-replays must be >= 1")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    start = time.perf_counter()
    report: dict[str, Any] = dict(rounds=args.rounds, n_boot=args.n_boot, order="".join(
        "AB" if r % 2 == 0 else "BA" for r in range(args.rounds)))
    met = {}
    with tempfile.TemporaryDirectory(prefix="ab_measure_") as tmp:
        if args.skip != "identical":
            traces = [poisson_trace(Path(tmp) / f"poisson_{s}.jsonl", s, args.num_requests, args.rate,
                                    args.output_tokens) for s in range(replays)]
            res = run_experiment("identical", BASE, None if args.same_server else BASE, traces, args.rounds,
                                 args.n_boot, log)
            counts = tally(res)
            fewest = min(c["no difference"] for c in counts.values())
            clean = sum(all(r.verdict in ("no difference", "n/a") for r in x["rows"]) for x in res)
            what = "one server against itself" if args.same_server else "identical configurations"
            print(f"(a) {what} {BASE}: {replays} seeded traces of {args.num_requests} requests "
                  f"at {args.rate:g}/s, {args.output_tokens} tokens each, rounds {report['order']}")
            print(res[0]["table"].replace("\n", "\n    ").join(["    ", "\n"]))
            print(format_tally(counts, replays))
            need = -(-9 * replays // 10)
            print(f"fewest 'no difference' on one metric: {fewest}/{replays} (target >= {need}); "
                  f"replays with every metric 'no difference': {clean}/{replays}\n")
            met["identical_no_difference"] = fewest >= need
            report["identical"] = dict(config=BASE, same_server=args.same_server, counts=counts,
                                       every_metric_clean=clean, replays=res)
        if args.skip != "worse":
            traces = [long_prompt_trace(Path(tmp) / f"long_{s}.jsonl", s) for s in range(worse_replays)]
            res = run_experiment("worse", CHUNKED, UNCHUNKED, traces, args.rounds, args.n_boot, log)
            counts = tally(res)
            print(f"(b) A {CHUNKED}\n    B {UNCHUNKED}\n    {worse_replays} seeded long-prompt-arrival traces "
                  f"({LONG_PROMPT}), rounds {report['order']}")
            print(res[0]["table"].replace("\n", "\n    ").join(["    ", "\n"]))
            print(format_tally(counts, worse_replays))
            worse = {m: counts[m]["worse"] for m in DECODE_METRICS}
            print(f"'worse' on the decode metrics: " + ", ".join(f"{m} {k}/{worse_replays}" for m, k in worse.items()))
            met["worse_detected"] = all(k == worse_replays for k in worse.values())
            report["worse"] = dict(config_a=CHUNKED, config_b=UNCHUNKED, trace=LONG_PROMPT, counts=counts,
                                   replays=res)
    elapsed = time.perf_counter() - start
    print(f"\ntargets: {met}; {elapsed / 60:.1f} minutes")
    if args.json:
        for part in ("identical", "worse"):
            for x in report.get(part, {}).get("replays", []):
                x["rows"] = [ab.ab_to_json([r])["rows"][0] for r in x["rows"]]
        report.update(targets=met, elapsed_s=elapsed)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0 if all(met.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
