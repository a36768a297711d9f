"""Triton kernels for minillm.

Each kernel lives in its own file and reads top to bottom as a small lesson:
what it computes, the Triton kernel, a host wrapper that validates inputs, a
plain-PyTorch oracle (``*_ref``) used by the tests, and a ``bench()`` helper.

Triton is optional: without it (or without a GPU, unless TRITON_INTERPRET=1 is
set) the ``*_ref`` oracles still import and run, while the Triton wrappers
raise a clear error when called.

``minillm.kernels.aot`` compiles every kernel, in every launch configuration the engine
reaches, for sm_80 and sm_90 without a GPU (``python -m minillm.kernels.aot``), and
``warmup(model_config, dtype, block_size, device)`` compiles those variants on a
GPU before serving (a no-op elsewhere).

One kernel is not Triton: ``cpu_attention`` is the CPU's decode attention in C++ (the
``cpu`` attention backend), compiled on first use with the system's C++ compiler.
"""

from ._common import A100, H100, HAS_TRITON, GpuSpec
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .store_kv import store_kv, store_kv_ref
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref


def warmup(model_config, dtype, block_size: int, device, **options) -> int:
    """Compile every kernel variant an engine can reach before serving; 0 and a no-op off CUDA.

    warmup(model_config, dtype, block_size, device, *, max_num_seqs=256,
           max_model_len=None, progress=True) -> number of variants launched

    See minillm.kernels.aot.warmup for the arguments. (Imported lazily, so that
    ``python -m minillm.kernels.aot`` does not find minillm.kernels.aot imported already.)
    """
    from .aot import warmup as _warmup

    return _warmup(model_config, dtype, block_size, device, **options)


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
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
]
