"""What the engine costs around the forward: one decode step with a forward that costs nothing.

    python -m minillm.bench.step_overhead                    # batch 1, 8 and 64, greedy and sampled
    python -m minillm.bench.step_overhead --batch 8 --steps 400

On a GPU a decode step of a small model is a replayed CUDA graph of about a millisecond, so
the Python around it (schedule, the step's input tensors, sampling, the update that appends
the tokens and checks the stops, the step record) decides whether the GPU waits on the host.
This runs the real paged engine (scheduler, block manager, ``ModelRunner.execute`` building
the step's batch and attention metadata, the sampler over the real vocabulary, the update)
with the model's forward and LM head replaced by preallocated zeros, on the CPU, and reports
microseconds per step and where they go. Rows sample from zero logits: greedy rows take the
argmax, sampled rows (temperature 0.8, top-p 0.95, seeded) draw from a uniform distribution,
which costs what any distribution costs. Requests ignore EOS, so a run is pure decode steps
after the first (the prefill step is not counted).

Two tables. The host's overhead: a vocabulary of 512, so the sampler's arithmetic over the
logits (a kernel on a GPU) is next to nothing and what is left is Python and dispatch; the
targets are for this one, per step on a 2-core CPU: at most 0.5 ms at batch 8 and 2 ms at
batch 64. Then the same steps with SmolLM2's vocabulary of 49,152 on this CPU, where reading
and sorting the logits is most of a sampled step. Each configuration runs ``--rounds`` times,
alternated, and the median is reported; the machine's other load moves all of them alike.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from minillm.config import EngineConfig, ModelConfig
from minillm.engine import LLMEngine, build_engine
from minillm.sampling_params import SamplingParams

PHASES = ("schedule", "inputs + forward", "sample", "update")
TARGET_US = {8: 500.0, 64: 2000.0}  # the host's overhead per step, on a 2-core CPU
HOST_VOCAB = 512


def free_forward_engine(batch: int, context: int, steps: int, vocab_size: int | None = None) -> LLMEngine:
    """A paged engine at SmolLM2's shapes (dummy weights) whose forward and head return zeros;
    ``vocab_size``: another vocabulary (a small one leaves the sampler's arithmetic out)."""
    mcfg = ModelConfig() if vocab_size is None else dataclasses.replace(ModelConfig(), vocab_size=vocab_size)
    cfg = EngineConfig(engine="paged", device="cpu", dtype="float32", attention_backend="torch",
                       max_num_seqs=batch, max_model_len=context + steps + 8, block_size=16,
                       num_blocks=batch * (-(-(context + steps + 8) // 16)),  # never a preemption
                       max_num_batched_tokens=max(2048, batch * context), pack_weights=False)
    eng = build_engine(cfg, tokenizer=None, model_config=mcfg)
    hidden = torch.zeros(batch * context, mcfg.hidden_size)
    logits = torch.zeros(batch, mcfg.vocab_size)
    eng.runner.forward = lambda input_ids, positions, meta, kv: hidden[:input_ids.shape[0]]
    eng.runner.model.compute_logits = lambda rows: logits[:rows.shape[0]]
    return eng


def _timed(fn: Callable, bucket: list[float]) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append(time.perf_counter() - t0)

    return call


def measure(batch: int, sampled: bool, context: int = 64, steps: int = 200,
            vocab_size: int | None = None) -> dict[str, Any]:
    """Microseconds per decode step (whole step and per phase) of ``batch`` requests decoding
    ``steps`` tokens each after a ``context``-token prompt."""
    eng = free_forward_engine(batch, context, steps, vocab_size)
    times: dict[str, list[float]] = defaultdict(list)
    eng.scheduler.schedule = _timed(eng.scheduler.schedule, times["schedule"])
    eng.runner.execute = _timed(eng.runner.execute, times["inputs + forward"])
    eng.sample = _timed(eng.sample, times["sample"])
    eng.scheduler.update = _timed(eng.scheduler.update, times["update"])
    params = (SamplingParams(temperature=0.8, top_p=0.95, max_tokens=steps + 1, ignore_eos=True, seed=1) if sampled
              else SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    for i in range(batch):
        eng.add_request([5 + (i + k) % 100 for k in range(context)], params)
    eng.step()  # the prefill step: not a decode step
    for bucket in times.values():
        bucket.clear()
    t0 = time.perf_counter()
    n = 0
    while eng.has_unfinished():
        eng.step()
        n += 1
    wall = time.perf_counter() - t0
    if any(s.num_new_tokens != [1] * batch for s in eng.step_records[1:]):
        raise RuntimeError("the decode steps did not run the whole batch: the measurement would be of other steps")
    return {"batch": batch, "sampled": sampled, "steps": n, "step_us": 1e6 * wall / n,
            **{f"{p}_us": 1e6 * sum(times[p]) / n for p in PHASES}}


def run(batches: list[int], rounds: int, steps: int, context: int, vocab_size: int | None = None) -> list[dict[str, Any]]:
    """Every (batch, greedy/sampled) configuration ``rounds`` times, alternated; medians."""
    configs = [(b, s) for b in batches for s in (False, True)]
    runs: dict[tuple[int, bool], list[dict[str, Any]]] = defaultdict(list)
    for k in range(rounds):
        for b, s in (configs if k % 2 == 0 else configs[::-1]):
            runs[(b, s)].append(measure(b, s, context, steps, vocab_size))
    out = []
    for (b, s), rs in runs.items():
        row = {"batch": b, "sampled": s, "rounds": len(rs)}
        for key in ["step_us"] + [f"{p}_us" for p in PHASES]:
            row[key] = statistics.median(r[key] for r in rs)
        out.append(row)
    return out


def format_table(rows: list[dict[str, Any]], targets: bool = True) -> str:
    head = f"{'batch':>5} {'rows':8} {'step µs':>8} " + " ".join(f"{p:>17}" for p in PHASES) + ("  target" if targets else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        target = TARGET_US.get(r["batch"]) if targets else None
        verdict = "" if target is None else f"<= {target:.0f} µs: {'met' if r['step_us'] <= target else 'NOT met'}"
        lines.append(f"{r['batch']:5d} {'sampled' if r['sampled'] else 'greedy':8} {r['step_us']:8.0f} "
                     + " ".join(f"{r[f'{p}_us']:17.0f}" for p in PHASES) + f"  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=200, help="decode steps per run")
    ap.add_argument("--context", type=int, default=64, help="prompt tokens of each request")
    ap.add_argument("--rounds", type=int, default=3, help="alternated runs of each configuration (median)")
    ap.add_argument("--host-only", action="store_true", help="only the host-overhead table (vocabulary 512)")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch) or args.steps < 1 or args.context < 1 or args.rounds < 1:
        ap.error("--batch, --steps, --context and --rounds take integers >= 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    for vocab, title in ((HOST_VOCAB, f"the host's overhead (vocabulary {HOST_VOCAB}: the sampler's arithmetic "
                                      "left out, as on a GPU where it is a kernel)"),
                         (None, f"on this CPU, SmolLM2's vocabulary ({ModelConfig().vocab_size:,})")):
        if vocab is None and args.host_only:
            break
        rows = run(args.batch, args.rounds, args.steps, args.context, vocab)
        print(f"{title}: µs per decode step, forward = zeros, {torch.get_num_threads()} torch threads, "
              f"{args.rounds} alternated rounds, medians")
        print(format_table(rows, targets=vocab == HOST_VOCAB))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
