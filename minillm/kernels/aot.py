"""Ahead-of-time (AOT) compilation: check on a CPU-only machine that every Triton
kernel compiles, fits and does not spill on the GPUs we target, in every launch
configuration the engine can reach -- and compile those same variants up front
on a real GPU (``warmup``) so that no compile ever happens while serving.

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
1. Capture. ``kernel[grid](*args)`` goes through JITFunction.run: it asks the
   active *driver* for the target GPU, binds the arguments into a specialisation
   (pointer dtypes; for integers whether they equal 1 or are divisible by 16;
   constexpr values; num_warps/num_stages) and compiles on a cache miss.
   ``capture(gpu)`` installs a fake driver that reports ``gpu``, makes the
   wrappers plan for it (tile sizes, split counts: _common.planning_gpu), and
   swaps JITFunction._do_compile for a recorder. Calling the real wrappers on
   CPU tensors shaped like the engine's then records exactly the variants the
   JIT would compile on that GPU -- and launches nothing. Every patch is undone
   on exit.
2. Compile each distinct variant for its target (``compile_variant``, cached
   for the session): shared memory from the kernel metadata, registers and
   spills from ``ptxas -v``.
3. Check: it compiles; shared memory <= the target's per-block opt-in limit;
   no spills; every @triton.jit kernel of the package compiled at least once.

``reachable_variants`` sweeps every batch size and block-table width a model
can see and returns the distinct binaries per kernel: the number a serving
process can ever compile. ``warmup`` replays one launch per such variant on the
GPU before the first request.

Run ``python -m minillm.kernels.aot`` for the table; TRITON_INTERPRET must be unset
(under the interpreter @triton.jit returns interpreter objects, not compilable
JITFunctions, so tests/kernels/test_aot.py runs this module in a subprocess).

What it cannot see: numerical results, races, out-of-bounds addresses from bad
indices, launch-time errors with the real driver, and speed or occupancy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import multiprocessing
import os
import pkgutil
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch

from . import _common
from ._common import A100, H100, HAS_TRITON, GpuSpec

TARGETS: tuple[GpuSpec, ...] = (A100, H100)  # sm_80, sm_90
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ENGINE_BLOCK_SIZES = (8, 16, 32)  # paged engine; the contiguous engines use one block of max_model_len
MAX_VARIANTS_PER_KERNEL = 8  # the bound tests/kernels/test_aot.py holds reachable_variants to


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        aliases = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
        return aliases.get(dtype, dtype)
    return {v: k for k, v in DTYPES.items()}[dtype]


# ----------------------------------------------------------------------------
# The model: only the sizes that reach the kernels
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int = 8192

    @classmethod
    def of(cls, cfg) -> "ModelShape":
        """From a ModelShape, a minillm.config.ModelConfig or anything with the same fields."""
        if isinstance(cfg, ModelShape):
            return cfg
        return cls(
            name=type(cfg).__name__,
            hidden_size=int(cfg.hidden_size),
            num_heads=int(cfg.num_heads),
            num_kv_heads=int(cfg.num_kv_heads),
            head_dim=int(cfg.head_dim),
            max_model_len=int(getattr(cfg, "max_position_embeddings", 8192)),
        )


SMOLLM2_135M = ModelShape("SmolLM2-135M", hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64)


# ----------------------------------------------------------------------------
# Launches: one wrapper call each, with tensors built on any device
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One call of a host wrapper. ``run(device)`` builds the inputs on ``device``
    (CPU while capturing, CUDA in warmup) and calls the wrapper."""

    label: str
    dtype: torch.dtype
    run: Callable[[torch.device], object] = field(compare=False, repr=False)


@functools.lru_cache(maxsize=None)
def _kernel_modules():
    # importlib, not attribute access: minillm/kernels/__init__ re-exports functions named like modules
    names = ("rmsnorm", "store_kv", "paged_decode_attention", "paged_prefill_attention")
    return {n: importlib.import_module(f"{__package__}.{n}") for n in names}


