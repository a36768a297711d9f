"""Chapter 3 solutions: same names and signatures as ``exercises/ch03_paged_attention.py``.

Block arithmetic comes straight from ``minillm/block_manager.py``; the allocator
functions spell out what ``BlockAllocator`` does on its own state; the attention
answers are a PyTorch transcription of the loop in ``minillm/kernels/paged_decode_attention.py``.
"""
from __future__ import annotations

import torch

from minillm import block_manager
from minillm.request import Request
from minillm.course import quiz


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Read ``minillm/block_manager.py``, ``blocks_needed``: a ceiling division in integers."""
    return block_manager.blocks_needed(num_tokens, block_size)


def slot_mapping(block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Read ``minillm/block_manager.py``, ``slots_for`` (and ``model_runner.build_batch``, its caller)."""
    return block_manager.slots_for(block_table, block_size, start, end)


def allocate_blocks(free_list: list[int], ref_counts: list[int], n: int) -> list[int]:
    """``BlockAllocator.allocate``: check first, so a failure changes nothing."""
    if n > len(free_list):
        raise block_manager.NoFreeBlocksError(f"asked for {n} blocks, {len(free_list)} free")
    ids = free_list[:n]
    del free_list[:n]
    for b in ids:
        ref_counts[b] = 1
    return ids


def free_blocks(free_list: list[int], ref_counts: list[int], block_ids: list[int]) -> None:
    """``BlockAllocator.free``, once per block: the last holder returns it to the back of the list."""
    for b in block_ids:
        if ref_counts[b] == 0:
            raise ValueError(f"double free of block {b}")
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            free_list.append(b)


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One iteration of the key loop of ``_paged_decode_kernel`` (natural base, -inf start)."""
    scores = scores.float()  # [H, N]
    m_new = torch.maximum(m, scores.max(dim=-1).values)  # [H]
    # A head that has seen only -inf keeps m = -inf; subtracting 0 instead keeps exp() at 0, not NaN.
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # [H]
    alpha = torch.exp(m - shift)  # [H] rescales the old terms (0 when m was -inf)
    p = torch.exp(scores - shift[:, None])  # [H, N]
    l_new = l * alpha + p.sum(dim=-1)  # [H]
    acc_new = acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v.float())  # [H, D]
    return m_new, l_new, acc_new


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: list[int], context_len: int, scale: float) -> torch.Tensor:
    """The decode kernel's structure with one "program" per request: loop over its blocks."""
    Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    m = torch.full((Hq,), float("-inf"))  # [Hq]
    l = torch.zeros(Hq)  # [Hq]
    acc = torch.zeros(Hq, D)  # [Hq, D]
    qf = q.float()
    for i in range(block_manager.blocks_needed(context_len, block_size)):
        b = block_table[i]
        k = k_cache[b].float().repeat_interleave(group, dim=1)  # [block_size, Hq, D]
        v = v_cache[b].float().repeat_interleave(group, dim=1)  # [block_size, Hq, D]
        past = i * block_size + torch.arange(block_size) >= context_len  # [block_size] unwritten slots
        # Zero the garbage itself, not only its weight: 0 * NaN is NaN (the kernel loads it as 0).
        k = k.masked_fill(past[:, None, None], 0.0)
        v = v.masked_fill(past[:, None, None], 0.0)
        scores = torch.einsum("hd,nhd->hn", qf, k) * scale  # [Hq, block_size]
        scores = scores.masked_fill(past[None, :], float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, scores, v)
    return (acc / l[:, None]).to(q.dtype)


def choose_victim(running: list[Request]) -> Request:
    """``minillm/scheduler/paged.py``, ``PagedScheduler._make_room``: the newest request."""
    if not running:
        raise ValueError("no running request to preempt")
    return running[-1]


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Read ``minillm/kernels/store_kv.py``: ``_store_kv_kernel`` and its launch in ``store_kv``."""
    from minillm.kernels.store_kv import store_kv

    store_kv(k, v, k_cache, v_cache, slot_mapping)


def quiz_answers() -> dict[str, str | float]:
    """The reference answers, kept as digests like the questions' own (``quiz.sealed``): ``make grade`` says whether
    yours is right. How to work them out: q1: a partly filled last block still takes a whole block; q2: find the
    block of the position in the table, then its offset in that block; q3: the reserved slots the request does
    not use, over those reserved."""
    return quiz.sealed("ch03")
