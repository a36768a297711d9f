"""Attention on the CPU as a small C++ kernel (``attention_rows.cpp``): every query of a step a row.

What it computes is the paged attention of the oracle (``kernels.paged_decode_attention.
paged_attention_ref``, which the tests compare it with, as with the torch backend) for rows
of one query each: a decode row, or one query of a prefill, a chunk or drafts to verify,
which ``attention.cpu_attention_rows`` gives the kernel as a row of its own with its own
number of keys (the causal mask, by construction). Each row attends over exactly its
sequence's cached keys, read through the block table. What it saves is the fixed cost of
doing that with torch calls: a gather of the row's K/V, then small matrix products whose
dispatch and packing cost several times the arithmetic of one row (python -m
minillm.bench.profile_step shows attention's share of a step); for a prefill, SDPA's CPU
kernel on short causal rows (a prompt of 190 tokens: 2.5-3x the kernel's time in bf16).
The kernel streams each row's keys once, for all the query heads that share a KV head, and
splits long rows into chunks so that every thread has work. It runs on torch's OpenMP
threads (the same libgomp, the same thread count).

Candidate trees (speculative verification of a Medusa tree, whose nodes come as rows of one
sequence): a row may carry a tree mask, ``tree_start`` and the 64-bit set ``tree_bits``, and
then reads key j only if j < tree_start or bit j - tree_start is set: a node sees the keys
before its tree, its ancestors and itself (the oracle's ``tree_key_mask``).

The library is built and loaded by ``build.py`` (with the layer ops of ``layer_ops.py``).
"""
from __future__ import annotations

import ctypes

import torch

from .build import DTYPE_CODES, DTYPES, library, named_call

__all__ = ["AttentionRows", "attend_rows", "PROFILER_NAME", "DTYPES"]  # DTYPES: what the kernel takes

_REFUSALS = {1: "at most 16 query heads per KV head and head_dim at most 256",
             2: "a row has no keys (context length < 1)",
             4: "a row names a sequence or token outside block_tables / q",
             5: "a block table entry is outside the cache, or the context needs more blocks than the table has",
             6: "a row's tree mask hides all its keys (tree_start <= 0 and no bit of its keys set)"}

PROFILER_NAME = "minillm::cpu_attention_rows"  # python -m minillm.bench.profile_step counts it as attention
_CPU_ONLY = "the CPU attention kernel takes CPU tensors only (on CUDA the Triton backend attends)"