def _engine_qkv(m: ModelShape, T: int, dtype, device):
    """q, k, v as minillm.model.Attention hands them over: q and k fresh RoPE
    outputs (contiguous), v a strided view of the fused qkv projection."""
    qkv = torch.empty(T, (m.num_heads + 2 * m.num_kv_heads) * m.head_dim, dtype=dtype, device=device)
    v = qkv[:, (m.num_heads + m.num_kv_heads) * m.head_dim:].view(T, m.num_kv_heads, m.head_dim)
    q = torch.empty(T, m.num_heads, m.head_dim, dtype=dtype, device=device)
    k = torch.empty(T, m.num_kv_heads, m.head_dim, dtype=dtype, device=device)
    return q, k, v


def _filled(shape, value, dtype, device):
    """Inputs whose values matter only when something runs: left uninitialised on the
    CPU (capture launches nothing, and the sweep makes thousands of them), set on a GPU."""
    if device.type == "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, value, dtype=dtype, device=device)


def _engine_cache(m: ModelShape, block_size: int, dtype, device):
    # One physical block is enough: every block-table entry may point at it.
    shape = (1, block_size, m.num_kv_heads, m.head_dim)
    return _filled(shape, 0, dtype, device), _filled(shape, 0, dtype, device)


def _run_store_kv(m, block_size, dtype, T, device):
    _, k, v = _engine_qkv(m, T, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    slots = _filled((T,), 0, torch.int64, device)  # build_batch: int64
    return _kernel_modules()["store_kv"].store_kv(k, v, kc, vc, slots)


def _run_rms_norm(m, dtype, T, fused, device):
    rms = _kernel_modules()["rmsnorm"]
    x = _filled((T, m.hidden_size), 1, dtype, device)
    w = _filled((m.hidden_size,), 1, dtype, device)
    if fused:
        return rms.fused_add_rms_norm(x, _filled((T, m.hidden_size), 1, dtype, device), w, 1e-5)
    return rms.rms_norm(x, w, 1e-5)


def _run_decode(m, block_size, dtype, B, width, device, num_splits=None):
    q, _, _ = _engine_qkv(m, B, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    tables = _filled((B, width), 0, torch.int32, device)  # build_batch: [B, width] int32
    ctx = _filled((B,), 1, torch.int32, device)
    dec = _kernel_modules()["paged_decode_attention"]
    return dec.paged_decode_attention(q, kc, vc, tables, ctx, m.head_dim ** -0.5, num_splits=num_splits)


def _run_prefill(m, block_size, dtype, B, width, q_len, device):
    q, _, _ = _engine_qkv(m, B * q_len, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    tables = _filled((B, width), 0, torch.int32, device)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=device)  # [B+1]
    ctx = _filled((B,), q_len, torch.int32, device)
    pre = _kernel_modules()["paged_prefill_attention"]
    return pre.paged_prefill_attention(q, kc, vc, tables, qsl, ctx, m.head_dim ** -0.5, max_query_len=q_len)


def engine_launches(model, dtype: torch.dtype, block_size: int, gpu: GpuSpec, *,
                    max_num_seqs: int = 256, max_model_len: int | None = None) -> list[Launch]:
    """The kernel launches a minillm engine makes for this model, dtype and block size.

    From step to step the engine varies only the batch (B sequences, T tokens) and
    the block-table width (blocks of the step's longest sequence, 1 ..
    ceil(max_model_len / block_size); the contiguous engines use one block of
    max_model_len, so their width is 1). T and the number of prefill rows only
    size grids. B and the width reach the decode kernel as the table stride and,
    through the wrapper's split heuristic, as the split count.

    Triton's cache key is argument by argument (each argument's own facts, plus
    the constexprs), so sweeping each of these inputs over its whole range with
    the others fixed meets every fact each can contribute: every width at B=1 and
    at B=max_num_seqs, and every B at the widest table (which reaches every split
    count the heuristic can choose). That is ~2.3k wrapper calls at block size 8,
    about a second.
    """
    m = ModelShape.of(model)
    max_len = max_model_len or m.max_model_len
    max_blocks = max(1, -(-max_len // block_size))
    out = []
    for T in sorted({1, 17, max_num_seqs}):
        out.append(Launch(f"store_kv T={T}", dtype, partial(_run_store_kv, m, block_size, dtype, T)))
    # minillm.model normalises with torch today; the kernel is covered for when it is wired in.
    for fused in (False, True):
        name = "fused_add_rms_norm" if fused else "rms_norm"
        for T in (1, 17):
            out.append(Launch(f"{name} T={T}", dtype, partial(_run_rms_norm, m, dtype, T, fused)))
    decode = [(1, w) for w in range(1, max_blocks + 1)]
    decode += [(B, max_blocks) for B in range(2, max_num_seqs + 1)]
    decode += [(max_num_seqs, w) for w in range(1, max_blocks)]
    for B, width in decode:
        out.append(Launch(f"decode B={B} width={width} bs={block_size}", dtype,
                          partial(_run_decode, m, block_size, dtype, B, width)))
    prefill = [(1, 1, w) for w in range(1, max_blocks + 1)]
    prefill += [(3, 7, max_blocks), (max_num_seqs, 2, max_blocks)]  # chunks, speculative verification
    for B, q_len, width in prefill:
        out.append(Launch(f"prefill B={B} q_len={q_len} width={width} bs={block_size}", dtype,
                          partial(_run_prefill, m, block_size, dtype, B, width, q_len)))
    return out


# ----------------------------------------------------------------------------
# Capture: what the JIT would compile, without a GPU
# ----------------------------------------------------------------------------


def _check_compile_mode() -> None:
    if not HAS_TRITON:
        raise RuntimeError("minillm.kernels.aot needs the 'triton' package")
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError(
            "minillm.kernels.aot needs compiled-mode kernels: unset TRITON_INTERPRET before importing triton "
            "(under the interpreter @triton.jit makes interpreter objects, which nothing can compile)")


@dataclass
class Variant:
    """One specialisation of one kernel = one binary the JIT would build."""

    kernel: str
    fn: object = field(repr=False)  # the JITFunction
    signature: dict = field(repr=False)  # arg name -> type ("*bf16", "i32", "constexpr", ...)
    constexprs: dict = field(repr=False)  # arg path -> value
    attrs: dict = field(repr=False)  # arg path -> [["tt.divisibility", 16]], ...
    options: dict = field(repr=False)  # num_warps, num_stages, ... (the target's parsed options)
    target: GpuSpec
    dtype: str  # dtype of the launch that first reached it
    launch: Launch  # the first launch that reached it (warmup replays it)

    @property
    def key(self) -> tuple:
        return (self.fn.__module__, self.kernel, self.target.capability, repr(sorted(self.signature.items())),
                repr(sorted(self.constexprs.items())), repr(sorted(self.attrs.items())),
                repr(sorted(self.options.items())))

    def describe(self) -> str:
        """The compile-time facts: constexprs, integers specialised to 1, divisibility, warps/stages."""
        names = list(self.signature)
        consts = [f"{names[p[0]]}={v}" for p, v in sorted(self.constexprs.items())]
        div16 = [names[p[0]] for p, a in sorted(self.attrs.items()) if "divisibility" in repr(a)
                 and not self.signature[names[p[0]]].startswith("*")]
        text = " ".join(consts)
        if div16:
            text += f" %16:{','.join(div16)}"
        return f"{text} warps={self.options.get('num_warps')} stages={self.options.get('num_stages')}"


class _FakeDriver:
    """Just enough of a Triton driver for JITFunction.run to bind and specialise arguments."""

    def __init__(self, gpu: GpuSpec):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", gpu.capability, 32)
        self.device = f"aot:{gpu.arch}"  # a key no real device uses in JITFunction.device_caches

    def get_current_device(self):
        return self.device

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def is_active(self):
        return True


class _StandIn:
    """Takes a compiled kernel's place in JITFunction's cache: a later launch with the
    same specialisation finds it (skipping the costly argument packing, as the real JIT
    does) and "runs" it, which only tells the recorder which variant was reached."""

    function = None
    packed_metadata = None

    def __init__(self, recorder: "Recorder", key: tuple):
        self.recorder, self.key = recorder, key

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.recorder._hit(self.key)


class Recorder:
    """Collects the variants the launches reach, one entry per distinct binary."""

    def __init__(self, gpu: GpuSpec):
        self.gpu = gpu
        self.variants: dict[tuple, Variant] = {}
        self.errors: list[tuple[str, str]] = []  # (launch label, wrapper error): a failure too
        self._launch: Launch | None = None
        self._hits: list[tuple] | None = None

    def _record(self, fn, signature, constexprs, attrs, options) -> "_StandIn":
        launch = self._launch
        v = Variant(fn.__name__, fn, dict(signature), dict(constexprs), dict(attrs), dict(options.__dict__),
                    self.gpu, dtype_name(launch.dtype) if launch else "?", launch)
        self.variants.setdefault(v.key, v)
        return _StandIn(self, v.key)

    def _hit(self, key) -> None:
        if self._hits is not None:
            self._hits.append(key)

    def run(self, launches: Iterable[Launch]) -> list[Variant]:
        """Call each launch on CPU tensors; returns the distinct variants they reach."""
        self._hits = []
        try:
            for launch in launches:
                self._launch = launch
                try:
                    launch.run(torch.device("cpu"))
                except Exception as e:  # a wrapper that rejects the engine's own inputs is a failure
                    self.errors.append((launch.label, f"{type(e).__name__}: {e}"))
            keys = dict.fromkeys(self._hits)
        finally:
            self._hits, self._launch = None, None
        return [self.variants[k] for k in keys]


@contextlib.contextmanager
def capture(gpu: GpuSpec = H100):
    """Record, instead of compiling and launching, every kernel specialisation the
    wrappers reach while planning for ``gpu``. Yields a Recorder; undoes every patch.

    Process-wide while it lasts (a class attribute, the active driver): do not launch
    kernels from another thread meanwhile (warmup runs it before serving starts).
    """
    _check_compile_mode()
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    recorder = Recorder(gpu)

    def recording_do_compile(self, key, signature, device, constexprs, options, attrs, *rest, **kwargs):
        stand_in = recorder._record(self, signature, constexprs, attrs, options)
        self.device_caches[device][0][key] = stand_in  # kernel_cache: the next identical launch is a hit
        return stand_in  # JITFunction.run "launches" it: nothing runs

    fake = _FakeDriver(gpu)
    saved_active = getattr(driver, "_active", None)
    saved_do_compile = JITFunction.__dict__["_do_compile"]
    saved_target = _common._aot_target
    JITFunction._do_compile = recording_do_compile
    driver.set_active(fake)
    _common._aot_target = gpu
    try:
        yield recorder
    finally:
        _common._aot_target = saved_target
        JITFunction._do_compile = saved_do_compile
        # Straight back to what was there (None on a CPU-only machine: never build the real driver).
        driver._active = saved_active
        # Drop the binders and stand-ins made for the fake device, from every kernel.
        for fn in [v.fn for v in recorder.variants.values()] + list(find_jit_kernels().values()):
            fn.device_caches.pop(fake.device, None)


def find_jit_kernels() -> dict[str, object]:
    """Every @triton.jit function defined in a module of the kernels package."""
    _check_compile_mode()
    from triton.runtime.jit import JITFunction

    pkg = importlib.import_module(__package__)
    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{__package__}.{info.name}")
        for name, obj in vars(mod).items():
            if isinstance(obj, JITFunction) and obj.__module__ == mod.__name__:
                found[f"{info.name}.{name}"] = obj
    return found


def reachable_variants(model, dtype: torch.dtype, block_size: int, *, max_num_seqs: int = 256,
                       max_model_len: int | None = None, gpu: GpuSpec = H100) -> dict[str, list[Variant]]:
    """kernel name -> the distinct binaries a minillm engine can compile for this model,
    dtype and KV block size on ``gpu`` (all batches up to max_num_seqs, all contexts up to
    max_model_len, default the model's). Needs compiled-mode Triton (TRITON_INTERPRET unset)."""
    with capture(gpu) as rec:
        variants = rec.run(engine_launches(model, dtype, block_size, gpu, max_num_seqs=max_num_seqs,
                                           max_model_len=max_model_len))
    if rec.errors:
        raise RuntimeError(f"wrapper errors while enumerating variants: {rec.errors[:3]}")
    out: dict[str, list[Variant]] = {}
    for v in variants:
        out.setdefault(v.kernel, []).append(v)
    return out


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
# Warm-up on a real GPU
# ----------------------------------------------------------------------------


def warmup(model_config, dtype, block_size: int, device, *, max_num_seqs: int = 256,
           max_model_len: int | None = None, progress: bool = True) -> int:
    """Compile every kernel variant an engine can reach, so none compiles while serving.

    warmup(model_config, dtype, block_size, device, *, max_num_seqs=256,
           max_model_len=None, progress=True) -> int

    model_config   minillm.config.ModelConfig (or anything with hidden_size, num_heads,
                   num_kv_heads, head_dim and optionally max_position_embeddings)
    dtype          the KV-cache / activation dtype: torch.bfloat16 | torch.float16 | torch.float32
                   (or "bfloat16" / "float16" / "float32")
    block_size     tokens per KV-cache block (the contiguous engines: max_model_len)
    device         where the engine runs: "cuda", "cuda:1" or a torch.device
    max_num_seqs   the largest batch the engine runs (decode split counts depend on it)
    max_model_len  longest context; None = model_config.max_position_embeddings
    progress       show a tqdm progress bar

    On CUDA it enumerates reachable_variants() for this GPU (on the host, in about a
    second), then launches each variant once on tiny inputs, which makes Triton compile
    it (or load it from its disk cache), and synchronises. Returns the number of
    variants launched. Anywhere else (CPU, the interpreter, no Triton) it does nothing
    and returns 0.
    """
    device = torch.device(device)
    if (device.type != "cuda" or not HAS_TRITON or not torch.cuda.is_available()
            or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return 0
    if isinstance(dtype, str):
        dtype = DTYPES[dtype_name(dtype)]
    gpu = _common.planning_gpu(device)
    per_kernel = reachable_variants(model_config, dtype, block_size, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, gpu=gpu)
    variants = [v for vs in per_kernel.values() for v in vs]
    from tqdm.auto import tqdm

    with torch.cuda.device(device):
        for v in tqdm(variants, desc=f"warming up kernels ({gpu.arch})", disable=not progress):
            v.launch.run(device)
        torch.cuda.synchronize(device)
    return len(variants)


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
              "kernels": sorted(kernels), "results": [], "wrapper_errors": [], "reachable": {}, "compiled": []}
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
                if gpu == H100:
                    report["reachable"][f"{dname}/any bs"] = _count_per_kernel(union.values())
            if extra is not None:
                rec.run(extra())
        report["wrapper_errors"] += [f"{gpu.arch} {label}: {err}" for label, err in rec.errors]
        variants += rec.variants.values()
    # warmup() replays each reachable variant's first launch: it must land on that same variant.
    for dname in dtypes:
        reach = reachable_variants(m, DTYPES[dname], block_sizes[0], max_num_seqs=max_num_seqs)
        wanted = {v.key for vs in reach.values() for v in vs}
        with capture(H100) as rec:
            replayed = {v.key for v in rec.run([v.launch for vs in reach.values() for v in vs])}
        report.setdefault("warmup_replays_every_variant", {})[dname] = replayed == wanted
    capture_s = time.perf_counter() - t0
    log(f"captured {len(variants)} distinct variants for {', '.join(g.arch for g in targets)} in {capture_s:.1f} s")
    t1 = time.perf_counter()
    report["results"] = [r.__dict__ for r in compile_all(variants, jobs, log)]
    report["compiled"] = sorted({k for k, fn in kernels.items() if any(v.fn is fn for v in variants)})
    report["seconds"] = {"capture": round(capture_s, 2), "compile": round(time.perf_counter() - t1, 2)}
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    # capture() must leave nothing behind: the recorder gone, the driver as it was.
    leftovers = [dev for fn in kernels.values() for dev in fn.device_caches if str(dev).startswith("aot:")]
    report["restored"] = (JITFunction.__dict__["_do_compile"].__name__ == "_do_compile"
                          and not isinstance(getattr(driver, "_active", None), _FakeDriver)
                          and _common._aot_target is None and not leftovers)
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
    ap = argparse.ArgumentParser(prog="python -m minillm.kernels.aot", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="80,90", help="compute capabilities (default: 80,90)")
    ap.add_argument("--dtypes", default="bf16,fp16,fp32")
    ap.add_argument("--block-sizes", default=",".join(map(str, ENGINE_BLOCK_SIZES)),
                    help="paged-engine block sizes; the contiguous engines' max_model_len is always added")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--extra", help="a Python file defining launches() -> list[minillm.kernels.aot.Launch]")
    ap.add_argument("--json", help="also write the full report here")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="compile processes (default: one per CPU)")
    ap.add_argument("-v", "--verbose", action="store_true", help="one line per compiled variant")
    args = ap.parse_args(argv)
    try:
        _check_compile_mode()
    except RuntimeError as e:
        print(f"minillm.kernels.aot: {e}", file=sys.stderr)
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
