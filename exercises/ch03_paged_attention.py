"""Chapter 3 exercises: blocks, block tables, slot mapping, and attention block by block.

Replace each ``raise NotImplementedError`` with your code, then grade it from the
repository root:

    make grade CHAPTER=ch03          # or: .venv/bin/python tests/grade.py ch03

Each docstring gives the shapes, the contract the tests check, and hints. Once you
have tried, compare with the file named at the end of the docstring. Plain Python and
PyTorch are all you need; do not import the answers from ``minillm`` or ``kernels``.

The picture: the KV cache of a layer is ``[num_blocks, block_size, Hkv, D]``. A request
owns a *block table*, a list of block ids: its logical block i (token positions
``i * block_size`` to ``(i + 1) * block_size - 1``) lives in physical block
``block_table[i]``. The blocks can be anywhere, in any order.
"""
from __future__ import annotations

import torch

from minillm.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens.

    Contract: the smallest integer b with b * block_size >= num_tokens, i.e.
    ceil(num_tokens / block_size); 0 tokens need 0 blocks. Exact for any size of
    integer (no floating point).

    Hints: ``-(-a // b)`` is a ceiling division in integers; so is ``(a + b - 1) // b``.

    Answer, after you try: ``minillm/block_manager.py``, ``blocks_needed``.
    """
    raise NotImplementedError


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Cache slots of token positions ``start .. end-1`` of one request.

    The cache viewed flat is ``[num_blocks * block_size, Hkv, D]``; the slot of
    position p is

        block_table[p // block_size] * block_size + p % block_size

    Contract: returns a list of ``end - start`` Python ints, in position order. This
    is what the model runner hands to the kernel that writes a step's new K/V
    (``slot_mapping[T]``): a decode step asks for one position, a prefill for many.

    Example: block_table [7, 2, 5], block_size 4, positions 2..9 ->
    [30, 31, 8, 9, 10, 11, 20, 21].

    Answer, after you try: ``minillm/block_manager.py``, ``slots_for``.
    """
    raise NotImplementedError


def allocate_blocks(free_list: list[int], ref_counts: list[int], n: int) -> list[int]:
    """Take ``n`` blocks from the free list (the allocator's state is the two lists).

    ``free_list``: ids of free blocks, in the order they are handed out (front first).
    ``ref_counts[b]``: how many block tables hold block b (0 for a free block).

    Contract:
      - returns the first ``n`` ids of ``free_list``, in order, removed from it; each
        of them now has reference count 1;
      - all or nothing: with fewer than ``n`` free blocks, raise ``RuntimeError`` and
        leave both lists unchanged (the scheduler then preempts, or waits);
      - ``n == 0`` returns ``[]``.

    Both lists are modified in place.

    Answer, after you try: ``minillm/block_manager.py``, ``BlockAllocator.allocate``.
    """
    raise NotImplementedError


def free_blocks(free_list: list[int], ref_counts: list[int], block_ids: list[int]) -> None:
    """Drop one reference to each block in ``block_ids``.

    Contract:
      - each block's reference count goes down by one; a block whose count reaches 0 is
        appended to the END of ``free_list`` (it is the last to be handed out again);
      - a block whose count is already 0 is a double free: raise ``ValueError``. Blocks
        before it in ``block_ids`` stay freed.

    Blocks with a count above 1 are shared between block tables (a forked sequence, a
    common prompt prefix): freeing one holder must not free the memory the other still
    reads. Both lists are modified in place.

    Answer, after you try: ``minillm/block_manager.py``, ``BlockAllocator.free``.
    """
    raise NotImplementedError


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one block of keys into a running softmax-weighted sum (flash attention's trick).

    Shapes: m [H], l [H], acc [H, D]: the running state of H query heads; scores [H, N]:
    the (already scaled) scores q.k of this block's N keys, -inf where a key must not
    be seen; v [N, H, D]: the values of those keys, as each head reads them. Returns
    the new (m, l, acc), float32.

    The state after blocks 1..j means, with s all scores seen so far:
        m   = max(s)                      (per head)
        l   = sum(exp(s - m))
        acc = sum(exp(s - m) * v)
    so attention's output is ``acc / l`` once every block is folded in. Start from
    m = -inf, l = 0, acc = 0.

    Contract:
      - m_new = max(m, max(scores)); every old term is rescaled by exp(m - m_new);
      - never computes exp of a large positive number (scores of 1000 must work);
      - a head whose scores are all -inf so far keeps m = -inf, l = 0, acc = 0, and no
        NaN appears, whatever order the blocks come in.

    Hints: ``alpha = exp(m - m_new)``, ``p = exp(scores - m_new[:, None])``; guard
    the case m_new == -inf (then use 0 instead of m_new in the subtraction) with
    ``torch.where``. ``torch.einsum("hn,nhd->hd", p, v)`` is the weighted sum.

    Answer, after you try: ``minillm/kernels/paged_decode_attention.py``, the loop of
    ``_paged_decode_kernel`` (it works in base 2 and starts m at -1e30 instead).
    """
    raise NotImplementedError


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: list[int], context_len: int, scale: float) -> torch.Tensor:
    """Attention of one new query token over its request's paged K/V, one block at a time.

    Shapes: q [Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D];
    block_table: the request's block ids; context_len: how many tokens of K/V it has
    (the last block may be partly filled; slots past context_len hold garbage).
    Returns [Hq, D] in q.dtype.

    Contract:
      - out[h] = softmax(scale * q[h] . K[:context_len, kvh]^T) @ V[:context_len, kvh]
        where K, V are the request's keys/values in position order and
        kvh = h // (Hq // Hkv) (grouped-query attention: several query heads share a
        KV head);
      - walk the table block by block: gather the block's keys, mask positions at or
        past context_len with -inf, fold it in with ``online_softmax_update``;
        never build the whole [context_len, ...] K or V;
      - unwritten slots may hold anything, NaN included: zero their K and V before
        using them (a zero weight times NaN is still NaN);
      - read only the first blocks_needed(context_len, block_size) entries of the table.

    Hints: ``k_cache[block_table[i]]`` is [block_size, Hkv, D];
    ``repeat_interleave(Hq // Hkv, dim=1)`` lines KV heads up with query heads;
    compute in float32.

    Answer, after you try: ``minillm/kernels/paged_decode_attention.py`` (the kernel and
    ``paged_decode_attention_ref``), and ``minillm/attention.py``, ``torch_attention``.
    """
    raise NotImplementedError


def choose_victim(running: list[Request]) -> Request:
    """Which running request to preempt when the block pool is dry.

    ``running``: the requests holding KV blocks, in admission order (oldest first).
    Contract: return the one admitted LAST. It has done the least work, so recomputing it
    costs least, and the oldest requests (closest to finishing) keep going; it is also
    what makes the paged engine's preemption pattern deterministic. Never modify the list.

    Answer, after you try: ``minillm/scheduler/paged.py``, ``PagedScheduler._make_room``.
    """
    raise NotImplementedError


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Write this step's keys and values into the paged cache with a Triton kernel you write.

    Shapes: k, v [T, Hkv, D] (head_dim contiguous; rows may be strided);
    k_cache, v_cache [num_blocks, block_size, Hkv, D] (contiguous); slot_mapping [T] int.
    In place: the cache viewed as [num_blocks * block_size, Hkv, D] gets row
    ``slot_mapping[t]`` <- k[t] (and v[t]); a slot of -1 is a padding token: skip it.

    Contract: a ``@triton.jit`` kernel (define it at module level, above this function),
    one program per token (grid ``(T,)``), launched here; every other slot of the cache
    is left untouched. The tests run it under the Triton interpreter on the CPU
    (``TRITON_INTERPRET=1``, set by the test setup), against a PyTorch oracle.

    In the engine: the seam ``store_kv_triton`` (``minillm/seams.py``). Plugged in, it writes
    every layer's K/V of every step in place of the attention backend's own write
    (``minillm/attention.py``: ``write_kv``, ``triton_write_kv``); the chapter's "run it in
    the engine" cell does it. Without a GPU, TRITON_INTERPRET=1 must be set before this file
    (or triton) is imported: Triton picks interpreted or compiled mode when ``@triton.jit``
    runs, at import, not at launch.

    Hints: ``t = tl.program_id(0)``; load the slot, ``if slot >= 0:``; a [BLOCK_H, BLOCK_D]
    tile from ``tl.arange`` (powers of two: ``triton.next_power_of_2``) with a mask for
    the padding; pass ``k.stride(0)``, ``k.stride(1)`` so strided rows work; the
    destination of a slot is ``slot * Hkv * D + h * D + d``. Import triton inside this
    file (``import triton``, ``import triton.language as tl``).

    Answer, after you try: ``minillm/kernels/store_kv.py``.
    """
    raise NotImplementedError


def quiz_answers() -> dict[str, str | float]:
    """Your answers to this chapter's questions: {"q1": ..., "q2": ...}.

    Print the questions with ``from minillm.course import quiz; quiz.show("ch03")`` (the
    chapter's last cells do it). A choice question takes a letter ("b"); a numeric
    question a number (rounded as the question says before it is compared). Leave a
    question out until you have an answer: it is graded as not answered.
    """
    raise NotImplementedError
