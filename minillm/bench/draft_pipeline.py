"""The drafter in a process of its own against the drafter in the engine's: tokens/s and latency.

    python -m minillm.bench.draft_pipeline                  # n-gram and a self-draft, batch 1 and 8
    python -m minillm.bench.draft_pipeline --draft-layers 6 --max-tokens 32 --repeats 3

One target, SmolLM2 from the installed package (``LLM(engine="paged")``), and four drafters
swapped into its speculator in turn: prompt lookup and a self-draft of the target's first
layers, each in this process and in a process of its own (``spec_decode/pipeline.py``).
Each round runs both placements of a drafter back to back, in an order that alternates
(in, own, own, in, ...), so drift in the machine's speed falls on both alike: compare the
ratios of one run, never numbers across runs. Both placements must emit the same tokens.

What to expect on a small shared CPU: the child's prefetch takes a core from the target
(the engine's thread governor then drops to one thread), every step pays a round trip, and
a prefetched proposal is used only when the target accepted every draft and the bonus token
was guessed, about alpha^(k+1) of the steps. The pipeline pays where that fraction is high
and the draft runs on cores (or a device) the target does not need.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Sequence

from minillm.threads import keeps_torch_threads

PLACES = ("in", "own")  # the drafter in the engine's process, or in its own


class _Clocked:
    """A drafter that keeps the time the engine spends in its ``propose`` (drafting in this
    process, or waiting for the draft process); everything else goes to the drafter."""

    def __init__(self, drafter):
        self.drafter, self.seconds, self.calls = drafter, 0.0, 0

    def propose(self, requests, limits):
        start = time.perf_counter()
        try:
            return self.drafter.propose(requests, limits)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def __getattr__(self, name):
        return getattr(self.drafter, name)


def _timed(engine, drafter, prompts: Sequence[Sequence[int]], params, batch: int, k: int) -> dict[str, Any]:
    """``prompts`` through ``engine`` with ``drafter``, ``batch`` at a time: tokens, wall time,
    decode-step and per-token latency, the time per step spent getting drafts, the speculation
    counters and (own process) the prefetch's."""
    clocked = engine.speculator.drafter = _Clocked(drafter)
    engine.speculator.reset_stats()
    before = dict(getattr(drafter, "stats", {}))
    steps0 = len(engine.step_records)
    wall, outs = 0.0, []
    for i in range(0, len(prompts), batch):
        reqs = [engine.make_request(list(p), params) for p in prompts[i:i + batch]]
        start = time.perf_counter()
        outs += engine.run(reqs)
        wall += time.perf_counter() - start
    engine.speculator.drafter = drafter
    decode = [r for r in engine.step_records[steps0:] if max(r.num_new_tokens) <= k + 1]  # no prefill in the step
    st = engine.spec_stats
    row = dict(tokens=sum(len(o.token_ids) for o in outs), wall_s=wall, steps=len(decode),
               step_ms=1e3 * statistics.fmean(r.end - r.start for r in decode),
               draft_ms=1e3 * clocked.seconds / max(1, clocked.calls),
               tpot_ms=1e3 * statistics.fmean(o.metrics.tpot for o in outs if o.metrics.tpot is not None),
               acceptance=st.acceptance_rate, num_drafts=st.num_drafts, token_ids=[o.token_ids for o in outs])
    after = getattr(drafter, "stats", None)
    if after is not None:  # the own-process drafter's counters, for this run only
        d = {key: after[key] - before.get(key, 0) for key in after}
        row.update(prefetched_rows=d["rows_prefetched"] / d["rows"] if d["rows"] else None,
                   prefetched_tokens=d["tokens_prefetched"] / d["tokens"] if d["tokens"] else None,
                   prefetch_forwards=d["prefetch_forwards"])
    return row