def _tree_entry(lib):
    """The library's kernel with tree masks (``minillm_attention_rows_tree``): the arguments of
    ``minillm_attention_rows`` as ``build`` declares them, then tree_start and tree_bits."""
    fn = lib.minillm_attention_rows_tree
    if fn.argtypes is None:
        fn.argtypes = [*lib.minillm_attention_rows.argtypes, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
    return fn


class AttentionRows:
    """``attend_rows`` for one step's rows, one query each (decode rows, and the queries of
    prefills, chunks and drafts): the step's tables are checked once, here, and each layer's
    call checks only its own tensors (30 layers call it with the same rows).

    block_tables [B, max_blocks] int32; context_lens [B] int32 (the keys of each table row,
    this step's included); rows [R, 2] int64, (table row, token) pairs. All on the CPU.
    ``attention.cpu_attention_rows`` builds one per step from the step's metadata.

    Candidate trees: tree_start [R] int32 and tree_bits [R] int64, both or neither, one per
    row. Row r then reads key j (of its context_lens[rows[r, 0]]) only if j < tree_start[r] or
    bit j - tree_start[r] of tree_bits[r] is set (bits 0 .. 63, read as unsigned: bit 63 is
    the sign bit); a row outside any tree has tree_start[r] >= its number of keys.
    """

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, rows: torch.Tensor,
                 tree_start: torch.Tensor | None = None, tree_bits: torch.Tensor | None = None):
        if any(t.device.type != "cpu" for t in (block_tables, context_lens, rows)):
            raise ValueError(_CPU_ONLY)
        if rows.dim() != 2 or rows.shape[1] != 2 or block_tables.dim() != 2 or context_lens.shape != block_tables.shape[:1]:
            raise ValueError(f"rows must be [R, 2], block_tables [B, max_blocks] and context_lens [B], got "
                             f"{tuple(rows.shape)}, {tuple(block_tables.shape)}, {tuple(context_lens.shape)}")
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or rows.dtype != torch.int64:
            raise ValueError("block_tables and context_lens must be int32, rows int64")
        if (tree_start is None) != (tree_bits is None):
            raise ValueError("tree_start and tree_bits come together: give both or neither")
        if tree_start is not None:
            if tree_start.device.type != "cpu" or tree_bits.device.type != "cpu":
                raise ValueError(_CPU_ONLY)
            if tree_start.shape != rows.shape[:1] or tree_bits.shape != rows.shape[:1]:
                raise ValueError(f"tree_start and tree_bits must be [R] for rows [R, 2], got "
                                 f"{tuple(tree_start.shape)}, {tuple(tree_bits.shape)}, rows {tuple(rows.shape)}")
            if tree_start.dtype != torch.int32 or tree_bits.dtype != torch.int64:
                raise ValueError(f"tree_start must be int32 and tree_bits int64, got {tree_start.dtype}, "
                                 f"{tree_bits.dtype}")
        self.lib = library()
        self.tensors = (block_tables.contiguous(), context_lens.contiguous(), rows.contiguous())  # kept alive
        bt, ctx, r = self.tensors
        self.num_rows = r.shape[0]
        self.table_args = (bt.data_ptr(), bt.stride(0), ctx.data_ptr(), r.data_ptr(), r.shape[0])
        self.table_shape = (bt.shape[0], bt.shape[1])
        # the kernel and its last arguments: without trees, the one build declares; with them, the tree masks
        self.tree = None if tree_start is None else (tree_start.contiguous(), tree_bits.contiguous())  # kept alive
        if self.tree is None:
            self.kernel, self.tree_args = self.lib.minillm_attention_rows, ()
        else:
            self.kernel, self.tree_args = _tree_entry(self.lib), tuple(t.data_ptr() for t in self.tree)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                 out: torch.Tensor) -> None:
        self.check_caches(k_cache, v_cache)
        self.run(self.bind(q, out, k_cache), k_cache.data_ptr(), v_cache.data_ptr(), scale)

    @staticmethod
    def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
            raise ValueError(_CPU_ONLY)
        if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"the caches differ: {tuple(k_cache.shape)} {k_cache.dtype} / "
                             f"{tuple(v_cache.shape)} {v_cache.dtype}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV caches must be contiguous")

    def bind(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor) -> tuple:
        """Check q, out and the caches' shape (every layer's caches must have it); the arguments of
        ``run`` for every layer that attends from q into out."""
        if any(t.device.type != "cpu" for t in (q, k_cache, out)):
            raise ValueError(_CPU_ONLY)
        T, Hq, D = q.shape
        _, block_size, Hkv, Dc = k_cache.shape
        if not (q.dtype == k_cache.dtype == out.dtype and q.dtype in DTYPE_CODES):
            raise ValueError(f"the CPU attention kernel takes float32 or bfloat16 q, out and caches of one dtype, got "
                             f"{q.dtype}, {out.dtype}, {k_cache.dtype}")
        if Dc != D or Hq % Hkv or out.shape != q.shape:
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, out {tuple(out.shape)}, "
                             f"caches {tuple(k_cache.shape)}")
        for name, t in (("q", q), ("out", out)):
            if t.stride(2) != 1 or t.stride(1) != D:
                raise ValueError(f"{name} must have contiguous heads ([T, Hq, D] with strides (*, D, 1))")
        head = (DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), out.data_ptr(), out.stride(0))
        shape = (block_size, Hkv, Hq // Hkv, D, *self.table_args)
        tail = (torch.get_num_threads(), T, *self.table_shape, k_cache.shape[0], *self.tree_args)
        return head, shape, tail

    def run(self, bound: tuple, k_ptr: int, v_ptr: int, scale: float) -> None:
        """The kernel over caches at k_ptr, v_ptr, of the shape ``bind`` checked (the caller's word)."""
        head, shape, tail = bound
        args = (*head, k_ptr, v_ptr, *shape, float(scale), *tail)
        rc = named_call(PROFILER_NAME, self.kernel, *args)  # profile_step's attention
        if rc != 0:
            raise ValueError(f"the CPU attention kernel refused its arguments: {_REFUSALS.get(rc, rc)}")


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, rows: torch.Tensor, scale: float, out: torch.Tensor,
                tree_start: torch.Tensor | None = None, tree_bits: torch.Tensor | None = None) -> None:
    """out[tok] = attention of q[tok] over sequence b's cached keys, for each (b, tok) in ``rows``.

    q, out: [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    int32; context_lens [B] int32 (keys of each sequence, this step's included); rows [R, 2]
    int64; tree_start [R] int32 and tree_bits [R] int64, both or neither: the rows' tree masks
    (``AttentionRows``). All on the CPU, q/out/caches of one dtype (float32 or bfloat16). One
    call; a step that attends in many layers prepares ``AttentionRows`` once instead.
    """
    AttentionRows(block_tables, context_lens, rows, tree_start, tree_bits)(q, k_cache, v_cache, scale, out)
