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

Three backends with one signature: ``torch`` (readable SDPA calls), ``cpu`` (the same,
with all of a step's queries in one call of a small C++ kernel, ``minillm/kernels/cpu/attention.py``;
the model then also runs its layers' RoPE, K/V write, norms and SwiGLU as C++ calls,
``model.Llama._cpu_layers``) and ``triton`` (``minillm/kernels/``). One oracle holds them all
to the same answer: ``kernels.paged_decode_attention.paged_attention_ref`` (textbook attention
in float32 over each sequence's gathered keys), and ``kernels.store_kv.store_kv_ref`` for the
K/V write, which is also the torch and cpu backends' write (``write_kv``).

Seams (``minillm/seams.py``, chapter 3): a plugged ``paged_decode_attention`` attends each
decode row (``torch_attention``); a plugged ``store_kv_triton`` writes every step's K/V into the
cache in place of each backend's write (``write_kv``, ``triton_write_kv``, so every
``write_and_attend``). While either is plugged, the cpu backend's C++ attention steps aside
(``cpu_attention_rows``) and ``torch_attention`` attends.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minillm import seams
from minillm.kernels.cpu import attention as cpu_kernel
from minillm.kernels.paged_decode_attention import tree_key_mask
from minillm.kernels.store_kv import store_kv_ref


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32, including this step's tokens
    block_size: int
    # Host-side copies, built by the runner with the step: planning a layer (which rows,
    # which blocks, how long) must never read a device tensor back, or every layer of
    # every step waits for the device to drain its queue.
    query_lens_list: list[int]
    context_lens_list: list[int]
    query_start_loc_list: list[int] | None = None  # None: derived from query_lens_list
    block_tables_list: list[list[int]] | None = None  # None: read once from block_tables
    plan: dict = field(default_factory=dict)  # per-step index tensors, built once, reused by every layer
    # Candidate trees (speculative verification, spec_decode/tree.py), or None: per query token,
    # the first key of its tree's nodes and the bits of the nodes it may read there
    # (``kernels.paged_decode_attention.tree_key_mask``); a token outside a tree has
    # tree_start past its own position. Device tensors [T] int32 / int64 and host lists.
    tree_start: torch.Tensor | None = None
    tree_bits: torch.Tensor | None = None
    tree_start_list: list[int] | None = None
    tree_bits_list: list[int] | None = None

    def __post_init__(self) -> None:
        if self.query_start_loc_list is None:
            starts = [0]
            for n in self.query_lens_list:
                starts.append(starts[-1] + n)
            self.query_start_loc_list = starts

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_list)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_list)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """This step's K/V into the cache: the oracle's write itself (``store_kv_ref``), for a step
    without padding tokens. k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D].
    A learner's ``store_kv_triton`` (chapter 3) writes instead while one is plugged in."""
    mine = seams.plugged("store_kv_triton")  # a learner's Triton K/V store (chapter 3), when plugged in
    if mine is not None:
        return plugged_store_kv(mine, k, v, k_cache, v_cache, slot_mapping)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, padded=False)


def triton_interprets() -> bool:
    """Whether ``@triton.jit`` makes interpreted kernels now: TRITON_INTERPRET as triton reads it."""
    try:
        from triton import knobs
    except ImportError:  # an older triton (or none): the variable itself
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    return bool(knobs.runtime.interpret)


NEEDS_INTERPRETER = (
    "store_kv_triton is plugged in and this step's tensors are on the CPU, where a Triton kernel runs "
    "only in Triton's interpreter: set TRITON_INTERPRET=1 before importing triton, minillm or your "
    "exercise module (triton picks interpreted or compiled when @triton.jit runs, at import; in a "
    "notebook: restart the kernel, set it in the first cell), or run the engine on a GPU")


