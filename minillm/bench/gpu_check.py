"""``make gpu-check``: everything that only a GPU can show, in one run of a few minutes.

On a machine with CUDA (budget: 8 minutes in all):

    1. pytest -m "gpu or aot"         compiled Triton kernels, bf16 engines, CUDA graphs, AOT tier
    2. nbval on every chapter         the notebooks still run top to bottom on a GPU
    3. engine vs transformers         bf16, dummy weights at SmolLM2's real shapes (no GGUF
                                      needed): step time, tokens/s and Triton compile counts;
                                      the paged engine with int8 and q4 weights too, and
                                      multi-turn chat with the host KV tier (pinned memory)

and writes ``gpu_check.json`` (plus each part's log) under ``--out`` (default ``$OUT`` or
``out/``). A part that overruns its share of the budget is stopped and reported, so the
whole check always ends in time.

Without CUDA the same command is a dry run that proves the wiring on the CPU: it collects
the GPU tests without running them and benchmarks a tiny dummy model on both sides, says
that no GPU was found, and exits 0.

    python -m minillm.bench.gpu_check [--out DIR] [--budget-s 480] [--skip tests,notebooks,bench]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BUDGET_S = 480  # 8 minutes for the whole check
# Shares of the budget: the tests compile every kernel variant, the chapters run benchmarks.
SHARES = {"tests": 0.3, "notebooks": 0.45, "bench": 0.25}


def _run(name: str, cmd: list[str], timeout: float, out: Path, env: dict | None = None) -> dict[str, Any]:
    """Run ``cmd`` with a deadline; its output goes to ``out/<name>.log``."""
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(1.0, timeout),
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
    print(f"[gpu-check] {name}: rc={rc} in {wall:.0f} s  ({tail[0][:120]})", flush=True)
    return {"cmd": " ".join(cmd), "rc": rc, "wall_s": round(wall, 1), "log": str(log), "last_line": tail[0]}


def triton_compile_count() -> int | None:
    """Compiled Triton kernels held by minillm's kernels in this process (None without triton)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return None
    import minillm.kernels as K

    seen, total = set(), 0
    for mod in list(sys.modules.values()):
        if mod is None or not getattr(mod, "__name__", "").startswith(K.__name__):
            continue
        for obj in vars(mod).values():
            fn = getattr(obj, "fn", obj)  # autotuned / heuristics wrappers keep the JITFunction in .fn
            if id(fn) in seen:
                continue
            caches = getattr(fn, "device_caches", None)  # triton >= 3.0: device -> (kernel cache, ...)
            if isinstance(caches, dict):
                seen.add(id(fn))
                total += sum(len(c[0]) if isinstance(c, tuple) else len(c) for c in caches.values())
            elif isinstance(getattr(fn, "cache", None), dict):  # older triton: device -> {key: kernel}
                seen.add(id(fn))
                total += sum(len(c) for c in fn.cache.values())
    return total


def _step_stats(res) -> dict[str, Any]:
    times = [s.end - s.start for s in res.steps]
    decode = [s.end - s.start for s in res.steps if s.num_new_tokens and all(n == 1 for n in s.num_new_tokens)]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"engine": res.engine, "output_tokens": res.output_tokens, "wall_s": res.wall_s,
            "output_tokens_per_s": res.throughput, "steps": len(times), "mean_step_s": mean(times),
            "mean_decode_step_s": mean(decode)}


