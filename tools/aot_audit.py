"""Ahead-of-time (AOT) audit: check on a CPU-only machine that every Triton kernel of
minillm compiles, fits and does not spill on the GPUs we target, in every launch
configuration the engine can reach.

    python tools/aot_audit.py [--targets 80,90] [--dtypes bf16,fp16,fp32] [--extra FILE] [--json OUT] [-v]

Why
---
The interpreter tests (TRITON_INTERPRET=1) check the math on a CPU but never run
the compiler. A tile that needs more shared memory than the GPU has, registers
that spill to (slow, off-chip) local memory, a dtype mismatch that only the MLIR
verifier rejects: all of that passes on the CPU and fails, or crawls, on the GPU.
The compiler itself runs anywhere, though: the triton wheel ships ptxas, and

    triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32))

lowers a kernel all the way to an sm_90 cubin on a laptop.

How
---
1. Capture (aot_capture.py, beside this file): call the engine's launches
   (minillm.kernels.warmup.engine_launches) on CPU tensors under a fake Triton driver
   that reports the target GPU, recording the variants the JIT would compile there.
2. Compile each distinct variant for its target (``compile_variant``, cached for
   the session): shared memory from the kernel metadata, registers and spills from
   ``ptxas -v``.
3. Check: it compiles; shared memory <= the target's per-block opt-in limit; no
   spills; every @triton.jit kernel of minillm.kernels compiled at least once; at
   most MAX_VARIANTS_PER_KERNEL variants per kernel are reachable; and launches at
   other batches and table widths than warmup's reach no variant warmup misses.
   The same for a quantized model's GEMVs (warmup's ``quantization="int8" | "q4"``):
   their variants, counted per scheme, and other row counts reaching nothing new.

It is a developer tool, not part of the installed package: the capture patches private
parts of triton. TRITON_INTERPRET must be unset (under the interpreter @triton.jit returns
interpreter objects, not compilable JITFunctions, so tests/kernels/test_aot.py runs this
script in a subprocess). It needs minillm importable (pip install -e .).

What it cannot see: numerical results, races, out-of-bounds addresses from bad
indices, launch-time errors with the real driver, and speed or occupancy.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch

from aot_capture import Variant, capture, check_compile_mode, find_jit_kernels, restored
from minillm.kernels._common import A100, H100, GpuSpec
from minillm.kernels.warmup import (DTYPES, QUANTIZATIONS, Launch, ModelShape, engine_launches, quant_launches,
                                    run_decode, run_prefill, run_store_kv)

TARGETS: tuple[GpuSpec, ...] = (A100, H100)  # sm_80, sm_90
ENGINE_BLOCK_SIZES = (8, 16, 32)  # paged engine; the contiguous engines use one block of max_model_len
MAX_VARIANTS_PER_KERNEL = 8  # the bound tests/kernels/test_aot.py holds the reachable variants to
SMOLLM2_135M = ModelShape("SmolLM2-135M", hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                          intermediate_size=1536, vocab_size=49152)
# Rows of x of quantized GEMVs that warmup's quant_launches (1, 17, max_num_seqs) do not make.
QUANT_SERVING_ROWS = (2, 5, 16, 33, 64, 100, 255)


# ----------------------------------------------------------------------------
# Compile one variant for its target and read its resources
# ----------------------------------------------------------------------------


@dataclass
class CompileResult:
    kernel: str
    dtype: str
    target: str  # "sm_80"
    config: str  # Variant.describe()
    ok: bool
    error: str = ""
    shared: int = 0  # bytes of shared memory per program
    smem_limit: int = 0
    registers: int | None = None  # per thread
    spill_stores: int | None = None  # bytes per thread
    spill_loads: int | None = None
    seconds: float = 0.0
    launches: list[str] = field(default_factory=list)  # labels of the launches that reach it

    def problems(self) -> list[str]:
        if not self.ok:
            return [f"does not compile: {self.error}"]
        found = []
        if self.shared > self.smem_limit:
            found.append(f"shared memory {self.shared} B > {self.smem_limit} B")
        if self.registers is None:
            found.append("no ptxas register report")
        if self.spill_stores or self.spill_loads:
            found.append(f"spills {self.spill_stores}/{self.spill_loads} B (stores/loads)")
        return found


_RESULTS: dict[tuple, CompileResult] = {}  # variant key -> result, for the whole session

_REGS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


@contextlib.contextmanager
def _compile_env():
    """A fresh, private Triton cache for one compile (so ptxas really runs and prints
    its -v report, and the user's ~/.triton stays untouched), with the report on."""
    cache = tempfile.mkdtemp(prefix="minillm-aot-")
    wanted = {"TRITON_CACHE_DIR": cache, "TRITON_DUMP_PTXAS_LOG": "1",
              # Triton 3.9 warns that its fp-fusion default will change: state today's
              # default, the one the JIT uses (older versions ignore the variable).
              "TRITON_DEFAULT_FP_FUSION": os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(cache, ignore_errors=True)


def _as_jit_function(fn):
    """The JITFunction to compile. Under TRITON_INTERPRET=1 @triton.jit returns an
    InterpretedFunction holding the plain Python function: rebuild a JITFunction from it
    (enough for kernels that call only triton.language builtins, not other @jit helpers)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    inner = getattr(fn, "fn", None)
    if callable(inner):
        return JITFunction(inner)
    raise TypeError(f"not a Triton kernel: {fn!r}")


def _interpreter_patches_left() -> list[str]:
    """Names in triton.language.core that Triton's interpreter replaced and did not put back.

    Under TRITON_INTERPRET=1 a call of a @triton.jit helper from inside a kernel patches
    triton.language.core with the interpreter's builtins and never restores them (Triton's
    InterpretedFunction.__call__; a kernel's own launch restores what it patched). After that
    nothing in this process compiles for a GPU: the code generator calls the interpreter's
    builtins and fails on the first one with an error about the kernel that is not its fault.
    """
    import triton.language as tl

    return sorted(name for name, member in vars(tl.core).items()
                  if getattr(member, "__qualname__", "").startswith("_patch_"))


def _short_error(e: Exception) -> str:
    """One line: where, the offending source line and the message after Triton's caret."""
    lines = [x.rstrip() for x in str(e).splitlines()]
    caret = next((i for i, x in enumerate(lines) if x.strip().startswith("^")), None)
    if caret is not None:
        src = lines[caret - 1].strip() if caret > 0 else ""
        msg = " ".join(x.strip() for x in lines[caret + 1:] if x.strip())
        return f"{type(e).__name__}: `{src}` -> {msg}"[:500]
    text = " ".join(x.strip() for x in lines if x.strip())
    return f"{type(e).__name__}: {text}"[:500]


def compile_kernel(fn, signature: dict, constexprs: dict | None = None, attrs: dict | None = None,
                   gpu: GpuSpec = H100, options: dict | None = None, *, dtype: str = "?",
                   config: str = "") -> CompileResult:
    """Compile ``fn`` for ``gpu`` with triton.compile; never raises for a kernel error.

    signature: arg name -> "*fp16" | "i32" | "fp32" | "constexpr" ...; constexprs: name or
    (index,) -> value. Returns a CompileResult with ok=False and the error for a kernel
    the compiler rejects.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit_fn = _as_jit_function(fn)
    res = CompileResult(jit_fn.__name__, dtype, gpu.arch, config, ok=False, smem_limit=gpu.smem_per_block)
    patched = _interpreter_patches_left()
    if patched:
        res.error = (f"not compiled: Triton's interpreter left triton.language patched in this process "
                     f"({', '.join(patched[:3])}, ... {len(patched)} names; a @triton.jit helper ran under "
                     f"TRITON_INTERPRET=1); compile in a fresh process, as python tools/aot_audit.py does")
        return res
    t0 = time.perf_counter()
    log = io.StringIO()
    try:
        src = ASTSource(jit_fn, dict(signature), dict(constexprs or {}), dict(attrs or {}))
        with _compile_env(), contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", gpu.capability, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler error is the finding
        res.error = _short_error(e)
        res.seconds = time.perf_counter() - t0
        return res
    res.ok = True
    res.seconds = time.perf_counter() - t0
    res.shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    text = log.getvalue()
    regs, spills = _REGS.search(text), _SPILLS.search(text)
    if regs:
        res.registers = int(regs.group(1))
        res.spill_stores, res.spill_loads = (int(spills.group(1)), int(spills.group(2))) if spills else (0, 0)
    return res


def compile_variant(v: Variant) -> CompileResult:
    """Compile a captured variant for its own target (once per session)."""
    if v.key not in _RESULTS:
        _RESULTS[v.key] = compile_kernel(v.fn, v.signature, v.constexprs, v.attrs, v.target, v.options,
                                         dtype=v.dtype, config=v.describe())
        _RESULTS[v.key].launches = [v.launch.label] if v.launch else []
    return _RESULTS[v.key]


_POOL_TODO: list[Variant] = []  # what forked workers compile, by index (JITFunctions do not pickle)


def _compile_in_worker(i: int) -> tuple[int, dict]:
    return i, compile_variant(_POOL_TODO[i]).__dict__


def compile_all(variants: list[Variant], jobs: int | None = None, log=None) -> list[CompileResult]:
    """compile_variant for each, in ``jobs`` forked processes (default: one per CPU).

    A compile is single-threaded (MLIR passes, then ptxas), so processes are the
    way to use more cores. Workers are forked after the capture, so they inherit
    the variants; only indices and result dicts cross the process boundary.
    """
    global _POOL_TODO
    todo = list({v.key: v for v in variants if v.key not in _RESULTS}.values())
    # Longest first (fp32 FMA tiles and the attention kernels), for an even finish.
    todo.sort(key=lambda v: (v.dtype != "fp32", "attention" not in v.fn.__module__))
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo)))
    t0 = time.perf_counter()
    if jobs > 1 and "fork" in multiprocessing.get_all_start_methods():
        _POOL_TODO = todo
        try:
            with multiprocessing.get_context("fork").Pool(jobs) as pool:
                for n, (i, res) in enumerate(pool.imap_unordered(_compile_in_worker, range(len(todo))), 1):
                    _RESULTS[todo[i].key] = CompileResult(**res)
                    if log and n % 20 == 0:
                        log(f"  compiled {n}/{len(todo)} ({time.perf_counter() - t0:.0f} s, {jobs} processes)")
        finally:
            _POOL_TODO = []
    else:
        for n, v in enumerate(todo, 1):
            compile_variant(v)
            if log and n % 20 == 0:
                log(f"  compiled {n}/{len(todo)} ({time.perf_counter() - t0:.0f} s)")
    return [_RESULTS[v.key] for v in variants]


# ----------------------------------------------------------------------------
# Does warmup cover serving? Launches at batches and widths warmup does not make
# ----------------------------------------------------------------------------


def serving_launches(model, dtype: torch.dtype, block_size: int, *, max_num_seqs: int = 256,
                     max_model_len: int | None = None) -> list[Launch]:
    """A sample of the engine's launches crossing batch, table width and prompt length
    (engine_launches sweeps each alone): after warmup, none of them may compile."""
    m = ModelShape.of(model)
    max_blocks = max(1, -(-(max_model_len or m.max_model_len) // block_size))
    widths = sorted({w for w in (1, 2, 15, 16, 17, 33, 300, max_blocks // 2, max_blocks - 1, max_blocks)
                     if 1 <= w <= max_blocks})
    batches = sorted({b for b in (1, 3, 7, 16, 33, 64, 100, max_num_seqs - 1, max_num_seqs) if 1 <= b <= max_num_seqs})
    out = [Launch(f"serve store_kv T={T}", dtype, partial(run_store_kv, m, block_size, dtype, T))
           for T in (2, 16, 32, 100, 1000)]
    out += [Launch(f"serve decode B={B} width={w} bs={block_size}", dtype,
                   partial(run_decode, m, block_size, dtype, B, w)) for B in batches for w in widths]
    out += [Launch(f"serve prefill B={B} q_len={q} width={w} bs={block_size}", dtype,
                   partial(run_prefill, m, block_size, dtype, B, w, q))
            for B in (1, 5) for q in (1, 3, 16, 100) for w in widths]
    return out


# ----------------------------------------------------------------------------
# The whole check and its table
# ----------------------------------------------------------------------------


def run_check(targets=TARGETS, dtypes=tuple(DTYPES), block_sizes=ENGINE_BLOCK_SIZES, model=SMOLLM2_135M, *,
              max_num_seqs: int = 256, extra: Callable[[], list[Launch]] | None = None, jobs: int | None = None,
              log=print) -> dict:
    """Capture the engine's launches (plus ``extra()``'s) for every target, compile every
    distinct variant, and return a JSON-able report (see main())."""
    m = ModelShape.of(model)
    kernels = find_jit_kernels()
    report = {"triton": __import__("triton").__version__, "torch": torch.__version__, "model": m.__dict__,
              "kernels": sorted(kernels), "results": [], "wrapper_errors": [], "reachable": {}, "compiled": [],
              "warmup_checked": [], "warmup_misses": []}
    t0 = time.perf_counter()
    variants: list[Variant] = []
    for gpu in targets:
        with capture(gpu) as rec:
            for dname in dtypes:
                union: dict[tuple, Variant] = {}
                for bs in (*block_sizes, m.max_model_len):  # + the contiguous engines' one block
                    reached = rec.run(engine_launches(m, DTYPES[dname], bs, gpu, max_num_seqs=max_num_seqs))
                    union.update((v.key, v) for v in reached)
                    if gpu == H100:
                        report["reachable"][f"{dname}/bs={bs}"] = _count_per_kernel(reached)
                    # What warmup compiled must be all that serving at other batches and widths needs.
                    warm = {v.key for v in reached}
                    served = rec.run(serving_launches(m, DTYPES[dname], bs, max_num_seqs=max_num_seqs))
                    report["warmup_checked"].append(f"{gpu.arch} {dname} bs={bs}")
                    report["warmup_misses"] += [f"{gpu.arch} {dname} bs={bs}: {v.kernel} [{v.describe()}]"
                                                for v in served if v.key not in warm]
                if gpu == H100:
                    report["reachable"][f"{dname}/any bs"] = _count_per_kernel(union.values())
                # A quantized model's GEMVs: what warmup(quantization=q) adds, and whether
                # other row counts (decode batches, prefill chunks) need more.
                for q in QUANTIZATIONS:
                    reached = rec.run(quant_launches(m, DTYPES[dname], q, max_num_seqs=max_num_seqs))
                    if gpu == H100:
                        report["reachable"][f"{dname}/{q}"] = _count_per_kernel(reached)
                    warm = {v.key for v in reached}
                    served = rec.run(quant_launches(m, DTYPES[dname], q, rows=QUANT_SERVING_ROWS))
                    report["warmup_checked"].append(f"{gpu.arch} {dname} {q}")
                    report["warmup_misses"] += [f"{gpu.arch} {dname} {q}: {v.kernel} [{v.describe()}]"
                                                for v in served if v.key not in warm]
            if extra is not None:
                rec.run(extra())
        report["wrapper_errors"] += [f"{gpu.arch} {label}: {err}" for label, err in rec.errors]
        variants += rec.variants.values()
    capture_s = time.perf_counter() - t0
    log(f"captured {len(variants)} distinct variants for {', '.join(g.arch for g in targets)} in {capture_s:.1f} s")
    t1 = time.perf_counter()
    report["results"] = [r.__dict__ for r in compile_all(variants, jobs, log)]
    report["compiled"] = sorted({k for k, fn in kernels.items() if any(v.fn is fn for v in variants)})
    report["seconds"] = {"capture": round(capture_s, 2), "compile": round(time.perf_counter() - t1, 2)}
    report["restored"] = restored()  # capture() must leave nothing behind
    return report


def _count_per_kernel(variants: Iterable[Variant]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in variants:
        counts[v.kernel] = counts.get(v.kernel, 0) + 1
    return counts


def summarize(results: list[dict]) -> list[dict]:
    """One row per (kernel, dtype, target): variants, max shared memory, register range, max spills."""
    rows: dict[tuple, dict] = {}
    for r in results:
        row = rows.setdefault((r["kernel"], r["dtype"], r["target"]), {
            "kernel": r["kernel"], "dtype": r["dtype"], "target": r["target"], "variants": 0, "failed": 0,
            "shared": 0, "smem_limit": r["smem_limit"], "regs_min": None, "regs_max": None, "spill": 0})
        row["variants"] += 1
        row["failed"] += bool(CompileResult(**r).problems())
        row["shared"] = max(row["shared"], r["shared"])
        if r["registers"] is not None:
            row["regs_min"] = r["registers"] if row["regs_min"] is None else min(row["regs_min"], r["registers"])
            row["regs_max"] = r["registers"] if row["regs_max"] is None else max(row["regs_max"], r["registers"])
        row["spill"] = max(row["spill"], (r["spill_stores"] or 0) + (r["spill_loads"] or 0))
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return sorted(rows.values(), key=lambda x: (x["kernel"], order.get(x["dtype"], 9), x["target"]))


def format_table(report: dict, verbose: bool = False) -> str:
    lines = [f"{'kernel':<24}{'dtype':<6}{'target':<7}{'variants':>8}  {'shared mem (max/limit)':<24}"
             f"{'registers':<11}{'spills B':>8}  status"]
    for row in summarize(report["results"]):
        regs = "?" if row["regs_max"] is None else (
            f"{row['regs_min']}" if row["regs_min"] == row["regs_max"] else f"{row['regs_min']}-{row['regs_max']}")
        smem = f"{row['shared']}/{row['smem_limit']} B"
        status = "OK" if not row["failed"] else f"FAIL ({row['failed']})"
        lines.append(f"{row['kernel']:<24}{row['dtype']:<6}{row['target']:<7}{row['variants']:>8}  {smem:<24}"
                     f"{regs:<11}{row['spill']:>8}  {status}")
    for r in report["results"]:
        problems = CompileResult(**r).problems()
        if verbose or problems:
            lines.append(f"  {'FAIL' if problems else 'ok  '} {r['kernel']} {r['dtype']} {r['target']} "
                         f"[{r['config']}] smem={r['shared']} regs={r['registers']} "
                         f"spill={r['spill_stores']}/{r['spill_loads']} {r['seconds']:.1f}s <- {r['launches'][0]}"
                         + (f"\n       {'; '.join(problems)}" if problems else ""))
    for err in report["wrapper_errors"]:
        lines.append(f"  FAIL wrapper {err}")
    missing = sorted(set(report["kernels"]) - set(report["compiled"]))
    for name in missing:
        lines.append(f"  FAIL coverage: {name} is reached by no launch configuration")
    for miss in report.get("warmup_misses", []):
        lines.append(f"  FAIL warmup misses {miss}")
    if report["reachable"]:
        names = sorted({n for v in report["reachable"].values() for n in v})
        short = [n.strip("_").replace("_kernel", "") for n in names]
        lines.append("\nreachable variants on sm_90, any batch <= max_num_seqs and any table width "
                     "(bs=8192: the contiguous engines)")
        lines.append(f"  {'dtype/block size':<18}" + "".join(f"{x:>15}" for x in short))
        for k, v in report["reachable"].items():
            lines.append(f"  {k:<18}" + "".join(f"{v.get(n, 0):>15}" for n in names))
    return "\n".join(lines)


def failures(report: dict) -> list[str]:
    out = [f"{r['kernel']} {r['dtype']} {r['target']} [{r['config']}]: {p}"
           for r in report["results"] for p in CompileResult(**r).problems()]
    out += [f"wrapper: {e}" for e in report["wrapper_errors"]]
    out += [f"coverage: {k} never compiled" for k in sorted(set(report["kernels"]) - set(report["compiled"]))]
    out += [f"reachable: {k} {n}={c} > {MAX_VARIANTS_PER_KERNEL}" for k, v in report["reachable"].items()
            for n, c in v.items() if c > MAX_VARIANTS_PER_KERNEL]
    out += [f"warmup misses {miss}" for miss in report.get("warmup_misses", [])]
    if not report.get("restored", True):
        out.append("capture() left a patch behind")
    return out


def _load_extra(path: str) -> Callable[[], list[Launch]]:
    """A Python file with a function launches() -> list[Launch] (e.g. the tests' shapes)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_aot_extra_launches", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.launches


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/aot_audit.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="80,90", help="compute capabilities (default: 80,90)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--block-sizes", default=",".join(map(str, ENGINE_BLOCK_SIZES)),
                    help="paged-engine block sizes; the contiguous engines' max_model_len is always added")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--extra", help="a Python file defining launches() -> list[minillm.kernels.warmup.Launch]")
    ap.add_argument("--json", help="also write the full report here")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per compiled variant")
    args = ap.parse_args(argv)
    try:
        check_compile_mode()
    except RuntimeError as e:
        print(f"aot_audit: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # as in _compile_env, for the capture
    by_cap = {g.capability: g for g in TARGETS}
    targets = [by_cap[int(t)] for t in args.targets.split(",") if t]
    report = run_check(targets, tuple(d for d in args.dtypes.split(",") if d),
                       tuple(int(b) for b in args.block_sizes.split(",") if b),
                       max_num_seqs=args.max_num_seqs, extra=_load_extra(args.extra) if args.extra else None,
                       jobs=args.jobs, log=lambda s: print(s, file=sys.stderr))
    print(f"triton {report['triton']}, torch {report['torch']}; model {report['model']['name']}; "
          f"capture {report['seconds']['capture']} s, compile {report['seconds']['compile']} s")
    print(format_table(report, args.verbose))
    bad = failures(report)
    print(f"\n{'FAILED' if bad else 'PASSED'}: {len(report['results'])} compiles, {len(bad)} failure(s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