def plugged_store_kv(mine, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> None:
    """A plugged ``store_kv_triton`` writes this step's K/V (the seam of ``write_kv`` and
    ``triton_write_kv``). On the CPU a Triton kernel runs only in the interpreter: without it,
    or with a kernel defined before it was switched on, a ValueError says what to set and when,
    instead of Triton's driver error."""
    on_cpu = k_cache.device.type == "cpu"
    if on_cpu and not triton_interprets():
        raise ValueError(NEEDS_INTERPRETER)
    try:
        mine(k, v, k_cache, v_cache, slot_mapping)
    except RuntimeError as e:
        if on_cpu and "active drivers" in str(e):  # a compiled-mode kernel launched without a GPU
            raise ValueError(f"{NEEDS_INTERPRETER}. Here TRITON_INTERPRET is set, but the kernel was "
                             f"defined before it was ({type(e).__name__}: {e})") from e
        raise
    _check_stored(k, v, k_cache, v_cache, slot_mapping)


def _check_stored(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """After a plugged ``store_kv_triton``, before any query attends: cache row ``slot_mapping[t]``
    holds ``k[t]`` (``v[t]``) exactly, so wrong K/V never reaches the output unnoticed. Only the
    written rows are read (a gather of T rows), not the whole cache."""
    H, D = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping.long()
    tokens = (slots >= 0).nonzero().flatten()  # [T'] the tokens that are not padding
    rows = slots[tokens]
    for name, src, cache in (("k", k, k_cache), ("v", v, v_cache)):
        stored = cache.view(-1, H, D).index_select(0, rows)  # [T', H, D]
        wrong = (stored != src.index_select(0, tokens)).flatten(1).any(1)  # [T']
        if bool(wrong.any()):
            i = int(wrong.nonzero()[0])
            t, slot = int(tokens[i]), int(rows[i])
            heads = (stored[i] != src[t]).any(-1).nonzero().flatten().tolist()
            raise seams.SeamContractError(
                "store_kv_triton", f"after the write, cache row slot_mapping[t] holds {name}[t]",
                f"{int(wrong.sum())} of {len(rows)} tokens differ; first token {t} (slot {slot}): "
                f"{name}_cache row {slot} differs from {name}[{t}] in heads {heads}")


def _gather_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    # positions [...] -> slots [...] through one sequence's (or a batch's) block table
    return block_table.gather(-1, positions // block_size).long() * block_size + positions % block_size


def _row_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, b: int):
    """K, V [Hkv, ctx, D] of sequence b: exactly its own context, nothing padded.

    A view when the context sits in one block (always so for the contiguous engines);
    otherwise a gather through the block table, whose indices are built once per step
    and reused by every layer.
    """
    ctx = meta.context_lens_list[b]
    plan = meta.plan
    if meta.block_tables_list is None:  # metadata built by hand (tests, notebooks): one read per step
        meta.block_tables_list = meta.block_tables.tolist()
    if ctx <= meta.block_size:
        blk = meta.block_tables_list[b][0]
        return k_cache[blk, :ctx].transpose(0, 1), v_cache[blk, :ctx].transpose(0, 1)
    key = ("slots", b)
    if key not in plan:
        pos = torch.arange(ctx, device=k_cache.device)
        plan[key] = _gather_slots(meta.block_tables[b], pos, meta.block_size)  # [ctx]
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    slots = plan[key]
    # index_select, not advanced indexing (cache[slots]): the same copy, ~3x faster on a CPU
    # (advanced indexing goes through the general index kernel; this is a plain row gather).
    k = k_cache.view(-1, Hkv, D).index_select(0, slots)  # [ctx, Hkv, D]
    v = v_cache.view(-1, Hkv, D).index_select(0, slots)
    return k.transpose(0, 1), v.transpose(0, 1)


# Decode rows that attend together in one SDPA call (``decode_groups``): a group pays one
# call instead of one per row, and pads every row to the group's longest context. Padding
# costs a gather and attention over masked keys; a call costs tens of microseconds of
# dispatch, about what a couple of hundred keys of padding cost. A row joins the group
# before it while the padding stays under this many keys, or a quarter of the real ones.
GROUP_PAD_KEYS = 256


def decode_groups(query_lens: list[int], context_lens: list[int], pad_keys: int = GROUP_PAD_KEYS):
    """Runs of adjacent decode rows that attend in one call: [(first row, rows, longest context)].

    Rows with more than one query (prefill, chunks, drafts) are never grouped. Adjacent
    rows only, so a group's queries, outputs, block tables and lengths are slices of the
    step's tensors (no index to upload). A run is split where padding to its longest
    context would cost more than ``pad_keys`` keys and a quarter of its real ones.
    """
    groups = []
    start, longest, real = None, 0, 0
    for b, (n, ctx) in enumerate(zip(query_lens, context_lens)):
        if n == 1 and start is not None:
            g = b - start + 1
            L = max(longest, ctx)
            if g * L - (real + ctx) <= max(pad_keys, (real + ctx) // 4):
                longest, real = L, real + ctx
                continue
        if start is not None:
            groups.append((start, b - start, longest))
            start = None
        if n == 1:
            start, longest, real = b, ctx, ctx
    if start is not None:
        groups.append((start, len(query_lens) - start, longest))
    return groups


def _group_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, b0: int, g: int, L: int):
    """K, V [g, Hkv, L, D] of rows b0 .. b0+g-1 padded to L keys, and the mask of real keys [g, 1, 1, L].

    Padding keys repeat the row's last real key (a valid slot), and the mask hides them.
    The slots and the mask are built once per step on the device (from the uploaded block
    tables and context lengths) and reused by every layer.
    """
    key = ("group", b0)
    plan = meta.plan
    if key not in plan:
        ctx = meta.context_lens[b0:b0 + g].long()  # [g]
        pos = torch.arange(L, device=k_cache.device)
        clamped = torch.minimum(pos[None, :], ctx[:, None] - 1)  # [g, L]
        slots = _gather_slots(meta.block_tables[b0:b0 + g], clamped, meta.block_size).reshape(-1)
        plan[key] = (slots, (pos[None, :] < ctx[:, None])[:, None, None, :])
    slots, mask = plan[key]
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, Hkv, D).index_select(0, slots).view(g, L, Hkv, D).transpose(1, 2)
    v = v_cache.view(-1, Hkv, D).index_select(0, slots).view(g, L, Hkv, D).transpose(1, 2)
    return k, v, mask


def torch_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Readable paged attention: each sequence attends to exactly its own cached keys.

    q: [T, Hq, D] -> out [T, Hq, D]. A decode row (one query) needs no causal mask; a
    multi-token row (prefill, a prefill chunk, speculative verification) gets the causal
    mask shifted by its context offset, in an SDPA call of its own, over exactly its
    context. Adjacent decode rows of similar length share one call (``decode_groups``),
    each padded to the group's longest context with the padding masked out: the same
    attention, in one call instead of one per row (what a decode step of many short
    requests spends its time on). A lone decode row attends over exactly its keys.
    """
    out = torch.empty_like(q)
    T, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    group = Hq // Hkv
    starts = meta.query_start_loc_list
    decode_seam = seams.plugged("paged_decode_attention")  # a learner's decode attention (chapter 3)
    grouped: dict[int, tuple[int, int]] = {}  # first row -> (rows, longest context), planned once per step
    if decode_seam is None:
        if "groups" not in meta.plan:
            meta.plan["groups"] = {b0: (g, L) for b0, g, L in
                                   decode_groups(meta.query_lens_list, meta.context_lens_list) if g > 1}
        grouped = meta.plan["groups"]
    skip_to = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_list, meta.context_lens_list)):
        if n == 0 or b < skip_to:
            continue
        s = starts[b]
        if b in grouped:
            g, L = grouped[b]
            k, v, mask = _group_kv(k_cache, v_cache, meta, b, g, L)  # [g, Hkv, L, D]
            qg = q[s:s + g].view(g, Hkv, group, D)
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)  # [g, Hkv, group, D]
            out[s:s + g] = o.view(g, Hq, D)
            skip_to = b + g
            continue
        if n == 1 and decode_seam is not None:
            if meta.block_tables_list is None:
                meta.block_tables_list = meta.block_tables.tolist()
            row = decode_seam(q[s], k_cache, v_cache, list(meta.block_tables_list[b]), ctx, scale)
            out[s] = _checked_decode_row(row, q[s], ctx)
            continue
        k, v = _row_kv(k_cache, v_cache, meta, b)  # [Hkv, ctx, D] each
        # Calls are 4-D ([1, heads, queries, D]): that is the shape torch's fused CPU kernel
        # takes (a 3-D call falls back to the unfused math, 2-3x slower here).
        if n == 1:
            # GQA without copying K/V: the `group` query heads that share a KV head
            # become `group` query rows against that head's keys.
            qg = q[s].view(1, Hkv, group, D)  # [1, Hkv, group, D]
            out[s] = F.scaled_dot_product_attention(qg, k[None], v[None], scale=scale).reshape(Hq, D)
            continue
        qs = q[s:s + n].transpose(0, 1)[None]  # [1, Hq, n, D]; enable_gqa: query head h reads KV head h // group
        if meta.tree_start is not None:  # a candidate tree's nodes (or any row of a step that has one)
            pos = torch.arange(ctx, device=q.device)
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = (pos[None, :] <= qpos[:, None]) & tree_key_mask(pos, meta.tree_start[s:s + n], meta.tree_bits[s:s + n])
            o = F.scaled_dot_product_attention(qs, k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True)
        elif ctx == n:  # whole prompt at once: the plain causal mask
            o = F.scaled_dot_product_attention(qs, k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        else:  # a chunk after cached context: query j sees keys <= ctx - n + j
            pos = torch.arange(ctx, device=q.device)
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            o = F.scaled_dot_product_attention(qs, k[None], v[None], attn_mask=pos[None, :] <= qpos[:, None],
                                               scale=scale, enable_gqa=True)
        out[s:s + n] = o[0].transpose(0, 1)
    return out


def _checked_decode_row(got, q_row: torch.Tensor, context_len: int) -> torch.Tensor:
    """A plugged ``paged_decode_attention``'s output for one decode row, checked before the layer
    uses it: [Hq, D] as the query, and finite (attention over finite keys and values is a weighted
    mean of the values; a NaN here would spread through every later layer)."""
    call = f"paged_decode_attention(q [{q_row.shape[0]}, {q_row.shape[1]}], context_len {context_len})"
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(q_row.shape):
        shown = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise seams.SeamContractError("paged_decode_attention", "the output is [Hq, D], as the query",
                                      f"{call} returned {shown}")
    if not bool(torch.isfinite(got).all()):
        bad = int((~torch.isfinite(got)).sum())
        raise seams.SeamContractError("paged_decode_attention", "the output is finite (a softmax-weighted mean "
                                      "of the values)", f"{call} returned {bad} of {got.numel()} values inf or NaN")
    return got.to(q_row.dtype)


def cpu_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``torch_attention`` with every query of the step in one call of the CPU kernel
    (``minillm/kernels/cpu/attention.py``). A row of several queries (a prefill, a chunk,
    drafts to verify) enters the kernel as that many one-query rows, query j of the row
    seeing its sequence's keys up to its own position: the causal mask, by construction
    (``cpu_attention_rows``). A learner's plugged decode attention or K/V store, or a dtype
    the kernel does not take (float16), runs ``torch_attention``.

    The ``cpu`` backend's entry in ``BACKENDS``: the model's layer loop and a compiled step's
    attention op call it. ``model.Llama._cpu_layers`` takes the same route with the same rows
    (``cpu_attention_rows``), bound once per forward (``kernels.cpu.layer_ops.ForwardOps.attend``)."""
    rows = cpu_attention_rows(meta, q.dtype)
    if rows is None:
        return torch_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    rows(q, k_cache, v_cache, scale, out)
    return out


def cpu_attention_rows(meta: AttentionMetadata, dtype: torch.dtype):
    """The step's queries as the CPU kernel's rows (an ``AttentionRows``), built once per step
    and reused by every layer; None where the kernel does not attend this step (a ``dtype`` it
    does not take, or a learner's decode attention or K/V store plugged in, chapter 3):
    ``torch_attention`` does. One row per query token, with its sequence's block table and its
    own number of keys.
    Query j of a sequence with n queries and ctx keys (this step's included) sees keys
    0 .. ctx - n + j, as ``torch_attention``'s shifted causal mask lets it.

    Each token is a row of its own, so its attention does not depend on how its prompt was cut
    into chunks or on the other rows of the step: the kernel gives a row the same bits alone or
    in any batch (tests/test_cpu_attention.py).
    """
    if (dtype not in cpu_kernel.DTYPES or seams.plugged("paged_decode_attention") is not None
            or seams.plugged("store_kv_triton") is not None):  # a learner's attention or K/V store (chapter 3)
        return None
    plan = meta.plan
    if "cpu_rows" not in plan:
        qlens = torch.tensor(meta.query_lens_list, dtype=torch.int64)
        B = qlens.shape[0]
        seq = torch.repeat_interleave(torch.arange(B), qlens)  # [R] the sequence of each row
        j = torch.arange(seq.shape[0]) - (torch.cumsum(qlens, 0) - qlens)[seq]  # index within its sequence
        starts = torch.tensor(meta.query_start_loc_list[:B], dtype=torch.int64)
        ctx = torch.tensor(meta.context_lens_list, dtype=torch.int64)[seq] - qlens[seq] + j + 1
        rows = torch.stack([torch.arange(seq.shape[0]), starts[seq] + j], 1)  # (table row, token)
        table = meta.block_tables.to("cpu", torch.int32)[seq]  # [R, max_blocks] each row's sequence's table
        tree = {}
        if meta.tree_start_list is not None:  # per query row: the candidate tree's mask (rows are tokens, in order)
            tree = dict(tree_start=torch.tensor(meta.tree_start_list, dtype=torch.int32),
                        tree_bits=torch.tensor(meta.tree_bits_list, dtype=torch.int64))
        plan["cpu_rows"] = cpu_kernel.AttentionRows(table, ctx.to(torch.int32), rows, **tree)
    return plan["cpu_rows"]


def triton_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The same contract through the Triton kernels in ``minillm/kernels/``."""
    from minillm.kernels.paged_decode_attention import paged_decode_attention
    from minillm.kernels.paged_prefill_attention import paged_prefill_attention

    if meta.is_pure_decode:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale)
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                   meta.context_lens, scale, max_query_len=max(meta.query_lens_list),
                                   tree_start=meta.tree_start, tree_bits=meta.tree_bits)


def triton_write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The triton backend's write: the library's kernel, or a learner's plugged ``store_kv_triton``."""
    mine = seams.plugged("store_kv_triton")  # a learner's Triton K/V store (chapter 3), when plugged in
    if mine is not None:
        return plugged_store_kv(mine, k, v, k_cache, v_cache, slot_mapping)
    from minillm.kernels.store_kv import store_kv

    store_kv(k, v, k_cache, v_cache, slot_mapping)


def write_and_attend(backend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's attention through ``backend`` (a ``BACKENDS`` pair): this step's K/V join
    the layer's cache first (every backend's write is ``store_kv_triton``'s seam), then every
    query attends over its sequence's cached keys."""
    write, attend = backend
    k_cache, v_cache = kv_cache
    write(k, v, k_cache, v_cache, meta.slot_mapping)
    return attend(q, k_cache, v_cache, meta, scale)  # [T, Hq, D]


BACKENDS = {
    "torch": (write_kv, torch_attention),
    "cpu": (write_kv, cpu_attention),
    "triton": (triton_write_kv, triton_attention),
}
