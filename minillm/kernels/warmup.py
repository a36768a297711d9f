"""Warm-up: compile every Triton kernel variant an engine can reach before it serves.

Why
---
Triton compiles a kernel on its first launch with a new *specialisation*: pointer
dtypes, the constexprs, num_warps/num_stages, and for each integer argument whether it
equals 1 or is divisible by 16. A compile takes seconds. Left to the JIT, it lands in
whichever step first meets a new batch size or block-table width -- inside a timed run
or a user's request.

How
---
``engine_launches`` lists the wrapper calls a minillm engine can make for one model,
dtype and KV block size: from step to step only the batch (B sequences, T tokens) and
the block-table width change, and the list sweeps each of them over its whole range
(about 3.3k calls at block size 8 and 8192 positions, 1.8k at block size 16).
``warmup`` makes every one of those calls once on the GPU, on tiny inputs. The JIT
compiles (or loads from its disk cache) each distinct variant on the first call that
reaches it; the other calls find it in the cache and only launch it (microseconds).
Afterwards no step of that engine compiles anything.

Off CUDA (the CPU backend, the interpreter, no Triton) ``warmup`` does nothing.

Quantized weights: ``warmup(..., quantization="int8" | "q4")`` also makes the quantized
GEMV launches (kernels/quant_gemv.py) of every projection and of the LM head; without it
(the default, a float model) nothing of them is made. minillm's engine runs quantized
models on the CPU kernels today (``resolve`` refuses them on CUDA), so it never passes it:
the option is there for when the GPU path is wired in, as the rms_norm kernel is covered
before the model calls it.

The ahead-of-time audit lives outside the package, in ``tools/aot_audit.py``: on a
machine without a GPU it records which variants these same launches reach on sm_80 and
sm_90 (a handful per kernel, whatever the batch or the context) and compiles each to
check that it fits and does not spill.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from . import _common
from ._common import HAS_TRITON, GpuSpec
from .paged_decode_attention import paged_decode_attention
from .paged_prefill_attention import paged_prefill_attention
from .quant_gemv import DECODE_MAX_M, q4_gemv, u8_gemv
from .rmsnorm import fused_add_rms_norm, rms_norm
from .store_kv import store_kv

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# LLM(quantization=...)'s schemes and the format of their projections, as in
# minillm.quantization (LAYER_FORMAT; not imported: it sits above the kernels). The LM
# head is int8_group (symmetric) in both; groups of 32 columns.
QUANTIZATIONS = ("int8", "q4")
QUANT_LAYER_FORMAT = {"int8": "int8_group", "q4": "q4_group"}
QUANT_GROUP_SIZE = 32


def dtype_name(dtype: torch.dtype | str) -> str:
    """"bf16" / "fp16" / "fp32" for a torch dtype or a name such as "bfloat16"."""
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
    intermediate_size: int | None = None  # the MLP's width; only the quantized launches use it
    vocab_size: int | None = None  # rows of the LM head; likewise

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
            intermediate_size=_int_or_none(getattr(cfg, "intermediate_size", None)),
            vocab_size=_int_or_none(getattr(cfg, "vocab_size", None)),
        )


def _int_or_none(v) -> int | None:
    return None if v is None else int(v)


# ----------------------------------------------------------------------------
# Launches: one wrapper call each, with tensors built on any device
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One call of a host wrapper. ``run(device)`` builds the inputs on ``device``
    (CUDA in warmup; CPU while tools/aot_audit.py records launches) and calls the wrapper."""

    label: str
    dtype: torch.dtype
    run: Callable[[torch.device], object] = field(compare=False, repr=False)


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
    CPU (the audit launches nothing, and the sweep makes thousands of them), set on a GPU."""
    if device.type == "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.full(shape, value, dtype=dtype, device=device)


def _engine_cache(m: ModelShape, block_size: int, dtype, device):
    # One physical block is enough: every block-table entry may point at it.
    shape = (1, block_size, m.num_kv_heads, m.head_dim)
    return _filled(shape, 0, dtype, device), _filled(shape, 0, dtype, device)


def run_store_kv(m: ModelShape, block_size: int, dtype, T: int, device):
    """store_kv of T tokens, as the engine calls it."""
    _, k, v = _engine_qkv(m, T, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    slots = _filled((T,), 0, torch.int64, device)  # build_batch: int64
    return store_kv(k, v, kc, vc, slots)


def run_rms_norm(m: ModelShape, dtype, T: int, fused: bool, device):
    """rms_norm (or fused_add_rms_norm) of T tokens."""
    x = _filled((T, m.hidden_size), 1, dtype, device)
    w = _filled((m.hidden_size,), 1, dtype, device)
    if fused:
        return fused_add_rms_norm(x, _filled((T, m.hidden_size), 1, dtype, device), w, 1e-5)
    return rms_norm(x, w, 1e-5)


def run_decode(m: ModelShape, block_size: int, dtype, B: int, width: int, device, num_splits=None):
    """Decode attention of B sequences through a [B, width] block table."""
    q, _, _ = _engine_qkv(m, B, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    tables = _filled((B, width), 0, torch.int32, device)  # build_batch: [B, width] int32
    ctx = _filled((B,), 1, torch.int32, device)
    return paged_decode_attention(q, kc, vc, tables, ctx, m.head_dim ** -0.5, num_splits=num_splits)


def run_prefill(m: ModelShape, block_size: int, dtype, B: int, width: int, q_len: int, device):
    """Prefill attention of B sequences of q_len new tokens each through a [B, width] table."""
    q, _, _ = _engine_qkv(m, B * q_len, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    tables = _filled((B, width), 0, torch.int32, device)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=device)  # [B+1]
    ctx = _filled((B,), q_len, torch.int32, device)
    return paged_prefill_attention(q, kc, vc, tables, qsl, ctx, m.head_dim ** -0.5, max_query_len=q_len)


def run_prefill_tree(m: ModelShape, block_size: int, dtype, B: int, width: int, q_len: int, device):
    """run_prefill with candidate trees (tree_start/tree_bits, the kernel's HAS_TREE variant):
    each sequence a root at position 0 and q_len - 1 nodes that see every earlier node."""
    q, _, _ = _engine_qkv(m, B * q_len, dtype, device)
    kc, vc = _engine_cache(m, block_size, dtype, device)
    tables = _filled((B, width), 0, torch.int32, device)
    qsl = torch.arange(0, (B + 1) * q_len, q_len, dtype=torch.int32, device=device)  # [B+1]
    ctx = _filled((B,), q_len, torch.int32, device)
    tree_start = _filled((B * q_len,), 1, torch.int32, device)  # [T] the root's position + 1
    tree_bits = _filled((B * q_len,), -1, torch.int64, device)  # [T] every node of the tree
    return paged_prefill_attention(q, kc, vc, tables, qsl, ctx, m.head_dim ** -0.5, max_query_len=q_len,
                                   tree_start=tree_start, tree_bits=tree_bits)


def run_quant_gemv(fmt: str, dtype, M: int, N: int, K: int, device):
    """u8_gemv (``fmt`` "int8_group") or q4_gemv ("q4_group") of M rows through an [N, K]
    weight in groups of QUANT_GROUP_SIZE columns."""
    G = QUANT_GROUP_SIZE
    x = _filled((M, K), 1, dtype, device)
    codes = _filled((N, K if fmt == "int8_group" else K // 2), 0, torch.uint8, device)
    scales = _filled((N, K // G), 1, torch.float32, device)
    mins = _filled((N, K // G), 0, torch.float32, device)
    return (u8_gemv if fmt == "int8_group" else q4_gemv)(x, codes, scales, mins, G)


def quant_layers(model, quantization: str) -> list[tuple[str, str, int, int]]:
    """(name, format, N, K) of every quantized matmul of a layer and of the LM head in a
    scheme of QUANTIZATIONS. Without intermediate_size or vocab_size the MLP is left out
    and the head stands in at hidden_size rows: the same variants (N is a runtime integer)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, "
                         f"got {quantization!r}")
    m = ModelShape.of(model)
    fmt = QUANT_LAYER_FORMAT[quantization]
    d, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    layers = [("qkv_proj", fmt, q + 2 * kv, d), ("o_proj", fmt, d, q)]
    if m.intermediate_size:
        layers += [("gate_up_proj", fmt, 2 * m.intermediate_size, d), ("down_proj", fmt, d, m.intermediate_size)]
    layers.append(("lm_head", "int8_group", m.vocab_size or d, d))
    return layers