def measure(batch_sizes: Sequence[int] = (1, 8), drafters: Sequence[str] = ("ngram", "self-draft"),
            draft_layers: int = 8, num_speculative_tokens: int = 4, max_tokens: int = 48, num_prompts: int = 8,
            solo_prompts: int = 2, repeats: int = 2, workload: str = "grounded", child_threads: int = 1,
            progress: bool = True, llm: Any = None, **engine_kwargs: Any) -> list[dict[str, Any]]:
    """One row per (drafter, batch, place): tokens/s, mean step and per-token latency, acceptance,
    the share of rows and draft tokens the prefetch served (own process), the engine's wait for
    drafts per step, and ``ratio`` (own / in tokens/s) with its spread over the rounds.

    Batch 1 runs ``solo_prompts`` prompts one at a time; batch B runs ``num_prompts`` prompts
    B at a time. ``llm``: an ``LLM(engine="paged", speculative=<a self-draft>)`` to reuse (its
    draft layers, not ``draft_layers``); else one is built with ``engine_kwargs`` (e.g.
    ``cpu_threads=2``: a fixed team instead of the governor)."""
    from ..config import SpeculativeConfig
    from ..engine import LLM
    from ..sampling_params import SamplingParams
    from ..spec_decode.drafters import build_drafter
    from ..spec_decode.pipeline import DraftProcess
    from .prompts import chat_prompts

    layers = list(range(draft_layers))
    if llm is None:
        llm = LLM(engine="paged", max_num_seqs=max(batch_sizes), max_model_len=1024,
                  speculative=dict(method="model", draft_layers=layers, num_speculative_tokens=num_speculative_tokens,
                                   disable_by_batch_size=None),  # speculate at batch 8 too
                  **engine_kwargs)
    engine = llm.engine
    original = None if engine.speculator is None else engine.speculator.drafter
    if not hasattr(original, "runner"):
        raise ValueError("measure needs an LLM whose speculative drafter is a self-draft "
                         "(speculative={'method': 'model', 'draft_layers': [...]}), in this process")
    rc, place = engine.resolved, engine.resolved.placement
    inner = {"self-draft": original,
             "ngram": build_drafter(SpeculativeConfig(method="ngram"), engine.model, rc.num_blocks, rc.block_size,
                                    place.device, place.dtype)}
    variants = {(name, "in"): inner[name] for name in drafters}
    variants.update({(name, "own"): DraftProcess(inner[name], num_speculative_tokens, threads=child_threads)
                     for name in drafters})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = chat_prompts(llm.tokenizer, workload, max(num_prompts, solo_prompts))
    runs = {key: [] for key in ((n, b, p) for n in drafters for b in batch_sizes for p in PLACES)}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(runs) * repeats + len(variants), desc="draft pipeline runs")
    try:
        for key, drafter in variants.items():  # warm-up: first forwards, the child's included
            _timed(engine, drafter, prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), 1,
                   num_speculative_tokens)
            if bar:
                bar.update()
        for rep in range(repeats):
            for name in drafters:
                for b in batch_sizes:
                    order = PLACES if (rep + b) % 2 == 0 else PLACES[::-1]
                    for place_ in order:
                        ps = prompts[:solo_prompts] if b == 1 else prompts[:num_prompts]
                        runs[name, b, place_].append(_timed(engine, variants[name, place_], ps, params, b,
                                                            num_speculative_tokens))
                        if bar:
                            bar.update()
    finally:
        if bar:
            bar.close()
        for (name, place_), d in variants.items():
            if place_ == "own":
                d.close()
        engine.speculator.drafter = original

    def rate(rs):
        return sum(r["tokens"] for r in rs) / sum(r["wall_s"] for r in rs)

    rows = []
    for (name, b, place_), rs in runs.items():
        ins = runs[name, b, "in"]
        row = dict(drafter=name, batch=b, place=place_, tokens_per_s=rate(rs),
                   step_ms=statistics.fmean(r["step_ms"] for r in rs),
                   tpot_ms=statistics.fmean(r["tpot_ms"] for r in rs),
                   acceptance=_mean(r["acceptance"] for r in rs), steps=sum(r["steps"] for r in rs),
                   same_tokens=all(r["token_ids"] == i["token_ids"] for r, i in zip(rs, ins)))
        for k in ("draft_ms", "prefetched_rows", "prefetched_tokens"):
            row[k] = _mean(r.get(k) for r in rs)
        if place_ == "own":  # own / in tokens/s: over all rounds, and each round's own
            ratios = [rate([o]) / rate([i]) for o, i in zip(rs, ins)]
            row.update(ratio=rate(rs) / rate(ins), ratio_min=min(ratios), ratio_max=max(ratios))
        rows.append(row)
    return rows


def _mean(values) -> float | None:
    vs = [v for v in values if v is not None]
    return statistics.fmean(vs) if vs else None


NOISE = 0.02  # a ratio within 2% of 1 (or rounds that disagree) is no verdict