def bench(gpu: bool, num_requests: int) -> dict[str, Any]:
    """minillm's paged engine against transformers on one workload, same device and dtype.

    On a GPU: SmolLM2's real shapes with dummy weights, bf16, each side run twice (the
    first run compiles and warms up; the second is the one reported). On the CPU: a tiny
    model, once, to show the wiring.
    """
    import torch

    from minillm.config import EngineConfig, ModelConfig
    from minillm.bench.workload import make_workload

    out: dict[str, Any] = {}
    if gpu:
        from minillm.bench.compare import run_benchmark

        wl = make_workload("uniform", num_requests, seed=0)
        before = triton_compile_count()
        run_benchmark(["paged", "hf-generate"], wl, dummy_weights=True, progress=False, max_num_seqs=8)  # warm
        warm = triton_compile_count()
        results = run_benchmark(["paged", "hf-generate"], wl, dummy_weights=True, progress=False, max_num_seqs=8)
        after = triton_compile_count()
        out["runs"] = [_step_stats(r) for r in results]
        out["triton_compiles"] = {"warmup_run": None if before is None else warm - before,
                                  "timed_run": None if warm is None else after - warm}
        out["dtype"] = "bfloat16"
        # Quantized weights on the GPU (Triton GEMVs, bf16 activations): the first run compiles
        # their variants, the second is reported, against the float paged run above.
        for scheme in ("int8", "q4"):
            try:
                run_benchmark(["paged"], wl, dummy_weights=True, progress=False, max_num_seqs=8, quantization=scheme)
                q = run_benchmark(["paged"], wl, dummy_weights=True, progress=False, max_num_seqs=8,
                                  quantization=scheme)[0]
                out[f"paged_{scheme}"] = _step_stats(q)
            except Exception as e:  # noqa: BLE001 - reported, the rest of the check goes on
                out[f"paged_{scheme}"] = {"error": f"{type(e).__name__}: {e}"}
        # The host KV tier (chapter 9) with pinned memory: multi-turn chat in a tight pool,
        # no prefix cache / the device LRU alone / the host tier, bf16 at the real shapes.
        try:
            from minillm import loader
            from minillm.bench import offload_measure

            res = offload_measure.measure(num_conversations=8, turns=4, rounds=3, num_blocks=36, max_tokens=16,
                                          weights=loader.dummy_weights(ModelConfig(), 0), model_config=ModelConfig(),
                                          progress=False,
                                          device="cuda", dtype="bfloat16")
            out["kv_offload"] = {k: res[k] for k in ("medians", "same_tokens", "computed_ratio",
                                                     "ttft_p50_speedup", "copies")}
        except Exception as e:  # noqa: BLE001
            out["kv_offload"] = {"error": f"{type(e).__name__}: {e}"}
        return out
    from minillm import loader
    from minillm.engine import build_engine
    from minillm.bench import hf_baselines
    from minillm.sampling_params import SamplingParams

    tiny = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    wl = make_workload("uniform", num_requests, seed=0, vocab_size=tiny.vocab_size, prompt_len=8, output_len=4)
    weights = loader.dummy_weights(tiny, 0)
    eng = build_engine(EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4),
                       weights, None, model_config=tiny)
    t = time.perf_counter()
    outs = eng.run([eng.make_request(r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                                        ignore_eos=True)) for r in wl])
    wall = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    steps = [s.end - s.start for s in eng.step_records]
    mine = {"engine": "paged", "output_tokens": n, "wall_s": wall, "output_tokens_per_s": n / wall,
            "steps": len(steps), "mean_step_s": sum(steps) / len(steps)}
    hf = loader.hf_model_from_weights(weights, tiny, torch.float32)
    ref = hf_baselines.run_hf_generate(hf, wl, 4, tiny.eos_token_id)
    out["runs"] = [mine, _step_stats(ref)]
    out["same_tokens"] = [o.token_ids for o in outs] == ref.output_token_ids
    out["triton_compiles"] = {"timed_run": triton_compile_count()}
    out["dtype"] = "float32"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minillm.bench.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or "out", help="where the JSON and logs go")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds for the whole check (default 480)")
    p.add_argument("--skip", default="", help="comma list of parts to leave out: tests, notebooks, bench")
    p.add_argument("--num-requests", type=int, default=16, help="requests in the benchmark workload")
    args = p.parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    gpu = torch.cuda.is_available()
    report: dict[str, Any] = {"cuda": gpu, "torch": torch.__version__,
                              "device": torch.cuda.get_device_name(0) if gpu else "cpu"}
    t0 = time.perf_counter()
    running = sum(v for k, v in SHARES.items() if k not in skip and (gpu or k != "notebooks")) or 1.0
    # A part's share of the budget, among the parts that run (skipping one gives the others its time).
    left = lambda share: min(args.budget_s * share / running, args.budget_s - (time.perf_counter() - t0))  # noqa: E731
    py = sys.executable
    if not gpu:
        print("[gpu-check] no CUDA GPU found: dry run (the GPU tests are collected, not run; a tiny "
              "dummy benchmark on the CPU)", flush=True)
    if "tests" not in skip:
        cmd = [py, "-m", "pytest", "-q", "-m", "gpu or aot", "-p", "no:cacheprovider", "tests"] + \
            ([] if gpu else ["--collect-only"])
        report["tests"] = _run("tests", cmd, left(SHARES["tests"]), out)
    if "notebooks" not in skip and gpu:
        timeout = os.environ.get("NBVAL_CELL_TIMEOUT", "600")
        cmd = [py, "-m", "pytest", "-q", "--nbval-lax", f"--nbval-cell-timeout={timeout}", "chapters/"]
        report["notebooks"] = _run("notebooks", cmd, left(SHARES["notebooks"]), out)
    if "bench" not in skip:
        t = time.perf_counter()
        try:
            report["bench"] = bench(gpu, args.num_requests if gpu else 4)
        except Exception as e:  # the report says what failed; the other parts still count
            report["bench"] = {"error": f"{type(e).__name__}: {e}"}
        report["bench"]["wall_s"] = round(time.perf_counter() - t, 1)
        print(f"[gpu-check] bench: {json.dumps(report['bench'].get('runs', report['bench']))[:400]}", flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    path = out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"[gpu-check] wrote {path} ({report['wall_s']} s)", flush=True)
    if not gpu:
        print("[gpu-check] no GPU found: dry run only, nothing above ran on a GPU", flush=True)
        return 0
    failed = [k for k in ("tests", "notebooks") if k in report and report[k]["rc"] != 0]
    bench_parts = [report.get("bench", {})] + [v for v in report.get("bench", {}).values() if isinstance(v, dict)]
    failed += ["bench"] if any("error" in part for part in bench_parts) else []
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
