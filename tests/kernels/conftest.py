"""Shared setup for the kernel tests.

Two markers:
  interpreter  small cases. Without a GPU they run through the Triton
               interpreter on CPU (TRITON_INTERPRET=1); on a GPU machine the
               same cases run compiled on the GPU.
  gpu          compiled kernels on CUDA with larger shapes and bf16/fp16;
               skipped when no GPU is present.

Triton decides between compiling and interpreting when a kernel is *defined*
(at @triton.jit time), so the environment variable must be set before the
kernels package is imported. This conftest is imported before the test
modules of this folder, which is early enough unless something imported
triton before (then the Triton tests are skipped with an explanation; set
TRITON_INTERPRET=1 in the environment or in a top-level conftest instead).
"""

import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
_HERE = os.path.dirname(os.path.abspath(__file__))

# The AOT audit is a developer tool outside the package (tools/aot_audit.py and its
# aot_capture.py): test_aot.py imports its helpers from there.
TOOLS = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)


def _interpreter_ready() -> bool:
    """True if triton and the kernels were imported after TRITON_INTERPRET=1 was set.

    Triton picks compiled vs interpreted mode when each @triton.jit function is
    defined, including triton's own helpers (tl.cdiv, ...) defined when triton
    is first imported; a late environment variable cannot fix that.
    """
    import triton.language as tl

    from minillm.kernels import rmsnorm

    return all(type(f).__name__ == "InterpretedFunction" for f in (tl.cdiv, rmsnorm._rms_norm_kernel))


def pytest_configure(config):
    config.addinivalue_line("markers", "interpreter: small Triton kernel cases (CPU interpreter when no GPU)")
    config.addinivalue_line("markers", "gpu: compiled Triton kernels on CUDA; skipped without a GPU")


def pytest_collection_modifyitems(config, items):
    try:
        import triton  # noqa: F401

        has_triton = True
    except ImportError:
        has_triton = False
    skip_no_triton = pytest.mark.skip(reason="triton is not installed")
    skip_no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (and TRITON_INTERPRET unset)")
    skip_late_env = pytest.mark.skip(
        reason="triton was imported before TRITON_INTERPRET=1 was set; export TRITON_INTERPRET=1 first"
    )
    late = has_triton and INTERPRET and any(str(i.path).startswith(_HERE) for i in items) and not _interpreter_ready()
    for item in items:
        if not str(item.path).startswith(_HERE):
            continue  # conftest hooks see the whole session; only handle this folder
        if "interpreter" in item.keywords or "gpu" in item.keywords:
            if not has_triton:
                item.add_marker(skip_no_triton)
            elif "gpu" in item.keywords and (INTERPRET or not torch.cuda.is_available()):
                item.add_marker(skip_no_gpu)
            elif late:
                item.add_marker(skip_late_env)


@pytest.fixture
def device() -> str:
    return DEVICE


def tolerances(dtype: torch.dtype) -> dict:
    """atol/rtol for comparing a kernel against its fp32 oracle."""
    return {
        torch.float32: dict(atol=2e-4, rtol=2e-4),
        torch.float16: dict(atol=1e-2, rtol=1e-2),
        torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    }[dtype]


@pytest.fixture
def tol():
    return tolerances


def make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype, device,
                  extra_blocks=3, spare_table_cols=2, seed=0):
    """Build a paged KV cache holding one dense K/V per sequence.

    Physical blocks are handed out in a random order, the cache outside the
    stored tokens is filled with NaN (so any read of a slot that should be
    masked poisons the result), and unused block-table entries hold -1.

    Returns (k_cache, v_cache, block_tables[int32], dense) where dense[b] is
    (K_b, V_b), each [seq_lens[b], Hkv, D].
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    max_blocks = max(blocks_per_seq + [1]) + spare_table_cols
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    dense = []
    next_free = 0
    for b, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        for i in range(blocks_per_seq[b]):
            phys = int(perm[next_free])
            next_free += 1
            block_tables[b, i] = phys
            chunk = slice(i * block_size, min((i + 1) * block_size, n))
            rows = chunk.stop - chunk.start
            k_cache[phys, :rows] = k[chunk]
            v_cache[phys, :rows] = v[chunk]
        dense.append((k.to(device), v.to(device)))
    return k_cache.to(device), v_cache.to(device), block_tables.to(device), dense


@pytest.fixture
def paged_kv():
    return make_paged_kv
