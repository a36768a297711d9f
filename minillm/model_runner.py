"""From "these requests, this many tokens each" to one forward pass and its logits.

The scheduler hands over rows ``(request, num_new_tokens)``. The runner lays the new
tokens of all rows end to end and builds the flat tensors of design.md §2:

    input_ids[T], positions[T], slot_mapping[T],
    block_tables[B, max_blocks], query_start_loc[B+1], context_lens[B]

then runs the model once and computes logits only where a row samples (its last new
token reaches the end of what the request knows).

A row may also carry *drafted* tokens (speculative decoding, ``minillm/spec/``): they
are fed after the known ones, and the row gets logits at its last known token and at
every draft, the k + 1 distributions that verify k drafts in this one forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .attention import AttentionMetadata
from .block_manager import slots_for  # token position -> cache slot through a block table
from .config import ModelConfig
from .request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens fed this step, starting at request.num_computed_tokens (drafts included)
    spec_token_ids: list[int] = field(default_factory=list)  # drafted tokens, fed after the known ones

    @property
    def num_known_tokens(self) -> int:
        """Tokens fed from ``request.all_token_ids`` (the rest are drafts)."""
        return self.num_new_tokens - len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        r = self.request
        return r.num_computed_tokens + self.num_known_tokens == r.num_tokens

    @property
    def num_logits(self) -> int:
        """Logits rows this row gets: 1 + its drafts if it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, device: torch.device,
                      dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
            for _ in range(cfg.num_layers)]


def kv_cache_bytes(kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv_caches)


def build_batch(rows: list[ScheduledRequest], block_size: int, device: torch.device):
    """Flat step inputs for ``rows``: (input_ids, positions, meta, sample_rows, logits_index).

    ``logits_index`` [S] holds the index in [T] of every token whose logits are needed:
    the last token of each sampling row, or its last 1 + len(spec_token_ids) tokens.
    """
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qstart = [0]
    ctx: list[int] = []
    qlens: list[int] = []
    logits_index: list[int] = []  # indices in [T] of the tokens that need logits
    sample_rows: list[int] = []
    for i, row in enumerate(rows):
        r, n = row.request, row.num_new_tokens
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        ids.extend(r.all_token_ids[start:start + row.num_known_tokens])
        ids.extend(row.spec_token_ids)
        pos.extend(range(start, end))
        slots.extend(slots_for(r.block_ids, block_size, start, end))
        qstart.append(qstart[-1] + n)
        ctx.append(end)
        qlens.append(n)
        if row.samples:
            sample_rows.append(i)
            logits_index.extend(range(qstart[-1] - row.num_logits, qstart[-1]))
    width = max((len(r.request.block_ids) for r in rows), default=1)
    tables = [r.request.block_ids + [0] * (width - len(r.request.block_ids)) for r in rows]
    as_t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    meta = AttentionMetadata(
        slot_mapping=as_t(slots, torch.long),
        block_tables=as_t(tables, torch.int32),
        query_start_loc=as_t(qstart, torch.int32),
        context_lens=as_t(ctx, torch.int32),
        block_size=block_size,
        query_lens_list=qlens,
        context_lens_list=ctx,
    )
    return as_t(ids, torch.long), as_t(pos, torch.long), meta, sample_rows, as_t(logits_index, torch.long)


class ModelRunner:
    """Owns the model and its KV cache; runs one step's forward."""

    def __init__(self, model, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = device
        self.kv_caches = allocate_kv_cache(cfg, num_blocks, block_size, device, dtype)

    @property
    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.kv_caches)

    @torch.inference_mode()
    def execute(self, rows: list[ScheduledRequest]) -> tuple[torch.Tensor, list[int]]:
        """One forward over ``rows`` -> (logits [S, V] float32, indices of the sampling rows).

        One logits row per sampling row, in row order; a row carrying drafts gets
        ``1 + len(spec_token_ids)`` consecutive ones (``ScheduledRequest.num_logits``).
        """
        input_ids, positions, meta, sample_rows, logits_idx = build_batch(rows, self.block_size, self.device)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)  # [T, hidden]
        logits = self.model.compute_logits(hidden[logits_idx])  # [S, V]
        return logits, sample_rows


@torch.inference_mode()
def prompt_logits(model, token_ids: list[int], chunk_size: int | None = None,
                  block_size: int = 16) -> torch.Tensor:
    """Logits at every position of one prompt: [len(token_ids), vocab] float32.

    Runs the same flat varlen path as the engines, on a private paged cache, feeding the
    prompt whole or in chunks of ``chunk_size`` tokens (each chunk attends to the cached
    ones before it). Used to compare our forward with transformers'.
    """
    p = next(model.parameters())
    n = len(token_ids)
    num_blocks = -(-n // block_size)
    caches = allocate_kv_cache(model.cfg, num_blocks, block_size, p.device, p.dtype)
    from .sampling import SamplingParams

    req = Request("prompt_logits", list(token_ids), SamplingParams())
    req.block_ids = list(range(num_blocks))
    out = []
    step = chunk_size or n
    while req.num_computed_tokens < n:
        k = min(step, n - req.num_computed_tokens)
        ids, pos, meta, _, _ = build_batch([ScheduledRequest(req, k)], block_size, p.device)
        out.append(model.compute_logits(model(ids, pos, meta, caches)))
        req.num_computed_tokens += k
    return torch.cat(out)