def quant_launches(model, dtype: torch.dtype, quantization: str, *, max_num_seqs: int = 256,
                   rows: tuple[int, ...] | None = None) -> list[Launch]:
    """The quantized GEMVs an engine makes for this model in ``quantization`` ("int8" or
    "q4"): every layer of quant_layers() at one row (a decode step: the decode tile), at
    DECODE_MAX_M + 1 rows and at max_num_seqs rows (the prefill tile). The tile is all that
    the row count decides, so these reach every variant any step reaches (2 per format).
    ``rows`` replaces those row counts (tools/aot_audit.py checks others reach nothing new)."""
    m = ModelShape.of(model)
    rows = rows or tuple(sorted({1, DECODE_MAX_M + 1, max(1, max_num_seqs)}))
    return [Launch(f"{name} {fmt} M={M} N={N} K={K}", dtype, partial(run_quant_gemv, fmt, dtype, M, N, K))
            for name, fmt, N, K in quant_layers(m, quantization) for M in rows]


def engine_launches(model, dtype: torch.dtype, block_size: int, gpu: GpuSpec | None = None, *,
                    max_num_seqs: int = 256, max_model_len: int | None = None,
                    quantization: str | None = None) -> list[Launch]:
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
    count the heuristic can choose). That is ~3.3k wrapper calls at block size 8
    and max_model_len 8192.

    The prefill kernel has a second variant for candidate trees (speculative
    verification of Medusa trees: tree_start/tree_bits); two "prefill tree"
    launches compile it.

    ``gpu`` is not used (the wrappers plan for the device they run on); it is accepted
    so that callers can say which GPU the list is meant for.

    ``quantization`` ("int8" or "q4"; default None, a float model: nothing added) appends
    quant_launches(): the quantized GEMVs of the projections and the LM head.
    """
    m = ModelShape.of(model)
    max_len = max_model_len or m.max_model_len
    max_blocks = max(1, -(-max_len // block_size))
    out = []
    for T in sorted({1, 17, max_num_seqs}):
        out.append(Launch(f"store_kv T={T}", dtype, partial(run_store_kv, m, block_size, dtype, T)))
    # minillm.model normalises with torch today; the kernel is covered for when it is wired in.
    for fused in (False, True):
        name = "fused_add_rms_norm" if fused else "rms_norm"
        for T in (1, 17):
            out.append(Launch(f"{name} T={T}", dtype, partial(run_rms_norm, m, dtype, T, fused)))
    decode = [(1, w) for w in range(1, max_blocks + 1)]
    decode += [(B, max_blocks) for B in range(2, max_num_seqs + 1)]
    decode += [(max_num_seqs, w) for w in range(1, max_blocks)]
    for B, width in decode:
        out.append(Launch(f"decode B={B} width={width} bs={block_size}", dtype,
                          partial(run_decode, m, block_size, dtype, B, width)))
    prefill = [(1, 1, w) for w in range(1, max_blocks + 1)]
    prefill += [(3, 7, max_blocks), (max_num_seqs, 2, max_blocks)]  # chunks, speculative verification
    for B, q_len, width in prefill:
        out.append(Launch(f"prefill B={B} q_len={q_len} width={width} bs={block_size}", dtype,
                          partial(run_prefill, m, block_size, dtype, B, width, q_len)))
    # Candidate-tree verification (Medusa): the prefill kernel's tree variant. Like the plain
    # one it specialises on neither batch nor width; one binary whatever the tree.
    for B, q_len, width in [(1, 8, 1), (4, 8, max_blocks)]:
        out.append(Launch(f"prefill tree B={B} q_len={q_len} width={width} bs={block_size}", dtype,
                          partial(run_prefill_tree, m, block_size, dtype, B, width, q_len)))
    if quantization is not None:
        out += quant_launches(m, dtype, quantization, max_num_seqs=max_num_seqs)
    return out


# ----------------------------------------------------------------------------
# Warm-up on a real GPU
# ----------------------------------------------------------------------------


def warmup(model_config, dtype, block_size: int, device, *, max_num_seqs: int = 256,
           max_model_len: int | None = None, progress: bool = True, quantization: str | None = None) -> int:
    """Compile every kernel variant an engine can reach, so none compiles while serving.

    warmup(model_config, dtype, block_size, device, *, max_num_seqs=256,
           max_model_len=None, progress=True, quantization=None) -> int

    model_config   minillm.config.ModelConfig (or anything with hidden_size, num_heads,
                   num_kv_heads, head_dim and optionally max_position_embeddings)
    dtype          the KV-cache / activation dtype: torch.bfloat16 | torch.float16 | torch.float32
                   (or "bfloat16" / "float16" / "float32")
    block_size     tokens per KV-cache block (the contiguous engines: max_model_len)
    device         where the engine runs: "cuda", "cuda:1" or a torch.device
    max_num_seqs   the largest batch the engine runs (decode split counts depend on it)
    max_model_len  longest context; None = model_config.max_position_embeddings
    progress       show a tqdm progress bar
    quantization   None (float weights, the default) or "int8" / "q4": also the quantized
                   GEMVs of every projection and the LM head (kernels/quant_gemv.py)

    On CUDA it makes every call of engine_launches() once on tiny inputs (the JIT
    compiles each distinct variant on the first call that reaches it, or loads it from
    its disk cache; the rest are cache hits) and synchronises. Returns the number of
    wrapper calls made. Anywhere else (CPU, the interpreter, no Triton) it does nothing
    and returns 0.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"warmup: quantization must be None or one of {', '.join(map(repr, QUANTIZATIONS))}, "
                         f"got {quantization!r}")
    device = torch.device(device)
    if (device.type != "cuda" or not HAS_TRITON or not torch.cuda.is_available()
            or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return 0
    if isinstance(dtype, str):
        dtype = DTYPES[dtype_name(dtype)]
    gpu = _common.planning_gpu(device)
    launches = engine_launches(model_config, dtype, block_size, gpu, max_num_seqs=max_num_seqs,
                               max_model_len=max_model_len, quantization=quantization)
    from tqdm.auto import tqdm

    with torch.cuda.device(device):
        for launch in tqdm(launches, desc=f"warming up kernels ({gpu.arch})", disable=not progress):
            launch.run(device)
        torch.cuda.synchronize(device)
    return len(launches)
