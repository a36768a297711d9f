"""Speculative decoding inside the paged engine: draft -> one verifying forward -> roll back.

One engine step with speculation (``Speculator.step`` then ``update_verified``):

    1. schedule            the paged scheduler's rows, as without speculation
    2. plan                each decoding row gets a draft limit: k (adaptive per request),
                           cut by max_tokens, max_model_len, the token budget left after
                           the scheduled rows, and the free blocks. Blocks for the drafts
                           are taken now (drafts never preempt anyone).
    3. propose             the drafter fills row.spec_token_ids (<= limit tokens)
    4. verify              ONE target forward: each row feeds its known token + its drafts
                           (k + 1 query tokens through the varlen paged path) and gets
                           k + 1 logits rows; ``rejection_sample`` turns them into 1..k+1
                           tokens per row, exactly distributed as the target's samples
    5. update_verified     append the emitted tokens one by one with stop checks (a stop
                           in the middle of an accepted run drops the rest); the K/V of
                           rejected drafts is rolled back: num_computed_tokens counts the
                           known tokens and the accepted drafts only, and the trailing
                           blocks no longer needed are freed

Rows that do not draft (prefills, a request whose n-gram found nothing, everything
while the off switch is on) go through the same forward and plain sampling.

Random numbers: row by row, each request draws only from its own generator, and a
request with s drafts always draws s uniforms and V exponentials, so its stream does
not depend on what else is in the batch.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..config import SpeculativeConfig
from ..model_runner import ModelRunner
from ..request import Request
from ..sampling import sample
from ..scheduler.base import SchedulerOutput
from . import policy
from .rejection_sampler import rejection_sample, target_probs_from_logits

RejectionSampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SpecStats:
    """Counters of a speculative engine (``engine.spec_stats``), read by the benchmark."""

    target_forwards: int = 0  # every forward of the target model, speculative or not
    draft_forwards: int = 0  # forwards of the draft model (0 for n-gram)
    spec_steps: int = 0  # target forwards that verified at least one draft
    num_drafts: int = 0  # drafted tokens sent to verification
    num_accepted: int = 0  # ... of which the target accepted
    verify_rows: int = 0  # (request, forward) pairs that verified >= 1 draft
    decode_rows: int = 0  # (request, forward) pairs in which a request decoded, drafts or not
    decode_tokens: int = 0  # tokens emitted by those rows

    @property
    def acceptance_rate(self) -> float | None:
        """alpha, measured: accepted drafts / drafts."""
        return self.num_accepted / self.num_drafts if self.num_drafts else None

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Accepted drafts per verification of one request."""
        return self.num_accepted / self.verify_rows if self.verify_rows else None

    @property
    def tokens_per_target_forward(self) -> float | None:
        """Tokens a decoding request gains per target forward (1.0 without speculation)."""
        return self.decode_tokens / self.decode_rows if self.decode_rows else None

    def as_dict(self) -> dict[str, Any]:
        return dict(acceptance_rate=self.acceptance_rate, mean_accepted_tokens=self.mean_accepted_tokens,
                    tokens_per_target_forward=self.tokens_per_target_forward,
                    target_forwards=self.target_forwards, draft_forwards=self.draft_forwards,
                    spec_steps=self.spec_steps, num_drafts=self.num_drafts, num_accepted=self.num_accepted,
                    verify_rows=self.verify_rows, decode_rows=self.decode_rows, decode_tokens=self.decode_tokens)


@dataclass(slots=True)
class _RequestState:
    k: int  # this request's current number of speculative tokens
    history: deque = field(default_factory=lambda: deque(maxlen=policy.HISTORY))  # (drafts, accepted)


