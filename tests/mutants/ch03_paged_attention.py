"""Wrong answers to exercises/ch03_paged_attention.py, each a mistake the contract rules out."""
from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels below are defined at import

from mutants import mutant  # noqa: E402
from solutions import ch03_paged_attention as ref  # noqa: E402

try:  # the K/V store's mutants are Triton kernels; without triton its tests are skipped anyway
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# ---------------------------------------------------------------- blocks_needed


@mutant("blocks_needed", "floor division: a partly filled last block is not counted")
def _blocks_floor(num_tokens, block_size):
    return num_tokens // block_size


@mutant("blocks_needed", "one block too many when the tokens end exactly on a block edge")
def _blocks_plus_one(num_tokens, block_size):
    return num_tokens // block_size + 1


@mutant("blocks_needed", "ceiling of a float division: wrong once the count passes 2**53",
        same_in_engine="the engine asks for at most max_num_seqs * max_model_len tokens, far below 2**53, "
                       "where a float division is exact enough to round up right")
def _blocks_float(num_tokens, block_size):
    return math.ceil(num_tokens / block_size)


@mutant("blocks_needed", "rounded to the nearest block: a last block less than half full is dropped")
def _blocks_round(num_tokens, block_size):
    return (num_tokens + block_size // 2) // block_size


# ---------------------------------------------------------------- slot_mapping


@mutant("slot_mapping", "the block id is not multiplied by block_size")
def _slots_unscaled(block_table, block_size, start, end):
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


@mutant("slot_mapping", "the block table is ignored: blocks are assumed to be in order (slot = position)")
def _slots_no_table(block_table, block_size, start, end):
    return [(p // block_size) * block_size + p % block_size for p in range(start, end)]


@mutant("slot_mapping", "end is inclusive: one slot too many")
def _slots_inclusive(block_table, block_size, start, end):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end + 1)]


@mutant("slot_mapping", "positions counted from 0, not from start")
def _slots_from_zero(block_table, block_size, start, end):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(end - start)]


# ---------------------------------------------------------------- allocate_blocks


@mutant("allocate_blocks", "blocks are taken from the back of the free list (the most recently freed first)")
def _allocate_from_back(free_list, ref_counts, n):
    if n > len(free_list):
        raise RuntimeError(f"asked for {n} blocks, {len(free_list)} free")
    ids = [free_list.pop() for _ in range(n)]
    for b in ids:
        ref_counts[b] = 1
    return ids


@mutant("allocate_blocks", "the reference counts of the blocks handed out are left at 0")
def _allocate_no_refcount(free_list, ref_counts, n):
    if n > len(free_list):
        raise RuntimeError(f"asked for {n} blocks, {len(free_list)} free")
    ids = free_list[:n]
    del free_list[:n]
    return ids


@mutant("allocate_blocks", "the blocks handed out stay on the free list")
def _allocate_not_removed(free_list, ref_counts, n):
    if n > len(free_list):
        raise RuntimeError(f"asked for {n} blocks, {len(free_list)} free")
    ids = free_list[:n]
    for b in ids:
        ref_counts[b] = 1
    return ids


@mutant("allocate_blocks", "not all or nothing: blocks are taken one by one until the list runs dry, then it raises",
        same_in_engine="BlockAllocator.allocate raises NoFreeBlocksError before it calls the seam when fewer than "
                       "n blocks are free")
def _allocate_partial(free_list, ref_counts, n):
    ids = []
    for _ in range(n):
        if not free_list:
            raise RuntimeError(f"asked for {n} blocks, ran out after {len(ids)}")
        b = free_list.pop(0)
        ref_counts[b] = 1
        ids.append(b)
    return ids


@mutant("allocate_blocks", "the lowest free block ids are handed out, not the front of the list")
def _allocate_lowest(free_list, ref_counts, n):
    if n > len(free_list):
        raise RuntimeError(f"asked for {n} blocks, {len(free_list)} free")
    ids = sorted(free_list)[:n]
    for b in ids:
        free_list.remove(b)
        ref_counts[b] = 1
    return ids


# ---------------------------------------------------------------- free_blocks


@mutant("free_blocks", "a freed block goes to the FRONT of the free list (it is the first reused)")
def _free_to_front(free_list, ref_counts, block_ids):
    for b in block_ids:
        if ref_counts[b] == 0:
            raise ValueError(f"double free of block {b}")
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            free_list.insert(0, b)


@mutant("free_blocks", "a block whose count reaches 0 is not put back on the free list (it leaks)")
def _free_leaks(free_list, ref_counts, block_ids):
    for b in block_ids:
        if ref_counts[b] == 0:
            raise ValueError(f"double free of block {b}")
        ref_counts[b] -= 1


@mutant("free_blocks", "the count is checked but not dropped: a block of count 1 goes back with its count still 1")
def _free_count_kept(free_list, ref_counts, block_ids):
    for b in block_ids:
        if ref_counts[b] == 0:
            raise ValueError(f"double free of block {b}")
        if ref_counts[b] == 1:
            free_list.append(b)
        else:
            ref_counts[b] -= 1


