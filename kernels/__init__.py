"""Triton kernels for minillm.

Each kernel lives in its own file and reads top to bottom as a small lesson:
what it computes, the Triton kernel, a host wrapper that validates inputs, a
plain-PyTorch oracle (``*_ref``) used by the tests, and a ``bench()`` helper.

Triton is optional: without it (or without a GPU, unless TRITON_INTERPRET=1 is
set) the ``*_ref`` oracles still import and run, while the Triton wrappers
raise a clear error when called.
"""

from ._common import HAS_TRITON
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .store_kv import store_kv, store_kv_ref
from .paged_decode_attention import paged_decode_attention, paged_decode_attention_ref
from .paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref

__all__ = [
    "HAS_TRITON",
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