class Speculator:
    """Drafting, verification and roll-back for one paged engine."""

    def __init__(self, config: SpeculativeConfig, drafter: Any, runner: ModelRunner, scheduler: Any):
        self.config = config
        self.drafter = drafter
        self.runner = runner
        self.scheduler = scheduler
        self.stats = SpecStats()
        self.rejection_sampler: RejectionSampler = rejection_sample  # the exactness test swaps in a wrong one
        self.requests: dict[Request, _RequestState] = {}
        self.draft_probs: dict[int, torch.Tensor] = {}  # row index -> q [s, V], this step only

    def reset_stats(self) -> None:
        """Start the counters afresh (e.g. after a warm-up run)."""
        self.stats = SpecStats()

    # -- 2-3. plan and propose ---------------------------------------------------------
    def _state(self, r: Request) -> _RequestState:
        if r not in self.requests:
            self.requests[r] = _RequestState(self.config.num_speculative_tokens)
        return self.requests[r]

    def propose(self, out: SchedulerOutput) -> int:
        """Attach drafts to the decoding rows of ``out``, blocks included. Returns the number of drafts."""
        self.draft_probs = {}
        decoding = [i for i, row in enumerate(out.rows) if row.samples and row.num_new_tokens == 1]
        if not decoding or not policy.speculation_enabled(len(self.scheduler.running),
                                                         self.config.disable_by_batch_size):
            return 0
        bm = self.scheduler.block_manager
        budget = self.scheduler.max_num_batched_tokens - out.num_tokens
        limits = []
        for i in decoding:
            r = out.rows[i].request
            k = policy.num_drafts_allowed(self._state(r).k, r.num_output_tokens, r.sampling_params.max_tokens,
                                          r.num_tokens, self.scheduler.max_model_len, budget)
            while k > 0 and not bm.can_grow(r, r.num_tokens + k):  # drafts only use free blocks
                k -= 1
            bm.grow(r, r.num_tokens + k)
            budget -= k
            limits.append(k)
        if not any(limits):
            return 0
        before = self.drafter.num_forwards
        drafts, probs = self.drafter.propose([out.rows[i].request for i in decoding], limits)
        self.stats.draft_forwards += self.drafter.num_forwards - before
        for j, (i, d) in enumerate(zip(decoding, drafts)):
            row = out.rows[i]
            row.spec_token_ids = list(d)
            row.num_new_tokens += len(d)
            if len(d) < limits[j]:  # the drafter found fewer: give back the blocks it did not need
                bm.shrink(row.request, row.request.num_tokens + len(d))
            if probs is not None and d:
                self.draft_probs[i] = probs[j]
        return sum(len(d) for d in drafts)

    # -- 4. verify -------------------------------------------------------------------------
    def step(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Propose, run the one target forward, verify. Returns row index -> emitted tokens."""
        self.propose(out)
        logits, sample_rows = self.runner.execute(out.rows)  # [sum of num_logits, V]
        self.stats.target_forwards += 1
        return self.verify(out, logits, sample_rows)

    def verify(self, out: SchedulerOutput, logits: torch.Tensor, sample_rows: list[int]) -> dict[int, list[int]]:
        """Rejection-sample every sampling row; rows grouped by their number of drafts s."""
        groups: dict[int, list[tuple[int, int]]] = defaultdict(list)  # s -> [(row index, first logits row)]
        offset = 0
        for i in sample_rows:
            s = len(out.rows[i].spec_token_ids)
            groups[s].append((i, offset))
            offset += 1 + s
        emitted: dict[int, list[int]] = {}
        for s, members in groups.items():
            reqs = [out.rows[i].request for i, _ in members]
            params = [r.sampling_params for r in reqs]
            gens = [r.generator for r in reqs]
            index = torch.tensor([[o + j for j in range(s + 1)] for _, o in members], device=logits.device)
            if s == 0:  # nothing to verify: the plain sampler
                tokens = sample(logits[index[:, 0]], params, gens)
                for (i, _), t in zip(members, tokens.tolist()):
                    emitted[i] = [t]
                continue
            p = target_probs_from_logits(logits[index], params)  # [G, s+1, V]
            d = torch.tensor([out.rows[i].spec_token_ids for i, _ in members], device=logits.device)  # [G, s]
            q = None if self.drafter.deterministic else torch.stack([self.draft_probs[i] for i, _ in members])
            tokens, num = self.rejection_sampler(d, q, p, gens)  # [G, s+1], [G]
            for (i, _), row, n in zip(members, tokens.tolist(), num.tolist()):
                emitted[i] = row[:n]
        self._count(out, emitted)
        return emitted

    def _count(self, out: SchedulerOutput, emitted: dict[int, list[int]]) -> None:
        st = self.stats
        for i, toks in emitted.items():
            row = out.rows[i]
            if row.num_known_tokens != 1:  # a prefill's first token: not a decode
                continue
            st.decode_rows += 1
            st.decode_tokens += len(toks)
            s = len(row.spec_token_ids)
            if s:
                st.verify_rows += 1
                st.num_drafts += s
                st.num_accepted += len(toks) - 1
                state = self._state(row.request)
                state.history.append((s, len(toks) - 1))
                if self.config.adaptive:
                    state.k = policy.next_num_speculative_tokens(
                        state.k, policy.recent_acceptance(state.history), self.config.num_speculative_tokens)
        st.spec_steps += any(out.rows[i].spec_token_ids for i in emitted)

    # -- 5. update and roll back -------------------------------------------------------------
    def update(self, out: SchedulerOutput, emitted: dict[int, list[int]], now: float) -> list[Request]:
        finished = update_verified(self.scheduler, out, emitted, now)
        for row in out.rows:
            if row.spec_token_ids:
                self.drafter.rollback(row.request)
        for r in finished:
            self.forget(r)
        return finished

    def forget(self, request: Request) -> None:
        self.requests.pop(request, None)
        self.drafter.forget(request)


def update_verified(scheduler: Any, out: SchedulerOutput, emitted: dict[int, list[int]],
                    now: float) -> list[Request]:
    """The scheduler's update for rows that may emit several tokens. Returns finished requests.

    A row that fed n_known tokens and s drafts and emitted m tokens (m - 1 accepted
    drafts, then a residual or bonus token) has valid K/V for n_known + m - 1 tokens:
    the last emitted token is not in the cache yet, as after any sampling step. Each
    emitted token is checked for EOS / stop tokens / stop strings / max_tokens /
    max_model_len; the first stop finishes the request and drops what follows.
    """
    finished = []
    for i, row in enumerate(out.rows):
        r = row.request
        toks = emitted.get(i)
        if toks is None:  # a prefill chunk that does not reach the end of the prompt
            r.num_computed_tokens += row.num_new_tokens
            continue
        r.num_computed_tokens += row.num_known_tokens + len(toks) - 1
        for t in toks:  # stops are checked on every emitted token: the rest is dropped
            if scheduler.append_token(r, t, now):
                finished.append(r)
                break
        if row.spec_token_ids and not r.is_finished:  # rejected drafts: free their blocks
            scheduler.block_manager.shrink(r, r.num_computed_tokens)
    for r in finished:
        scheduler.running.remove(r)
        scheduler.free(r)
    return finished


__all__ = ["SpecStats", "Speculator", "update_verified"]