@mutant("free_blocks", "sharing ignored: every freed block goes back with count 0, though another table holds it",
        same_in_engine="the engine's tables share a block only through the prefix cache, and a cached block is "
                       "freed by the library's code, never the seam (BlockAllocator.free)")
def _free_ignores_sharing(free_list, ref_counts, block_ids):
    for b in block_ids:
        if ref_counts[b] == 0:
            raise ValueError(f"double free of block {b}")
        ref_counts[b] = 0
        free_list.append(b)


@mutant("free_blocks", "a double free is skipped silently instead of raising ValueError",
        same_in_engine="BlockManager.free pops a request's table before it frees its blocks, and the allocator "
                       "rejects a free block before it calls the seam: the seam never sees a double free")
def _free_double_ignored(free_list, ref_counts, block_ids):
    for b in block_ids:
        if ref_counts[b] == 0:
            continue
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            free_list.append(b)


# ---------------------------------------------------------------- online_softmax_update


def _shift(m_new):
    return torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)


@mutant("online_softmax_update", "the old acc is not rescaled by exp(m_old - m_new) (l is)")
def _online_acc_not_rescaled(m, l, acc, scores, v):
    scores = scores.float()
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    shift = _shift(m_new)
    alpha = torch.exp(m - shift)
    p = torch.exp(scores - shift[:, None])
    return m_new, l * alpha + p.sum(-1), acc + torch.einsum("hn,nhd->hd", p, v.float())


@mutant("online_softmax_update", "the old l is not rescaled by exp(m_old - m_new): the softmax is not renormalised")
def _online_l_not_rescaled(m, l, acc, scores, v):
    scores = scores.float()
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    shift = _shift(m_new)
    alpha = torch.exp(m - shift)
    p = torch.exp(scores - shift[:, None])
    return m_new, l + p.sum(-1), acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v.float())


@mutant("online_softmax_update", "m_new is this block's max only: the running max is forgotten")
def _online_block_max(m, l, acc, scores, v):
    scores = scores.float()
    m_new = scores.max(dim=-1).values
    shift = _shift(m_new)
    alpha = torch.exp(m - shift)
    p = torch.exp(scores - shift[:, None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v.float())


@mutant("online_softmax_update", "no guard for a head whose max is still -inf: exp(-inf - -inf) is NaN")
def _online_no_guard(m, l, acc, scores, v):
    scores = scores.float()
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(-1), acc * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v.float())


@mutant("online_softmax_update", "exp of the raw scores: the max is tracked but never subtracted")
def _online_raw_exp(m, l, acc, scores, v):
    scores = scores.float()
    m_new = torch.maximum(m, scores.max(dim=-1).values)
    p = torch.exp(scores)
    return m_new, l + p.sum(-1), acc + torch.einsum("hn,nhd->hd", p, v.float())


@mutant("online_softmax_update", "computed in the scores' dtype, not float32")
def _online_input_dtype(m, l, acc, scores, v):
    m_new = torch.maximum(m.to(scores.dtype), scores.max(dim=-1).values)
    shift = _shift(m_new)
    alpha = torch.exp(m.to(scores.dtype) - shift)
    p = torch.exp(scores - shift[:, None])
    return (m_new, l.to(scores.dtype) * alpha + p.sum(-1),
            acc.to(scores.dtype) * alpha[:, None] + torch.einsum("hn,nhd->hd", p, v.to(scores.dtype)))


# ---------------------------------------------------------------- paged_decode_attention


