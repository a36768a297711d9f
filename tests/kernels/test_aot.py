"""The AOT compile tier (marker ``aot``): every Triton kernel, in every launch
configuration the engine and the kernel tests reach, compiled for sm_80 (A100)
and sm_90 (H100/H200) on a machine without a GPU.

Checked per kernel, dtype and target: it compiles; its shared memory fits the
target's per-block limit; ptxas reports no register spills. Also: every
@triton.jit kernel of minillm.kernels is reached by some launch, a serving process
can only ever compile a few variants of each, and minillm.kernels.warmup's launches
reach every variant that serving at other batches and table widths needs -- for a
quantized model (warmup's quantization="int8" | "q4") its GEMVs' too.

The audit is a developer tool outside the package, tools/aot_audit.py (conftest.py puts
tools/ on sys.path for the imports below). ``python tools/aot_audit.py`` does the capture
and the compiles in a subprocess, once for this module (about 1.5 minutes on 2 cores):
this process imported triton with TRITON_INTERPRET=1 (see conftest.py), which makes
@triton.jit return interpreter objects that nothing can compile, and the interpreter
tests need it to stay that way. The subprocess never sees a GPU either way: it fakes
the driver.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from minillm.kernels import HAS_TRITON

pytestmark = [pytest.mark.aot, pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")]

ROOT = Path(__file__).resolve().parents[2]
AUDIT = ROOT / "tools" / "aot_audit.py"
CASES = Path(__file__).resolve().with_name("kernel_cases.py")
FLOAT_KERNELS = ["_rms_norm_kernel", "_store_kv_kernel", "_paged_decode_kernel", "_reduce_splits_kernel",
                 "_paged_prefill_kernel"]  # what a float model's engine launches
QUANT_KERNELS = ["_quant_gemv_kernel"]  # and a quantized model's projections and head, besides
KERNELS = FLOAT_KERNELS + QUANT_KERNELS
QUANTIZATIONS = ["int8", "q4"]
DTYPES = ["bf16", "fp16", "fp32"]
TARGETS = ["sm_80", "sm_90"]
SMOLLM2 = SimpleNamespace(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("aot") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(AUDIT), "--extra", str(CASES), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        pytest.fail(f"{' '.join(cmd)} crashed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    rep = json.loads(out.read_text())
    rep["table"] = proc.stdout
    return rep


def _explain(rows) -> str:
    from aot_audit import CompileResult

    return "\n".join(f"{r['kernel']} {r['dtype']} {r['target']} [{r['config']}] <- {r['launches'][:1]}: "
                     f"{'; '.join(CompileResult(**r).problems())}" for r in rows)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_fits_and_does_not_spill(report, kernel, dtype, target):
    from aot_audit import CompileResult

    rows = [r for r in report["results"] if (r["kernel"], r["dtype"], r["target"]) == (kernel, dtype, target)]
    assert rows, f"no launch configuration reaches {kernel} in {dtype} on {target}"
    bad = [r for r in rows if CompileResult(**r).problems()]
    assert not bad, f"{len(bad)} of {len(rows)} variants fail:\n{_explain(bad)}"


def test_every_jit_kernel_is_compiled(report):
    assert set(report["kernels"]) >= {f"{m}.{k}" for m, k in [
        ("rmsnorm", "_rms_norm_kernel"), ("store_kv", "_store_kv_kernel"),
        ("paged_decode_attention", "_paged_decode_kernel"), ("paged_decode_attention", "_reduce_splits_kernel"),
        ("paged_prefill_attention", "_paged_prefill_kernel"), ("quant_gemv", "_quant_gemv_kernel")]}
    never = sorted(set(report["kernels"]) - set(report["compiled"]))
    assert not never, f"@triton.jit kernels no launch configuration reaches (add a case): {never}"


def test_wrappers_accept_every_launch(report):
    assert not report["wrapper_errors"], "\n".join(report["wrapper_errors"][:10])


@pytest.mark.parametrize("dtype", DTYPES)
def test_reachable_variants_are_few(report, dtype):
    """All batch sizes up to 256, all block-table widths, block sizes 8/16/32 and the
    contiguous engines' 8192: a handful of binaries per kernel, known up front."""
    from aot_audit import MAX_VARIANTS_PER_KERNEL

    for bs in ["8", "16", "32", "8192", None]:
        counts = report["reachable"][f"{dtype}/{'any bs' if bs is None else f'bs={bs}'}"]
        assert set(counts) == set(FLOAT_KERNELS), counts  # a float model: no quantized GEMV
        assert max(counts.values()) <= MAX_VARIANTS_PER_KERNEL, counts
        # What the attention kernels' docstrings promise: one binary each per model and dtype,
        # and for prefill a second one with the candidate-tree mask (warmup's "prefill tree").
        assert counts["_paged_decode_kernel"] == counts["_reduce_splits_kernel"] == 1, counts
        assert counts["_store_kv_kernel"] == 1, counts
        assert counts["_paged_prefill_kernel"] == 2, counts


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantized_gemv_variants_are_few(report, dtype):
    """What kernels/quant_gemv.py's docstring promises: per format, one binary for the
    decode tile and one for the prefill tile, whatever the rows. int8: every projection and
    the head in int8_group; q4: the projections in q4_group, the head in int8_group."""
    from aot_audit import MAX_VARIANTS_PER_KERNEL

    for q, expected in zip(QUANTIZATIONS, (2, 4)):
        counts = report["reachable"][f"{dtype}/{q}"]
        assert set(counts) == set(QUANT_KERNELS), counts
        assert counts["_quant_gemv_kernel"] == expected <= MAX_VARIANTS_PER_KERNEL, counts


