"""minillm's 4-bit engine against llama.cpp on the same GGUF, alternated in one process.

    python -m minillm.bench.llamacpp_measure                  # the three workloads, 3 rounds (~5 minutes)
    python -m minillm.bench.llamacpp_measure --workloads skewed --rounds 5 --json out.json

Needs llama.cpp (``make peer-llamacpp``). Three workloads, each on the same prompt token ids
for every engine, greedy:

    batch1   4 requests of 64 prompt and 64 output tokens, served one at a time
             (minillm ``max_num_seqs=1``, llama.cpp at batch 1). Target: minillm >= 0.8x.
    skewed   the skewed workload's 8 requests at once (``workload.py``: 7 of ~20 tokens and
             one of ~800): minillm's paged engine batching continuously against llama.cpp's 8
             parallel slots (as its server with ``-np 8``). Target: >= 1.5x.
    uniform  8 requests of 32 prompt and 128 output tokens at once, the same two.

minillm runs its paged engine with ``quantization="q4"`` in float32 and in bfloat16 (the
activations and the KV cache; llama.cpp keeps its KV cache in float16); llama.cpp runs the
file's own Q4_1 / Q8_0 blocks. Every round runs each engine once per workload, in an order
reversed from one round to the next; a run reports output tokens per second of wall time.
The cores may be shared with other processes: each run also reports how much of a core
other processes used meanwhile (``/proc/stat``, less this process's and its children's CPU
time), so that a contended run can be told from a slow one.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from typing import Any, Callable

import torch

WORKLOADS = ("batch1", "skewed", "uniform")
TARGETS = {"batch1": 0.8, "skewed": 1.5}  # minillm 4-bit / llama.cpp, output tok/s


def _busy_jiffies() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # all but idle and iowait


def _own_cpu_s() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed_run(fn: Callable[[], Any]) -> tuple[Any, float | None]:
    """(fn's result, cores other processes used on average while it ran; None where unknown)."""
    hz = os.sysconf("SC_CLK_TCK")
    b0, c0, t0 = _busy_jiffies(), _own_cpu_s(), time.perf_counter()
    result = fn()
    b1, c1, wall = _busy_jiffies(), _own_cpu_s(), time.perf_counter() - t0
    if b0 is None or b1 is None or wall <= 0:
        return result, None
    return result, max(0.0, ((b1 - b0) / hz - (c1 - c0)) / wall)


def engines_for(workload: str, weights, tokenizer, gguf: str, threads: int, llama_python: str) -> dict[str, Callable]:
    """name -> a function of the workload that runs it once and returns its ``RunResult``."""
    from minillm.bench.compare import run_minillm
    from minillm.bench.llamacpp_runner import run_llamacpp

    seqs, n_ctx = (1, 256) if workload == "batch1" else (8, 1024)

    def minillm(dtype: str):
        return lambda wl: run_minillm("paged", wl, weights, tokenizer, max_num_seqs=seqs, max_model_len=n_ctx,
                                      quantization="q4", device="cpu", dtype=dtype)

    name = "llama.cpp batch 1" if seqs == 1 else f"llama.cpp {seqs} slots"
    return {"minillm q4 float32": minillm("float32"), "minillm q4 bfloat16": minillm("bfloat16"),
            name: lambda wl: run_llamacpp(wl, gguf_path=gguf, threads=threads, n_ctx=n_ctx, python=llama_python,
                                          parallel=seqs)}


def make(workload: str, tokenizer):
    from minillm.bench.workload import make_workload

    if workload == "batch1":
        return make_workload("uniform", 4, seed=0, tokenizer=tokenizer, prompt_len=64, output_len=64)
    if workload == "skewed":
        return make_workload("skewed", 8, seed=0, tokenizer=tokenizer)
    return make_workload("uniform", 8, seed=0, tokenizer=tokenizer, prompt_len=32, output_len=128)


def measure(workloads: list[str], rounds: int, threads: int) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from minillm import loader
    from minillm.bench.llamacpp_runner import find_llamacpp_python

    llama_python = find_llamacpp_python()
    weights, tokenizer, gguf = loader.load_weights(), loader.load_tokenizer(), str(loader.find_gguf())
    torch.set_num_threads(threads)
    results: dict[str, Any] = {}
    for w in workloads:
        wl = make(w, tokenizer)
        engines = engines_for(w, weights, tokenizer, gguf, threads, llama_python)
        runs: dict[str, list] = {name: [] for name in engines}
        order = list(engines)
        for r in tqdm(range(rounds), desc=w):
            for name in (order if r % 2 == 0 else order[::-1]):
                res, other = timed_run(lambda: engines[name](wl))
                runs[name].append({"tok_s": res.throughput, "other_cores": other,
                                   "tokens": [list(t) for t in res.output_token_ids]})
        results[w] = {"requests": len(wl), "output_tokens": sum(r.max_tokens for r in wl), "runs": runs}
    return results


def report(results: dict[str, Any]) -> str:
    lines = []
    for w, res in results.items():
        runs = res["runs"]
        peer = next(n for n in runs if n.startswith("llama.cpp"))
        lines.append(f"\n{w}: {res['requests']} requests, {res['output_tokens']} output tokens; output tok/s per round "
                     f"(other processes' cores in brackets)")
        for name, rs in runs.items():
            cells = "  ".join(f"{r['tok_s']:6.1f} [{r['other_cores']:.2f}]" if r["other_cores"] is not None
                              else f"{r['tok_s']:6.1f}" for r in rs)
            lines.append(f"  {name:22s} {cells}   median {statistics.median(r['tok_s'] for r in rs):6.1f}")
        for name in (n for n in runs if n.startswith("minillm")):
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs[name], runs[peer])]
            target = TARGETS.get(w)
            verdict = "" if target is None else (f"  target {target}x: " + ("met" if statistics.median(ratios) >= target
                                                                              else "NOT met") + " (median)")
            lines.append(f"  {name} / {peer}: " + ", ".join(f"{x:.2f}x" for x in ratios)
                         + f"; median {statistics.median(ratios):.2f}x{verdict}")
        first = {name: rs[0]["tokens"] for name, rs in runs.items()}
        same = all(rs[i]["tokens"] == rs[0]["tokens"] for rs in runs.values() for i in range(len(rs)))
        mine = [first[n] for n in first if n.startswith("minillm")]
        lines.append(f"  every engine gave the same tokens in every round: {same}; minillm float32 and bfloat16 "
                     f"give the same tokens: {mine[0] == mine[1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.llamacpp_measure", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads of every engine")
    p.add_argument("--json", default=None, help="write every run here")
    args = p.parse_args(argv)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or not workloads:
        p.error(f"--workloads: {', '.join(bad) or 'none given'}; choose from {', '.join(WORKLOADS)}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    from minillm.bench.llamacpp_runner import LlamaCppNotFound

    try:
        results = measure(workloads, args.rounds, args.threads)
    except LlamaCppNotFound as e:
        print(f"llama.cpp is not installed: {e} (make peer-llamacpp)")
        return 1
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