def _attention(q, k_cache, v_cache, block_table, context_len, scale, *, past_of=None, num_blocks=None,
               order=None, zero_garbage=True, heads="interleave"):
    """The block-by-block loop with one of its pieces swapped for a learner's mistake."""
    Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    m, l, acc = torch.full((Hq,), float("-inf")), torch.zeros(Hq), torch.zeros(Hq, D)
    n = -(-context_len // block_size) if num_blocks is None else num_blocks(context_len, block_size)
    table = list(block_table[:n]) if order is None else order(list(block_table[:n]))
    for i, b in enumerate(table):
        k, v = k_cache[b].float(), v_cache[b].float()
        if heads == "interleave":
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        else:  # query head h reads KV head h % Hkv
            k, v = k.repeat(1, group, 1), v.repeat(1, group, 1)
        pos = i * block_size + torch.arange(block_size)
        past = pos >= context_len if past_of is None else past_of(pos, context_len)
        if zero_garbage:
            k = k.masked_fill(past[:, None, None], 0.0)
            v = v.masked_fill(past[:, None, None], 0.0)
        scores = torch.einsum("hd,nhd->hn", q.float(), k) * scale
        scores = scores.masked_fill(past[None, :], float("-inf"))
        m, l, acc = ref.online_softmax_update(m, l, acc, scores, v)
    return (acc / l[:, None]).to(q.dtype)


@mutant("paged_decode_attention", "positions past context_len in the last block are not masked")
def _attn_no_mask(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale,
                      past_of=lambda pos, n: torch.zeros_like(pos, dtype=torch.bool))


@mutant("paged_decode_attention", "the mask is off by one: position context_len is attended (> instead of >=)")
def _attn_mask_off_by_one(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale, past_of=lambda pos, n: pos > n)


@mutant("paged_decode_attention", "floor(context_len / block_size) blocks: a partly filled last block is skipped")
def _attn_floor_blocks(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale, num_blocks=lambda n, bs: n // bs)


@mutant("paged_decode_attention", "query head h reads KV head h % Hkv instead of h // (Hq // Hkv)")
def _attn_gqa_modulo(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale, heads="modulo")


@mutant("paged_decode_attention", "the blocks are read in sorted id order, not block-table order")
def _attn_sorted_table(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale, order=sorted)


@mutant("paged_decode_attention", "unwritten slots are masked but not zeroed: 0 * NaN is NaN")
def _attn_garbage_kept(q, k_cache, v_cache, block_table, context_len, scale):
    return _attention(q, k_cache, v_cache, block_table, context_len, scale, zero_garbage=False)


# ---------------------------------------------------------------- choose_victim


@mutant("choose_victim", "the request admitted first (the oldest) is preempted")
def _victim_oldest(running):
    return running[0]


@mutant("choose_victim", "the request with the fewest computed tokens is preempted, not the newest")
def _victim_least_computed(running):
    return min(running, key=lambda r: r.num_computed_tokens)


@mutant("choose_victim", "the request holding the most blocks is preempted (frees the most memory)")
def _victim_most_blocks(running):
    return max(running, key=lambda r: (len(r.block_ids), r.num_tokens))


@mutant("choose_victim", "the newest is popped off the running list (the list is modified)",
        same_in_engine="the scheduler hands choose_victim a copy of its running list (PagedScheduler._make_room)")
def _victim_popped(running):
    return running.pop()


# ---------------------------------------------------------------- store_kv_triton


def _launch(kernel, k, v, k_cache, v_cache, slot_mapping):
    T, H, D = k.shape
    if T:
        kernel[(T,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                     H, D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D))


if triton is not None:
    @triton.jit
    def _skips_slot_zero_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skt, skh, svt, svh, H, D,
                                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot > 0:  # the padding test also drops slot 0, a real slot
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (h < H) & (d < D)
            dst = slot * H * D + h * D + d
            tl.store(kc_ptr + dst, tl.load(k_ptr + t * skt + h * skh + d, mask=mask), mask=mask)
            tl.store(vc_ptr + dst, tl.load(v_ptr + t * svt + h * svh + d, mask=mask), mask=mask)

    @triton.jit
    def _keys_twice_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skt, skh, svt, svh, H, D,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (h < H) & (d < D)
            dst = slot * H * D + h * D + d
            k = tl.load(k_ptr + t * skt + h * skh + d, mask=mask)
            tl.store(kc_ptr + dst, k, mask=mask)
            tl.store(vc_ptr + dst, k, mask=mask)  # copy-paste: the keys again, the values never

    @triton.jit
    def _contiguous_rows_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skt, skh, svt, svh, H, D,
                                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            h = tl.arange(0, BLOCK_H)[:, None]
            d = tl.arange(0, BLOCK_D)[None, :]
            mask = (h < H) & (d < D)
            src = t * H * D + h * D + d  # the strides are ignored: rows assumed packed
            dst = slot * H * D + h * D + d
            tl.store(kc_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
            tl.store(vc_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)

    @triton.jit
    def _no_head_offset_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, skt, skh, svt, svh, H, D,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            d = tl.arange(0, BLOCK_D)
            mask = d < D
            for h in range(0, H):
                dst = slot * H * D + d  # the head's offset h * D is left out: every head lands on head 0
                tl.store(kc_ptr + dst, tl.load(k_ptr + t * skt + h * skh + d, mask=mask), mask=mask)
                tl.store(vc_ptr + dst, tl.load(v_ptr + t * svt + h * svh + d, mask=mask), mask=mask)


@mutant("store_kv_triton", "the padding test is slot > 0: slot 0 (block 0, offset 0) is never written")
def _store_skips_slot_zero(k, v, k_cache, v_cache, slot_mapping):
    _launch(_skips_slot_zero_kernel, k, v, k_cache, v_cache, slot_mapping)


@mutant("store_kv_triton", "the keys are stored in both caches; the values never")
def _store_keys_twice(k, v, k_cache, v_cache, slot_mapping):
    _launch(_keys_twice_kernel, k, v, k_cache, v_cache, slot_mapping)


@mutant("store_kv_triton", "the row strides are ignored: k and v are read as if packed [T, Hkv, D]")
def _store_ignores_strides(k, v, k_cache, v_cache, slot_mapping):
    _launch(_contiguous_rows_kernel, k, v, k_cache, v_cache, slot_mapping)


@mutant("store_kv_triton", "the destination leaves out the head's offset: every head is written over head 0")
def _store_no_head_offset(k, v, k_cache, v_cache, slot_mapping):
    _launch(_no_head_offset_kernel, k, v, k_cache, v_cache, slot_mapping)
