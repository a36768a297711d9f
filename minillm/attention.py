"""Attention over a flat "varlen" batch and a block-table KV cache.

Every engine in minillm calls attention the same way. A step processes T new tokens
belonging to B sequences laid end to end; sequence b owns tokens
``query_start_loc[b]:query_start_loc[b+1]`` and, after this step, has
``context_lens[b]`` tokens of K/V in the cache. So its j-th new token sits at position
``context_lens[b] - q_len_b + j`` and may attend keys 0..that position.

The cache of each layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``. A
sequence's tokens live in the blocks listed in its row of ``block_tables``; a token's
*slot* is ``block_id * block_size + offset``. A contiguous per-request reservation is
the special case of one block of ``max_model_len`` tokens per sequence, so the
contiguous and the paged engines share this code.

Two backends with one signature: ``torch`` (readable, the oracle) and ``triton``
(``kernels/``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, including this step's tokens
    block_size: int
    # Host-side copies, so the torch backend can plan without device syncs.
    query_lens_list: list[int]
    context_lens_list: list[int]
    plan: dict = field(default_factory=dict)  # per-step index tensors, built once, reused by every layer

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D] viewed as [slots, Hkv, D]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def _gather_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # positions [...] -> slots [...] through one sequence's (or a batch's) block table
    return block_table.gather(-1, positions // block_size).long() * block_size + positions % block_size


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    # [..., L, Hkv, D] -> [..., L, Hkv*group, D]: each KV head serves `group` query heads (GQA)
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _decode_plan(meta: AttentionMetadata, device) -> dict:
    """Gather indices for the decode rows, built once per step and shared by every layer."""
    plan = meta.plan
    if "decode" not in plan:
        rows = [b for b, n in enumerate(meta.query_lens_list) if n == 1]
        if not rows:
            plan["decode"] = None
            return plan
        rows_t = torch.tensor(rows, device=device)
        L = max(meta.context_lens_list[b] for b in rows)
        pos = torch.arange(L, device=device)  # [L]
        ctx = meta.context_lens[rows_t].long()  # [Bd]
        # Past its own length a row re-reads its last key (then masks it out), so every
        # gathered slot belongs to that row's blocks.
        pos_b = torch.minimum(pos[None, :], ctx[:, None] - 1)  # [Bd, L]
        plan["decode"] = dict(
            rows=rows_t,
            all_rows=len(rows) == meta.num_seqs,
            slots=_gather_slots(meta.block_tables[rows_t], pos_b, meta.block_size),  # [Bd, L]
            mask=(pos[None, :] < ctx[:, None])[:, None, None, :],  # [Bd, 1, 1, L]
            tok=meta.query_start_loc[rows_t].long(),  # the single query token of each row
        )
    return plan


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Readable paged attention: gather K/V through the block table, then SDPA.

    q: [T, Hq, D] -> out [T, Hq, D]. Decode rows (one query each) are batched in a
    single call with keys padded to the longest context; each multi-token row
    (prefill, prefill chunk, speculative verification) runs on its own with a causal
    mask shifted by its context offset.
    """
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    k_flat = k_cache.view(-1, Hkv, D)
    v_flat = v_cache.view(-1, Hkv, D)

    dec = _decode_plan(meta, q.device)["decode"]
    if dec is not None:
        k = k_flat[dec["slots"]].transpose(1, 2)  # [Bd, Hkv, L, D]
        v = v_flat[dec["slots"]].transpose(1, 2)
        # GQA without copying K/V: the `group` query heads of one KV head become
        # `group` query rows against that head's keys.
        qd = q[dec["tok"]].view(-1, Hkv, group, D)  # [Bd, Hkv, group, D]
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=dec["mask"], scale=scale)
        o = o.reshape(-1, Hq, D)  # [Bd, Hq, D]
        if dec["all_rows"]:  # a pure decode step: rows are the tokens, in order
            return o
        out = torch.empty_like(q)
        out[dec["tok"]] = o
    else:
        out = torch.empty_like(q)

    starts = meta.query_start_loc.tolist()
    for b, n in enumerate(meta.query_lens_list):
        if n <= 1:
            continue
        ctx = meta.context_lens_list[b]
        pos = torch.arange(ctx, device=q.device)
        slots = _gather_slots(meta.block_tables[b], pos, meta.block_size)
        k = _expand_kv(k_flat[slots], group).transpose(0, 1)  # [Hq, ctx, D]
        v = _expand_kv(v_flat[slots], group).transpose(0, 1)
        qs = q[starts[b]:starts[b] + n].transpose(0, 1)  # [Hq, n, D]
        if ctx == n:  # whole prompt at once: the plain causal mask
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale)
        else:  # a chunk after cached context: query j sees keys <= ctx - n + j
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = pos[None, :] <= qpos[:, None]  # [n, ctx]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)
        out[starts[b]:starts[b] + n] = o.transpose(0, 1)
    return out


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The same contract through the Triton kernels in ``kernels/``."""
    from kernels.paged_decode_attention import paged_decode_attention
    from kernels.paged_prefill_attention import paged_prefill_attention

    if meta.is_pure_decode:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.context_lens, scale, max_query_len=max(meta.query_lens_list))


def triton_write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    from kernels.store_kv import store_kv

    store_kv(k, v, k_cache, v_cache, slot_mapping)


BACKENDS = {
    "torch": (write_kv, torch_attention),
    "triton": (triton_write_kv, triton_attention),
}
