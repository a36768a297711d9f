"""Attention on the CPU as a small C++ kernel (``attention_rows.cpp``).

What it computes is ``attention.torch_attention`` (the oracle, and what the tests compare it
with) for rows of one query each: a decode row, or one query of a prefill, a chunk or drafts
to verify, which ``attention.cpu_attention_rows`` gives the kernel as a row of its own with
its own number of keys (the causal mask, by construction). Each row attends over exactly its
sequence's cached keys, read through the block table. What it saves is the fixed cost of
doing that with torch calls: a gather of the row's K/V, then small matrix products whose
dispatch and packing cost several times the arithmetic of one row (python -m
minillm.bench.profile_step shows attention's share of a step); for a prefill, SDPA's CPU
kernel on short causal rows (a prompt of 190 tokens: 2.5-3x the kernel's time in bf16).
The kernel streams each row's keys once, for all the query heads that share a KV head, and
splits long rows into chunks so that every thread has work. It runs on torch's OpenMP
threads (the same libgomp, the same thread count).

The source is compiled on first use with the system's C++ compiler (g++ or c++; about 2 s)
into the cache folder (``MINILLM_CACHE``), once per source, compiler and CPU, and loaded
with ctypes: no build step at install, no Python headers. Where the build fails, the
engine's default falls back to the torch backend with a warning (``placement``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attention_rows.cpp")
# The library's other source: the elementwise ops between a layer's matmuls (``cpu_layer.py``).
LAYER_SOURCE = Path(__file__).with_name("layer_ops.cpp")
# -ffast-math lets the loops reassociate and vectorize exp; it is given to the compile only: linked
# with it, the library would switch the whole process to flushing subnormal floats to zero on load.
FLAGS = ["-O3", "-ffast-math", "-fPIC", "-std=c++17"]
# The layer ops round where PyTorch rounds: no fast math, and no products fused into FMAs; the
# two -fno flags change no value (they let floor and division vectorize: no errno, no traps).
LAYER_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=c++17"]
SOURCES = ((SOURCE, FLAGS), (LAYER_SOURCE, LAYER_FLAGS))
HEADERS = (Path(__file__).with_name("elements.h"),)  # included by both sources
# (compile flags, link flags), tried in order: a compiler without OpenMP (Apple's clang) builds a
# kernel that runs on the calling thread; one that does not know -march=native, a generic one.
ATTEMPTS = [(["-march=native", "-fopenmp"], ["-fopenmp"]), (["-march=native"], []), ([], [])]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
DTYPES = tuple(_DTYPE_CODES)

_REFUSALS = {1: "at most 16 query heads per KV head and head_dim at most 256",
             2: "a row has no keys (context length < 1)",
             4: "a row names a sequence or token outside block_tables / q",
             5: "a block table entry is outside the cache, or the context needs more blocks than the table has"}

PROFILER_NAME = "minillm::cpu_decode_attention"

_lib = None
_error: str | None = None


def compiler() -> str | None:
    """The C++ compiler the kernel is built with, or None where there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _build(cxx: str, folder: Path) -> None:
    out = folder / "libminillm_cpu.so"
    objs = [folder / f"{src.stem}.o" for src, _ in SOURCES]
    errors = []
    for compile_flags, link_flags in ATTEMPTS:
        cmds = [[cxx, *flags, *compile_flags, "-c", str(src), "-o", str(obj)] for (src, flags), obj in zip(SOURCES, objs)]
        cmds.append([cxx, "-shared", *link_flags, *map(str, objs), "-o", str(out)])
        for cmd in cmds:
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                errors.append(f"$ {' '.join(cmd)}\n{res.stderr.strip()[-1000:]}")
                break
        else:
            for obj in objs:
                obj.unlink()
            return
    raise RuntimeError(f"{Path(cxx).name} could not build the CPU kernels ({', '.join(src.name for src, _ in SOURCES)}):\n"
                       + "\n".join(errors))


