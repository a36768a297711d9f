"""What a scheduler hands the rest of the step: which requests run, and how many tokens each.

Plain Python (no tensors), so schedulers, their tests and the simulator never import
torch or the model runner.

A *row* is one ``ScheduledRequest``: one request's share of this step's flat batch.
It feeds ``num_known_tokens`` tokens of ``request.all_token_ids`` starting at
``request.num_computed_tokens``, then (speculative decoding) up to ``max_drafts``
drafted tokens, for which the scheduler has already reserved KV space.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..request import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_known_tokens: int  # tokens fed from request.all_token_ids this step
    max_drafts: int = 0  # lookahead the scheduler reserved KV space for (speculative decoding)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts, fed after the known tokens
    draft_probs: Any = None  # [len(spec_token_ids), V]: the q each draft was sampled from (None: one-hot)
    # The drafts as the nodes of a candidate tree (spec_decode/tree.py TreeSpec, its nodes 1..N in
    # spec_token_ids' order), or None for a chain: node n sits at position root + depth, not root + n
    spec_tree: Any = None

    @property
    def num_new_tokens(self) -> int:
        """Every token this row feeds: the known ones, then the drafts."""
        return self.num_known_tokens + len(self.spec_token_ids)

    @property
    def samples(self) -> bool:
        """Does this row reach the end of what the request knows (so the model samples)?"""
        r = self.request
        return r.num_computed_tokens + self.num_known_tokens == r.num_tokens

    @property
    def num_logits(self) -> int:
        """Logits this row gets: 1 + its drafts if it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0


@dataclass(slots=True)
class SchedulerOutput:
    rows: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    padded_width: int | None = None  # static batching: the padded batch is [max_num_seqs, padded_width]
    # Prefix caching (chapter 6), for the admissions of this step: the tokens the admitted
    # requests needed K/V for (prompt, or prompt + outputs when recomputing after a
    # preemption), and how many of them the prefix cache already held.
    prefill_tokens_requested: int = 0
    prefix_hit_tokens: int = 0
    # The host KV tier (chapter 9): of prefix_hit_tokens, those restored from host memory, and
    # the copies between the tiers to make before this step's forward (kv_offload.KVCopies).
    host_hit_tokens: int = 0
    kv_copies: Any = None

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)


__all__ = ["ScheduledRequest", "SchedulerOutput"]
