"""What tensor parallelism costs and buys on this machine: one decode step, split.

``python -m minillm.bench.tp_measure --sizes 1,2 --batches 1,8,32`` builds one engine per
size (N = 1: this process on every core; N > 1: N processes on cores / N threads each),
then times a decode step of each batch size on each engine, alternating the engines round
after round (the cores are shared with whatever else runs: ratios from one run, not
absolute times, are what to compare). A step's rows attend to ``context`` cached
positions each; the cache holds whatever was there (the step's cost does not depend on
the values).

For N > 1, rank 0's time is split into what it spent inside all-reduces (including
waiting for the slower rank), broadcasting the step, and the rest (compute), with the
bytes it all-reduced next to ``sharding.allreduce_bytes_per_step``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any, Sequence

import torch

from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.scheduler.output import ScheduledRequest, SchedulerOutput


def decode_rows(batch: int, context: int, block_size: int) -> SchedulerOutput:
    """``batch`` requests decoding one token after ``context`` cached ones, in blocks 0, 1, ..."""
    blocks = -(-(context + 1) // block_size)
    rows = []
    for b in range(batch):
        r = Request(f"tp{b}", [100 + (i % 1000) for i in range(context + 1)], SamplingParams(temperature=0))
        r.num_computed_tokens = context
        r.block_ids = list(range(b * blocks, (b + 1) * blocks))
        rows.append(ScheduledRequest(r, 1))
    return SchedulerOutput(rows)


def threads_of(engine) -> int:
    return getattr(engine.runner, "threads", None) or os.cpu_count() or 1


@torch.inference_mode()
def step_split(engines: dict[int, Any], batches: Sequence[int] = (1, 8, 32), context: int = 64,
               steps: int = 5, rounds: int = 3, progress: bool = True) -> list[dict[str, Any]]:
    """Median decode-step time of every engine (key: its tensor_parallel_size) at every batch
    size, and for N > 1 rank 0's split of it; the engines alternate within each round."""
    from tqdm.auto import tqdm

    samples: dict[tuple[int, int], list[dict[str, float]]] = {}
    bar = tqdm(total=rounds * len(batches) * len(engines), desc="decode steps", disable=not progress)
    for _ in range(rounds):
        for batch in batches:
            for n, eng in engines.items():
                runner = eng.runner
                out = decode_rows(batch, context, runner.block_size)
                if -(-(context + 1) // runner.block_size) * batch > runner.kv_caches[0][0].shape[0]:
                    raise ValueError(f"the KV cache of N={n} is too small for {batch} rows of {context} tokens")
                torch.set_num_threads(threads_of(eng))
                runner.execute(out)  # warm-up: first touches of this batch's cache pages
                if hasattr(runner, "reset_counts"):
                    runner.reset_counts()
                start = time.perf_counter()
                for _ in range(steps):
                    runner.execute(out)
                wall = (time.perf_counter() - start) / steps
                c = runner.counts() if hasattr(runner, "counts") else {}
                samples.setdefault((n, batch), []).append(dict(
                    step=wall, all_reduce=c.get("all_reduce_s", 0.0) / steps,
                    broadcast=c.get("broadcast_s", 0.0) / steps,
                    bytes=c.get("all_reduce_bytes", 0) / steps, formula=c.get("formula_bytes", 0) / steps))
                bar.update()
    bar.close()
    rows = []
    for (n, batch), runs in sorted(samples.items()):
        best = sorted(runs, key=lambda r: r["step"])[len(runs) // 2]  # the median round
        rows.append(dict(tensor_parallel_size=n, threads_per_rank=threads_of(engines[n]), batch=batch,
                         step_ms=1e3 * best["step"], all_reduce_ms=1e3 * best["all_reduce"],
                         broadcast_ms=1e3 * best["broadcast"],
                         compute_ms=1e3 * (best["step"] - best["all_reduce"] - best["broadcast"]),
                         all_reduce_bytes=int(best["bytes"]), formula_bytes=int(best["formula"]),
                         step_ms_rounds=[round(1e3 * r["step"], 2) for r in runs]))
    return rows


def format_rows(rows: Sequence[dict[str, Any]]) -> str:
    head = f"{'N':>2} {'thr':>3} {'batch':>5} {'step ms':>8} {'compute':>8} {'allreduce':>9} {'bcast':>6} {'KB/step':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['tensor_parallel_size']:>2} {r['threads_per_rank']:>3} {r['batch']:>5} {r['step_ms']:>8.2f} "
                     f"{r['compute_ms']:>8.2f} {r['all_reduce_ms']:>9.2f} {r['broadcast_ms']:>6.2f} "
                     f"{r['all_reduce_bytes'] / 1024:>8.1f}")
    return "\n".join(lines)


def build_engines(sizes: Sequence[int], max_num_seqs: int, context: int, dummy_weights: bool = False) -> dict[int, Any]:
    """One paged engine per size, each with room for ``max_num_seqs`` rows of ``context`` tokens."""
    from minillm import loader
    from minillm.config import EngineConfig, ModelConfig
    from minillm.engine import build_engine

    cfg = ModelConfig() if dummy_weights else loader.read_config(None)
    weights = loader.dummy_weights(cfg) if dummy_weights else loader.load_weights(None)
    tok = None if dummy_weights else loader.load_tokenizer(None)
    cores = os.cpu_count() or 1
    engines = {}
    for n in sizes:
        engines[n] = build_engine(EngineConfig(engine="paged", tensor_parallel_size=n, max_num_seqs=max_num_seqs,
                                               max_model_len=max(256, context + 16), dummy_weights=dummy_weights,
                                               cpu_threads=max(1, cores // n)),
                                  weights=weights, tokenizer=tok, model_config=cfg if dummy_weights else None)
    return engines


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.tp_measure", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated (default 1,2)")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes (default 1,8,32)")
    p.add_argument("--context", type=int, default=64, help="cached tokens each row attends to (default 64)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--dummy-weights", action="store_true", help="seeded random weights with the real config")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    engines = build_engines(sizes, max(batches), args.context, args.dummy_weights)
    try:
        rows = step_split(engines, batches, args.context, rounds=args.rounds)
    finally:
        for eng in engines.values():
            eng.close()
    print(format_rows(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