def test_warmup_covers_other_batches_and_widths(report):
    """warmup() makes engine_launches(), which sweep batch and table width one at a time:
    launches crossing batch, width and prompt length must reach no variant it missed."""
    checked_per_dtype = 4 + len(QUANTIZATIONS)  # block sizes 8, 16, 32 and one of 8192; int8, q4
    assert len(report["warmup_checked"]) == len(TARGETS) * len(DTYPES) * checked_per_dtype, report["warmup_checked"]
    assert not report["warmup_misses"], "\n".join(report["warmup_misses"][:10])


def test_capture_restores_what_it_patched(report):
    assert report["restored"]


def test_table_lists_every_kernel_dtype_target(report):
    for kernel in KERNELS:
        for dtype in DTYPES:
            for target in TARGETS:
                assert any(line.split()[:3] == [kernel, dtype, target] for line in report["table"].splitlines())


# ----------------------------------------------------------------------------
# The compile helper itself, on a deliberately broken kernel, in a fresh process
# ----------------------------------------------------------------------------

# Run with TRITON_INTERPRET=1, so @triton.jit returns interpreter objects (compile_kernel
# rebuilds the JITFunction). A fresh process, because this one may already have run a
# kernel with a @triton.jit helper in the interpreter, which leaves triton.language
# patched: the last case shows that compile_kernel says so instead of blaming the kernel.
_BROKEN_KERNEL_SCRIPT = """
import json, sys
import torch
import triton
import triton.language as tl
from aot_audit import A100, compile_kernel

@triton.jit
def _tiny_dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tile = i[:, None] * BLOCK + i[None, :]  # [BLOCK, BLOCK] row-major offsets
    a = tl.load(a_ptr + tile)
    b = tl.load(b_ptr + tile)
    tl.store(c_ptr + tile, tl.dot(a, b))  # fp16 x fp32 has no MMA: the compiler must refuse

def compile_with(b_type):
    sig = {"a_ptr": "*fp16", "b_ptr": b_type, "c_ptr": "*fp32", "BLOCK": "constexpr"}
    res = compile_kernel(_tiny_dot_kernel, sig, {"BLOCK": 16}, gpu=A100)
    return dict(res.__dict__, problems=res.problems())

out = {"fp16xfp16": compile_with("*fp16"), "fp16xfp32": compile_with("*fp32")}
from minillm.kernels import rms_norm
rms_norm(torch.randn(2, 64), torch.ones(64), 1e-5)  # its @triton.jit helper leaves tl patched
out["after_interpreter"] = compile_with("*fp16")
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def broken_kernel_results(tmp_path_factory) -> dict:
    script = tmp_path_factory.mktemp("broken") / "broken_kernel.py"  # @triton.jit needs a source file
    script.write_text(_BROKEN_KERNEL_SCRIPT)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def test_compile_helper_compiles_a_good_kernel(broken_kernel_results):
    res = broken_kernel_results["fp16xfp16"]
    assert res["ok"] and res["registers"] is not None and not res["problems"], res


def test_compile_helper_reports_a_broken_kernel(broken_kernel_results):
    res = broken_kernel_results["fp16xfp32"]
    assert not res["ok"] and "dtype" in res["error"], res
    assert res["problems"] == [f"does not compile: {res['error']}"], res


def test_compile_helper_refuses_after_the_interpreter_patched_triton(broken_kernel_results):
    res = broken_kernel_results["after_interpreter"]
    assert not res["ok"] and "interpreter left triton.language patched" in res["error"], res


def test_warmup_is_a_noop_off_cuda():
    from minillm.kernels import warmup

    assert warmup(SMOLLM2, torch.bfloat16, 16, "cpu") == 0
    assert warmup(SMOLLM2, "float32", 8192, torch.device("cpu"), progress=False) == 0


@pytest.mark.gpu
def test_warmup_leaves_nothing_to_compile_while_serving():
    """After warmup, engine-like launches of any batch and table width hit the JIT cache."""
    from minillm.kernels import paged_decode_attention, paged_prefill_attention, store_kv, warmup
    from aot_capture import find_jit_kernels

    model, dtype, bs = SMOLLM2, torch.bfloat16, 16
    assert warmup(model, dtype, bs, "cuda", max_num_seqs=64, progress=False) >= 5

    def cached() -> int:
        return sum(len(caches[0]) for fn in find_jit_kernels().values() for caches in fn.device_caches.values())

    before = cached()
    Hq, Hkv, D = 9, 3, 64
    kc = torch.zeros(64, bs, Hkv, D, device="cuda", dtype=dtype)
    vc = torch.zeros_like(kc)
    for B, width in [(1, 1), (1, 300), (7, 16), (64, 33), (33, 512)]:
        q = torch.randn(B, Hq, D, device="cuda", dtype=dtype)
        tables = torch.zeros(B, width, dtype=torch.int32, device="cuda")
        ctx = torch.full((B,), min(width * bs, 8000), dtype=torch.int32, device="cuda")
        paged_decode_attention(q, kc, vc, tables, ctx, D ** -0.5)
        qsl = torch.arange(B + 1, dtype=torch.int32, device="cuda")
        paged_prefill_attention(q, kc, vc, tables, qsl, ctx, D ** -0.5, max_query_len=1)
        # Candidate trees: nothing masked (tree_start past each position), the tree variant all the same.
        paged_prefill_attention(q, kc, vc, tables, qsl, ctx, D ** -0.5, max_query_len=1, tree_start=ctx.clone(),
                                tree_bits=torch.zeros(B, dtype=torch.int64, device="cuda"))
        qkv = torch.zeros(B, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype)
        k = torch.zeros(B, Hkv, D, device="cuda", dtype=dtype)
        store_kv(k, qkv[:, (Hq + Hkv) * D:].view(B, Hkv, D), kc, vc, torch.zeros(B, dtype=torch.long, device="cuda"))
    torch.cuda.synchronize()
    assert cached() == before, "a launch compiled a variant warmup did not"
