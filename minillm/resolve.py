"""An ``EngineConfig`` resolved for a model on this machine: ``resolve(config, model_config)``.

``config.py`` validates options as plain values; what depends on the hardware is decided
here, one layer up, where the device, the kernels and the model can be asked: the placement
(device, dtype, attention backend), whether the linears are packed for oneDNN, whether the
step can be compiled, and how many KV blocks fit the budget. ``build_engine``, the benchmark
and the simulator all call this one function, so they cannot disagree on a default.
"""
from __future__ import annotations

from typing import Any

import torch

from . import placement
from .block_manager import num_blocks_from_budget
from .compiled import check_compile
from .config import EngineConfig, ModelConfig, ResolvedConfig
from .model import can_pack_weights, packs_by_default
from .quantization import CPU_ACTIVATIONS


def resolve(config: EngineConfig, model_config: ModelConfig) -> ResolvedConfig:
    """Fill in ``config``'s defaults for ``model_config``; raise ValueError if it cannot run."""
    place = placement.resolve(config.device, config.dtype, config.attention_backend)
    if config.cuda_graphs and place.device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, but this engine runs on {place.device}: "
                         "pass device='cuda' on a GPU machine, or cuda_graphs=False")
    if config.cuda_graphs and place.attention_backend != "triton":
        raise ValueError(f"cuda_graphs=True needs attention_backend='triton' (the torch backend plans each step "
                         f"on the host, which a graph cannot replay), got {place.attention_backend!r}")
    _check_quantization(config, place)
    pack = False if config.quantization else _resolve_pack_weights(config.pack_weights, place)
    if config.compile:
        check_compile(place.device, place.attention_backend)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(f"max_model_len must be at most the model's context length "
                         f"{model_config.max_position_embeddings}, got {max_model_len}")
    seqs = 1 if config.engine == "simple" else config.max_num_seqs
    budget = config.max_num_batched_tokens or max(max_model_len, config.max_num_seqs)
    kv_bytes = model_config.kv_bytes_per_token(place.dtype.itemsize)
    if config.engine == "paged":
        # Size the cache in blocks from whichever budget was given (default: the bytes
        # the contiguous engine reserves).
        block_size = config.block_size
        num_blocks = num_blocks_from_budget(
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
            kv_bytes_per_token=kv_bytes, num_blocks=config.num_blocks, kv_cache_bytes=config.kv_cache_bytes)
    else:
        block_size, num_blocks = max_model_len, seqs
    return ResolvedConfig(config.engine, max_model_len, seqs, budget, block_size, num_blocks, kv_bytes, place, pack,
                          config.compile, config.quantization)


def _check_quantization(config: EngineConfig, place: Any) -> None:
    """Quantized weights run in the CPU kernels (kernels/cpu/quant_matmul.cpp) with float32 or
    bfloat16 activations, or on CUDA in the Triton kernels (kernels/quant_gemv.py) with the
    engine's dtype. A draft quantized alone runs on the CPU only."""
    spec = config.speculative
    for q, what in ((config.quantization, "quantization"),
                    (spec.quantization if spec is not None else None, "speculative quantization")):
        if q is None:
            continue
        if place.device.type == "cuda" and what == "quantization":
            from .kernels import HAS_TRITON

            if not HAS_TRITON:
                raise ValueError(f"quantization={q!r} on CUDA runs Triton kernels, and triton is not installed: "
                                 f"pip install triton, or pass device='cpu'")
            continue
        if place.device.type != "cpu":
            raise ValueError(f"{what}={q!r} runs on the CPU kernels; this engine runs on {place.device}"
                             + (" (on CUDA, quantize the target with quantization=...; a self-draft shares its "
                                "layers)" if place.device.type == "cuda" else "")
                             + f": pass device='cpu' or {what}=None")
        if place.dtype not in CPU_ACTIVATIONS:
            raise ValueError(f"{what}={q!r} on the CPU takes float32 or bfloat16 activations; got dtype "
                             f"{place.dtype}: pass dtype='float32' (or None) or 'bfloat16'")
        from .kernels.cpu import build

        try:
            build.library()
        except RuntimeError as e:
            raise ValueError(f"{what}={q!r} needs the CPU kernels, which could not be built: {e}") from None
    q = config.quantization
    if q is not None and config.pack_weights:
        raise ValueError(f"pack_weights=True lays out float weights for oneDNN; quantization={q!r} replaces them: "
                         f"pass pack_weights=None or False")
    if q is not None and config.compile:
        raise ValueError(f"compile=True traces the float model's forward; quantization={q!r} runs its own kernels "
                         f"eagerly: pass one or the other")


def _resolve_pack_weights(option: bool | None, place: Any) -> bool:
    """None: packed where it was measured to pay, float32 on an x86 CPU; True: packed or a ValueError."""
    if option is False:
        return False
    if place.device.type != "cpu":
        if option:
            raise ValueError(f"pack_weights=True lays weights out for oneDNN on the CPU, but this engine runs on "
                             f"{place.device}: pass pack_weights=None or False")
        return False
    if option is None:
        return packs_by_default(place.dtype)
    if not can_pack_weights(place.dtype):
        raise ValueError(f"pack_weights=True: this torch build or CPU cannot run oneDNN's packed linear in "
                         f"{place.dtype}; pass pack_weights=None or False")
    return True
