"""minillm's kernels: Triton kernels for CUDA, their warm-up, and the CPU backend's C++.

Triton kernels, one per file, each read top to bottom as a small lesson: what it
computes, the @triton.jit kernel, a host wrapper that validates its inputs, a
plain-PyTorch oracle (``*_ref``) the tests compare it with, and a ``bench()`` helper.

    rmsnorm.py                   rms_norm, fused_add_rms_norm (residual add + RMSNorm)
    store_kv.py                  store_kv: write a step's K/V into the paged cache
    paged_decode_attention.py    paged_decode_attention: one query per sequence, split-K;
                                 paged_attention_ref, the one oracle of paged attention
    paged_prefill_attention.py   paged_prefill_attention: many queries per sequence, causal
    quant_gemv.py                u8_gemv, q4_gemv: x @ w.T with w in 8-bit / 4-bit groups
                                 (minillm.quantization's int8_group, q4_group), dequantized in the kernel
    _common.py                   HAS_TRITON, the target GPUs (GpuSpec, A100, H100), input checks

Triton is optional: without it (or without a GPU, unless TRITON_INTERPRET=1 is set) the
``*_ref`` oracles still import and run, while the Triton wrappers raise a clear error.

    warmup.py   ``warmup(model_config, dtype, block_size, device)`` makes every kernel
                launch an engine can make once before serving, so that Triton compiles
                each variant up front and none in a request (a no-op off CUDA);
                ``quantization="int8" | "q4"`` adds the quantized GEMVs

    cpu/        the ``cpu`` backend: attention rows and the elementwise layer ops in C++,
                their build (with the system's C++ compiler, on first use, cached) and
                ctypes bindings. Not imported here; import it from ``minillm.kernels.cpu``.

The ahead-of-time audit -- every variant compiled for sm_80 and sm_90 on a machine
without a GPU, checked for shared memory and register spills -- is a developer tool
outside the package: ``python tools/aot_audit.py``.

Below the model in the layers: this package imports no module of minillm but the leaf
``minillm.cache`` (where ``cpu/`` caches its build).
"""

from ._common import A100, H100, HAS_TRITON, GpuSpec
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .store_kv import store_kv, store_kv_ref
from .paged_decode_attention import paged_attention_ref, paged_decode_attention, paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from .quant_gemv import q4_gemv, q4_gemv_ref, u8_gemv, u8_gemv_ref
from .warmup import warmup  # the function: minillm.kernels.warmup is the function from here on

__all__ = [
    "HAS_TRITON",
    "GpuSpec",
    "A100",
    "H100",
    "warmup",
    "rms_norm",
    "rms_norm_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "store_kv",
    "store_kv_ref",
    "paged_attention_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "u8_gemv",
    "u8_gemv_ref",
    "q4_gemv",
    "q4_gemv_ref",
]
