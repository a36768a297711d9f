"""Where a decode step's time goes, against the floor of reading the weights once.

``python -m minillm.bench.profile_step --batch 1,8,32`` puts B requests in the decode phase
(each with ``--context`` tokens of KV already cached), times ``--steps`` pure-decode steps of
the real engine, and profiles a few of them with the torch profiler. Each op's self time
goes to one bucket:

    matmul     the model's linear layers and the LM head (aten::mm / addmm / linear)
    attention  scaled_dot_product_attention and the K/V gathers of the paged cache (the
               ``cpu`` backend: its attention rows, ``minillm::cpu_attention_rows``)
    kv write   the cache writes of this step's K/V (index_copy_)
    sampling   everything the step runs after the logits (argmax, softmax, noise)
    other ops  every other op: norms, RoPE, SiLU, residual adds, copies, views (with
               ``--compile``: the loops inductor generated for them, ``cpp_fused_*``;
               the ``cpu`` backend: its layer ops ``minillm::cpu_*``, whose RoPE call
               also writes the K/V, so its "kv write" is empty)
    python     the rest of the step's wall time: scheduler, batch building, op dispatch

The floor is one pass over the weights as a batch-1 step reads them: every linear layer of
the model and the LM head applied to one row, nothing else (``weights_floor``). On a
memory-bound CPU a decode step cannot beat it; the ratio step / floor says how much of the
step is something other than reading the weights.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from minillm.threads import keeps_torch_threads

BUCKETS = ("matmul", "attention", "kv write", "sampling", "other ops", "python")
_MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_weight_int",
           "mkldnn::_linear_pointwise", "minillm::cpu_int8_linear", "minillm::cpu_u8_linear", "minillm::cpu_q4_linear")
_ATTENTION = ("scaled_dot_product", "flash_attention", "aten::index_select", "aten::_efficient_attention",
              "aten::_softmax", "aten::baddbmm", "minillm::cpu_attention_rows")


def _bucket(name: str, in_sampling: bool) -> str:
    if in_sampling:
        return "sampling"
    if any(name.startswith(m) for m in _MATMUL):
        return "matmul"
    if any(m in name for m in _ATTENTION):
        return "attention"
    if name.startswith("aten::index_copy"):
        return "kv write"
    return "other ops"


def weight_matrices(model) -> list[torch.Tensor]:
    """Every matrix a decode step multiplies by (dense): the linear layers, then the LM head."""
    from minillm.model import PackedLinear

    mats = [m.dense() if isinstance(m, PackedLinear) else m.weight for m in model.modules()
            if isinstance(m, (torch.nn.Linear, PackedLinear))]
    mats.append(model.embed.weight if model.lm_head is None else model.lm_head.weight)
    return mats


def _gemv_pass(mats: list[torch.Tensor], linears: list, repeats: int) -> float:
    """Median seconds to apply ``linears[i]`` (a function of x) to one row, over every matrix."""
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for w in mats}
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        for w, f in zip(mats, linears):
            f(xs[w.shape[1]])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


@torch.inference_mode()
def weights_floor(model, repeats: int = 7) -> dict[str, float]:
    """Seconds for one batch-1 GEMV over every weight matrix (median of ``repeats``), and the bytes read.

    On a CPU that runs oneDNN's packed linear the weights are read both ways, plain
    (``F.linear``) and packed (``model.PackedLinear``), and the floor is the faster: the
    least time this machine needs to stream the weights once, whichever layout the
    engine holds.
    """
    from minillm import model as model_mod

    mats = weight_matrices(model)
    nbytes = sum(w.numel() * w.element_size() for w in mats)
    s, how = _gemv_pass(mats, [lambda x, w=w: F.linear(x, w) for w in mats], repeats), "plain"
    if mats[0].device.type == "cpu" and model_mod.can_pack_weights(mats[0].dtype):
        packed = _gemv_pass(mats, [model_mod.PackedLinear(w) for w in mats], repeats)
        if packed < s:
            s, how = packed, "packed"
    return {"floor_s": s, "bytes": nbytes, "gb_per_s": nbytes / s / 1e9, "layout": how}


def decode_engine(llm, batch: int, context: int, max_tokens: int):
    """Add ``batch`` requests of ``context`` prompt tokens and run until every one decodes."""
    from minillm.sampling_params import SamplingParams

    eng = llm.engine
    V = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)  # greedy
    for i in range(batch):
        ids = torch.randint(100, V - 100, (context,), generator=g).tolist()
        eng.add_request(ids, params)
    # prefill every request (one or more steps), then decode from here on
    while any(r.is_prefill for r in eng.scheduler.waiting) or any(r.is_prefill for r in eng.scheduler.running):
        eng.step()
    return eng


def _step_timed(eng) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def profile_decode(llm, batch: int, context: int = 128, steps: int = 20, profiled: int = 5) -> dict[str, Any]:
    """Median step time of ``steps`` pure-decode steps at ``batch``, and its split by bucket."""
    from torch.profiler import ProfilerActivity, profile

    eng = decode_engine(llm, batch, context, max_tokens=steps + profiled + 8)
    for _ in range(2):  # warm-up
        eng.step()
    times = [_step_timed(eng) for _ in range(steps)]
    sample_fn = eng.sample

    def marked_sample(*a, **k):
        with torch.profiler.record_function("minillm::sample"):
            return sample_fn(*a, **k)

    eng.sample = marked_sample
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(profiled):
                with torch.profiler.record_function("minillm::step"):
                    eng.step()
            wall = (time.perf_counter() - t0) / profiled
    finally:
        eng.sample = sample_fn
    while eng.has_unfinished():  # finish (frees the requests' blocks)
        eng.step()
    split = {b: 0.0 for b in BUCKETS}
    events = prof.events()
    sampling = [(e.time_range.start, e.time_range.end) for e in events if e.name == "minillm::sample"]
    for e in events:
        if not e.name.startswith(("aten::", "mkldnn::", "cpp_fused", "minillm::cpu_")) or e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # only top-level aten ops: their total time includes what they call
        inside = any(a <= e.time_range.start and e.time_range.end <= b for a, b in sampling)
        split[_bucket(e.name, inside)] += e.cpu_time_total / 1e6 / profiled
    split["python"] = max(0.0, wall - sum(split.values()))
    return {"batch": batch, "context": context, "step_s": statistics.median(times),
            "profiled_step_s": wall, "split_s": split}


def format_table(rows: list[dict[str, Any]], floor: dict[str, float]) -> str:
    head = ["batch", "step ms", "x floor"] + [f"{b} ms" for b in BUCKETS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        split = r["split_s"]
        cells = [str(r["batch"]), f"{r['step_s'] * 1e3:.1f}", f"{r['step_s'] / floor['floor_s']:.2f}"]
        cells += [f"{split[b] * 1e3:.1f}" for b in BUCKETS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"floor: batch-1 GEMV over {floor['bytes'] / 1e6:.0f} MB of weights = "
                 f"{floor['floor_s'] * 1e3:.1f} ms ({floor['gb_per_s']:.1f} GB/s, {floor.get('layout', 'plain')} layout)")
    return "\n".join(lines)


@keeps_torch_threads()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.profile_step", description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,8,32", help="comma list of batch sizes (default 1,8,32)")
    p.add_argument("--engine", default="paged", help="continuous or paged (default paged)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: by device)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size (default 20)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--dummy-weights", action="store_true", help="random weights with the real config")
    p.add_argument("--plain-weights", action="store_true",
                   help="keep the linear weights dense (pack_weights=False), to compare with the packed layout")
    p.add_argument("--compile", action="store_true",
                   help="the step's forward as one compiled graph (LLM(compile=True); the first steps compile)")
    from minillm.config import ATTENTION_BACKENDS

    p.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS),
                   help="attention of the engine (default: by device; on the CPU cpu where a C++ compiler is installed)")
    p.add_argument("--json", default=None, help="write the rows and the floor as JSON here")
    args = p.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        if not batches or min(batches) < 1:
            raise ValueError
    except ValueError:
        p.error(f"--batch wants a comma list of positive integers, got {args.batch!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from minillm import LLM

    kw = dict(engine=args.engine, dtype=args.dtype, max_num_seqs=max(batches),
              max_model_len=args.context + args.steps + 64)
    if args.dummy_weights:
        kw["dummy_weights"] = True
    if args.plain_weights:
        kw["pack_weights"] = False
    if args.compile:
        kw["compile"] = True
    if args.attention_backend is not None:
        kw["attention_backend"] = args.attention_backend
    llm = LLM(**kw)
    floor = weights_floor(llm.engine.model)
    rows = []
    for b in batches:
        rows.append(profile_decode(llm, b, args.context, args.steps))
        print(f"batch {b}: {rows[-1]['step_s'] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
    floor2 = weights_floor(llm.engine.model)  # again after the runs: the machine may have changed
    floor = min(floor, floor2, key=lambda f: f["floor_s"])
    print(format_table(rows, floor))
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"engine": args.engine, "compile": args.compile,
                       "attention_backend": llm.engine.model.attention_backend, "dtype": str(llm.engine.model.embed.weight.dtype),
                       "threads": torch.get_num_threads(), "floor": floor, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
