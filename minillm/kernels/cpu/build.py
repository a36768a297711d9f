"""The CPU kernels' one library: found compiler, build, cache, ctypes bindings.

The C++ sources (``attention_rows.cpp``, ``layer_ops.cpp`` with ``elements.h``, and
``quant_matmul.cpp``) are compiled on first use with the system's C++ compiler (g++ or c++;
a few seconds) into one shared library in the cache folder (``MINILLM_CACHE``), once per
source, compiler and CPU, each with its own flags, and loaded with ctypes: no build step at
install, no Python headers. ``library()`` hands it out with every C function's argument types
declared; ``attention.py``, ``layer_ops.py`` and ``quant.py`` call into it. Where the build
fails, the engine's default falls back to the torch backend with a warning (``placement``).
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

from minillm import cache

HERE = Path(__file__).parent
# -ffast-math lets the attention loops reassociate and vectorize exp; it is given to the compile only: linked
# with it, the library would switch the whole process to flushing subnormal floats to zero on load.
FLAGS = ["-O3", "-ffast-math", "-fPIC", "-std=c++17"]
# The layer ops round where PyTorch rounds: no fast math, and no products fused into FMAs; the
# two -fno flags change no value (they let floor and division vectorize: no errno, no traps).
LAYER_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=c++17"]
# The quantized matmuls use explicit FMA intrinsics; -ffp-contract=off keeps the compiler from
# fusing anything else, so that every tile size rounds each output the same way.
QUANT_FLAGS = ["-O3", "-ffp-contract=off", "-fPIC", "-std=c++17"]
SOURCES = ((HERE / "attention_rows.cpp", FLAGS), (HERE / "layer_ops.cpp", LAYER_FLAGS),
           (HERE / "quant_matmul.cpp", QUANT_FLAGS))
HEADERS = (HERE / "elements.h",)  # included by attention_rows.cpp and layer_ops.cpp
LIBRARY = "libminillm_cpu.so"
# (compile flags, link flags), tried in order: a compiler without OpenMP (Apple's clang) builds
# kernels that run on the calling thread; one that does not know -march=native, a generic build.
ATTEMPTS = [(["-march=native", "-fopenmp"], ["-fopenmp"]), (["-march=native"], []), ([], [])]
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C functions' dtype argument
DTYPES = tuple(DTYPE_CODES)

_lib = None
_error: str | None = None


def compiler() -> str | None:
    """The C++ compiler the library is built with, or None where there is none."""
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
    out = folder / LIBRARY
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


def _declare(lib) -> None:
    """Every C function's argument and result types (ctypes passes ints and pointers as declared)."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    lib.minillm_attention_rows.argtypes = [i32, ptr, i64, ptr, i64, ptr, ptr, i32, i32, i32, i32, ptr, i64, ptr, ptr,
                                           i32, f32, i32, i64, i64, i64, i64]
    lib.minillm_add_rms_norm.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.minillm_silu_mul.argtypes = [i32, ptr, ptr, i64, i64, i32]
    lib.minillm_rope_write.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32]
    lib.minillm_int8_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i64, i64, i64, i32]
    lib.minillm_q4_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i32, ptr, i64, i64, i64, i32, i32]
    lib.minillm_u8_linear.argtypes = [i32, ptr, ptr, ptr, ptr, i32, ptr, i64, i64, i64, i32, i32]
    for name in ("minillm_attention_rows", "minillm_add_rms_norm", "minillm_silu_mul", "minillm_rope_write",
                 "minillm_int8_linear", "minillm_q4_linear", "minillm_u8_linear"):
        getattr(lib, name).restype = i32


def library():
    """The compiled CPU kernels (a ctypes library), built on first use; RuntimeError with the
    reason where they cannot be built."""
    global _lib, _error
    if _lib is not None:
        return _lib
    if _error is not None:
        raise RuntimeError(_error)
    cxx = compiler()
    if cxx is None:
        _error = ("no C++ compiler (g++ or c++) to build the CPU kernels: install one (apt install g++), "
                  "or pass attention_backend='torch'")
        raise RuntimeError(_error)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    recipe = repr(([(src.name, flags) for src, flags in SOURCES], ATTEMPTS)).encode()
    code = b"".join(f.read_bytes() for f in (*(src for src, _ in SOURCES), *HEADERS))
    key = hashlib.sha256(code + recipe + version.encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    folder = cache.cache_dir() / f"cpu-kernels-{key}"
    errors: list[str] = []

    def write(tmp: Path) -> None:
        try:
            _build(cxx, tmp)
        except RuntimeError as e:
            errors.append(str(e))
            raise OSError(str(e)) from e

    try:
        if not cache.cached_folder(folder, write, ", ".join(src.name for src, _ in SOURCES)):
            if errors:
                raise RuntimeError(errors[0])
            folder = Path(tempfile.mkdtemp(prefix="minillm-cpu-kernels-"))  # the cache cannot be written
            _build(cxx, folder)
        lib = ctypes.CDLL(str(folder / LIBRARY))
    except (RuntimeError, OSError) as e:
        _error = f"{e}\n(or pass attention_backend='torch')"
        raise RuntimeError(_error) from e
    _declare(lib)
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