def load():
    """The compiled kernel (a ctypes library), building it on first use; RuntimeError with the
    reason where it cannot be built."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    from minillm import loader

    cxx = compiler()
    if cxx is None:
        _error = ("no C++ compiler (g++ or c++) to build the CPU attention kernel: install one (apt install g++), "
                  "or pass attention_backend='torch'")
        raise RuntimeError(_error)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    recipe = repr(([(src.name, flags) for src, flags in SOURCES], ATTEMPTS)).encode()
    code = b"".join(f.read_bytes() for f in (*(src for src, _ in SOURCES), *HEADERS))
    key = hashlib.sha256(code + recipe + version.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    folder = loader.cache_dir() / f"cpu-kernels-{key}"
    errors: list[str] = []

    def write(tmp: Path) -> None:
        try:
            _build(cxx, tmp)
        except RuntimeError as e:
            errors.append(str(e))
            raise OSError(str(e)) from e

    try:
        if not loader.cached_folder(folder, write, str(SOURCE.name)):
            if errors:
                raise RuntimeError(errors[0])
            folder = Path(tempfile.mkdtemp(prefix="minillm-cpu-kernels-"))  # the cache cannot be written
            _build(cxx, folder)
        lib = ctypes.CDLL(str(folder / "libminillm_cpu.so"))
    except (RuntimeError, OSError) as e:
        _error = f"{e}\n(or pass attention_backend='torch')"
        raise RuntimeError(_error) from e
    fn = lib.minillm_decode_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, ptr, i64, ptr, ptr, i32, ctypes.c_float, i32,
                   i64, i64, i64, i64]
    fn.restype = i32
    f = ctypes.c_float
    lib.minillm_add_rms_norm.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i64, i64, f, i32]
    lib.minillm_silu_mul.argtypes = [i32, ptr, ptr, i64, i64, i32]
    lib.minillm_rope_write.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32]
    for name in ("minillm_add_rms_norm", "minillm_silu_mul", "minillm_rope_write"):
        getattr(lib, name).restype = i32
    _lib = lib
    return lib


def _profiling() -> bool:
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def named_call(name: str, fn, *args) -> int:
    """``fn(*args)``, a call into the library; while the torch profiler records, as an op named
    ``name`` (a ctypes call is no torch op: python -m minillm.bench.profile_step buckets it by name)."""
    if _profiling():
        with torch.profiler.record_function(name):
            return fn(*args)
    return fn(*args)


class DecodeRows:
    """``decode_attention`` for one step's rows: the step's tables are checked once, here,
    and each layer's call checks only its own tensors (30 layers call it with the same rows).

    block_tables [B, max_blocks] int32; context_lens [B] int32 (keys of each sequence, this
    step's included); rows [R, 2] int64, (sequence, token) pairs. All on the CPU.
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, rows: torch.Tensor):
        if any(t.device.type != "cpu" for t in (block_tables, context_lens, rows)):
            raise ValueError("the CPU decode kernel takes CPU tensors only (on CUDA the Triton backend attends)")
        if rows.dim() != 2 or rows.shape[1] != 2 or block_tables.dim() != 2 or context_lens.shape != block_tables.shape[:1]:
            raise ValueError(f"rows must be [R, 2], block_tables [B, max_blocks] and context_lens [B], got "
                             f"{tuple(rows.shape)}, {tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or rows.dtype != torch.int64:
            raise ValueError("block_tables and context_lens must be int32, rows int64")
        self.lib = load()
        self.tensors = (block_tables.contiguous(), context_lens.contiguous(), rows.contiguous())  # kept alive
        bt, ctx, r = self.tensors
        self.num_rows = r.shape[0]
        self.table_args = (bt.data_ptr(), bt.stride(0), ctx.data_ptr(), r.data_ptr(), r.shape[0])
        self.table_shape = (bt.shape[0], bt.shape[1])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        self.check_caches(k_cache, v_cache)
        self.run(self.bind(q, out, k_cache), k_cache.data_ptr(), v_cache.data_ptr(), scale)

    @staticmethod
    def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
            raise ValueError("the CPU decode kernel takes CPU tensors only (on CUDA the Triton backend attends)")
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"the caches differ: {tuple(k_cache.shape)} {k_cache.dtype} / "
                             f"{tuple(v_cache.shape)} {v_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV caches must be contiguous")

    def bind(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor) -> tuple:
        """Check q, out and the caches' shape (every layer's caches must have it); the arguments of
        ``run`` for every layer that attends from q into out."""
        if any(t.device.type != "cpu" for t in (q, k_cache, out)):
            raise ValueError("the CPU decode kernel takes CPU tensors only (on CUDA the Triton backend attends)")
        T, Hq, D = q.shape
        _, block_size, Hkv, Dc = k_cache.shape
        if not (q.dtype == k_cache.dtype == out.dtype and q.dtype in _DTYPE_CODES):
            raise ValueError(f"the CPU decode kernel takes float32 or bfloat16 q, out and caches of one dtype, got "
                             f"{q.dtype}, {out.dtype}, {k_cache.dtype}")
        if Dc != D or Hq % Hkv or out.shape != q.shape:
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                             f"caches {tuple(k_cache.shape)}")
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != D:
                raise ValueError(f"{name} must have contiguous heads ([T, Hq, D] with strides (*, D, 1))")
        head = (_DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0))
        shape = (block_size, Hkv, Hq // Hkv, D, *self.table_args)
        tail = (torch.get_num_threads(), T, *self.table_shape, k_cache.shape[0])
        return head, shape, tail

    def run(self, bound: tuple, k_ptr: int, v_ptr: int, scale: float) -> None:
        """The kernel over caches at k_ptr, v_ptr, of the shape ``bind`` checked (the caller's word)."""
        head, shape, tail = bound
        args = (*head, k_ptr, v_ptr, *shape, float(scale), *tail)
        rc = named_call(PROFILER_NAME, self.lib.minillm_decode_attention, *args)  # profile_step's attention
        if rc != 0:
            raise ValueError(f"the CPU decode kernel refused its arguments: {_REFUSALS.get(rc, rc)}")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, rows: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """out[tok] = attention of q[tok] over sequence b's cached keys, for each (b, tok) in ``rows``.

    q, out: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    int32; context_lens [B] int32 (keys of each sequence, this step's included); rows [R, 2]
    int64. All on the CPU, q/out/caches of one dtype (float32 or bfloat16). One call; a step
    that attends in many layers prepares ``DecodeRows`` once instead.
    """
    DecodeRows(block_tables, context_lens, rows)(q, k_cache, v_cache, scale, out)