def verdict(rows: list[dict[str, Any]], num_speculative_tokens: int = 4) -> str:
    """Where the own process pays, where it loses, and why, from the numbers of ``measure``."""
    own = [r for r in rows if r["place"] == "own"]
    if not own:
        return "no own-process runs to judge"
    ins = {(r["drafter"], r["batch"]): r for r in rows if r["place"] == "in"}

    def where(rs):
        return "at " + ", ".join(f"{r['drafter']} batch {r['batch']} (x{r['ratio']:.2f})" for r in rs) if rs else "nowhere"

    pays = [r for r in own if r["ratio_min"] > 1 + NOISE]
    loses = [r for r in own if r["ratio_max"] < 1 - NOISE]
    even = [r for r in own if r not in pays and r not in loses]
    parts = [f"Own process vs in-process tokens/s: pays {where(pays)}; loses {where(loses)}; "
             f"no difference beyond the noise (+-{NOISE:.0%} and the rounds' spread) {where(even)}."]
    k = num_speculative_tokens
    for name in dict.fromkeys(r["drafter"] for r in own):
        # the batch with the most drafting to hide
        o = max((r for r in own if r["drafter"] == name), key=lambda r: ins[name, r["batch"]]["draft_ms"])
        i = ins[name, o["batch"]]
        alpha = i["acceptance"] or 0.0
        parts.append(
            f"{name}, batch {o['batch']}: drafting took {i['draft_ms']:.1f} ms of a {i['step_ms']:.0f} ms step "
            f"in-process; the engine waited {o['draft_ms']:.1f} ms for the child, which had "
            f"{100 * (o['prefetched_rows'] or 0):.0f}% of the rows prefetched (a hit needs all {k} drafts accepted "
            f"and the bonus guessed: alpha^{k + 1} = {alpha:.2f}^{k + 1} = {100 * alpha ** (k + 1):.0f}%), and the "
            f"target's part of a step went {i['step_ms'] - i['draft_ms']:.0f} -> {o['step_ms'] - o['draft_ms']:.0f} ms "
            f"with the child on the same {_cores()} cores.")
    return " ".join(parts)


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def format_table(rows: list[dict[str, Any]]) -> str:
    """step / draft ms: a decode step, and the engine's time getting its drafts (drafting in this
    process, or waiting for the child); prefetched: rows (and draft tokens) the child had ready."""
    def f(v, spec, scale=1.0, unit=""):
        return "-" if v is None else format(scale * v, spec) + unit

    head = (f"{'drafter':<11}{'batch':>5}  {'where':<6}{'tok/s':>7}{'step ms':>9}{'draft ms':>10}{'TPOT ms':>9}"
            f"{'accept':>8}{'prefetched':>12}{'pf tokens':>11}{'own/in':>8}{'rounds':>12}  same")
    lines = [head, "-" * len(head)]
    for r in rows:
        rounds = f"{r['ratio_min']:.2f}..{r['ratio_max']:.2f}" if "ratio" in r else "-"
        lines.append(f"{r['drafter']:<11}{r['batch']:>5}  {r['place']:<6}{r['tokens_per_s']:>7.1f}{r['step_ms']:>9.1f}"
                     f"{r['draft_ms']:>10.1f}{r['tpot_ms']:>9.1f}{f(r['acceptance'], '.2f'):>8}"
                     f"{f(r['prefetched_rows'], '.0f', 100, '%'):>12}{f(r['prefetched_tokens'], '.0f', 100, '%'):>11}"
                     f"{f(r.get('ratio'), '.2f'):>8}{rounds:>12}  {'yes' if r['same_tokens'] else 'NO'}")
    return "\n".join(lines)


@keeps_torch_threads()
def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.draft_pipeline",
                                description="Drafter in the engine's process vs in its own: tokens/s and latency "
                                            "on the real model, both placements alternated in one run.")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--drafters", nargs="+", choices=["ngram", "self-draft"], default=["ngram", "self-draft"])
    p.add_argument("--draft-layers", type=int, default=8, help="the self-draft: the target's first N layers")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per prompt")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per run at batch > 1")
    p.add_argument("--solo-prompts", type=int, default=2, help="prompts per run at batch 1 (one at a time)")
    p.add_argument("--repeats", type=int, default=2, help="rounds; each runs both placements of every drafter")
    p.add_argument("--workload", choices=["grounded", "open"], default="grounded")
    p.add_argument("--child-threads", type=int, default=1, help="torch threads in the draft process")
    p.add_argument("--cpu-threads", default="auto",
                   help="the engine's torch threads: 'auto' (the governor, the default) or a fixed count")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    if min(a.batch_sizes) < 1 or a.draft_layers < 1 or a.repeats < 1 or a.max_tokens < 2:
        p.error("batch sizes, --draft-layers and --repeats must be >= 1, --max-tokens >= 2")
    rows = measure(a.batch_sizes, a.drafters, a.draft_layers, a.num_speculative_tokens, a.max_tokens, a.num_prompts,
                   a.solo_prompts, a.repeats, a.workload, a.child_threads,
                   cpu_threads=a.cpu_threads if a.cpu_threads == "auto" else int(a.cpu_threads))
    print(format_table(rows))
    print(verdict(rows, a.num_speculative_tokens))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
