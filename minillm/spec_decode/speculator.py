"""Speculative decoding inside the paged engine: propose drafts, verify them after the forward.

One engine step with speculation is the plain step with two more calls:

    1. schedule     the paged scheduler plans the rows, and gives each decoding row a
                    lookahead (``max_drafts``): k for this request (adaptive), cut by
                    max_tokens, max_model_len, the token budget left and the free
                    blocks, which it reserves now (``PagedScheduler._reserve_lookahead``)
    2. propose      the drafter fills ``row.spec_token_ids`` (at most ``max_drafts``)
    3. forward      ONE target forward: each row feeds its known token + its drafts and
                    gets k + 1 logits rows
    4. verify       ``coupled_verify`` turns them into 1..k+1 tokens per row: exactly
                    the tokens plain sampling would have drawn
    5. update       the scheduler's one ``update``: tokens appended with stop checks on
                    each, and the blocks of rejected drafts given back (``rollback``)

So the speculator owns no KV space and no model runner: it drafts into the space the
scheduler reserved and verifies the logits the runner handed back.

Random numbers: none comes from a running stream. The noise of the token that lands at
position p of a request is a function of (request seed, p) (``sampling.position_noise``),
and the plain sampler, the draft model and the verifier all use it for that position.
The verifier emits y_p = argmax(p_p / E_p) -- plain sampling's token -- wherever the
walk reaches, so a seeded request's output is the same with or without speculation,
alone or in any batch: how many drafts a step makes depends on the batch (the off
switch, the token budget, free blocks), and with a stream it would shift every later
random number. With a deterministic drafter this walk is exactly the rejection rule of
chapter 5 (``rejection_sample``); with a sampling drafter it accepts less often
(``rejection_sampler.coupled_acceptance_rate``).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import SpeculativeConfig
from ..model_runner import ModelOutput
from ..request import Request
from ..sampling import noise_for_rows, sample_at
from ..scheduler.output import SchedulerOutput
from . import policy
from .. import seams
from .rejection_sampler import coupled_verify, per_row_verifier, target_probs_from_logits
from .tree import walk_tree

# (draft_token_ids [G, s], target_probs [G, s+1, V], noise [G, s+1, V]) -> (tokens [G, s+1], num [G])
Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SpecStats:
    """Counters of a speculative engine (``engine.spec_stats``), read by the benchmark."""

    target_forwards: int = 0  # every forward of the target model, speculative or not
    draft_forwards: int = 0  # forwards of the draft model (0 for n-gram)
    spec_steps: int = 0  # target forwards that verified at least one draft
    num_drafts: int = 0  # drafted tokens sent to verification
    num_accepted: int = 0  # ... of which the target accepted
    num_checked: int = 0  # drafts the walk reached: accepted ones + the first rejected one
    verify_rows: int = 0  # (request, forward) pairs that verified >= 1 draft
    decode_rows: int = 0  # (request, forward) pairs in which a request decoded, drafts or not
    decode_tokens: int = 0  # tokens emitted by those rows

    @property
    def acceptance_rate(self) -> float | None:
        """alpha, the chance that one draft is accepted: accepted / drafts the walk reached.

        Verification stops at the first rejection, so the drafts after it are never
        judged; counting them (``draft_acceptance_ratio``) biases alpha low: with
        alpha = 0.8 and k = 4 that ratio reads about 0.59. Counting each verification's
        accepted drafts plus its one rejection (if any) is the estimator the formula
        E[tokens] = (1 - alpha^(k+1)) / (1 - alpha) needs.
        """
        return self.num_accepted / self.num_checked if self.num_checked else None

    @property
    def draft_acceptance_ratio(self) -> float | None:
        """Accepted drafts / all drafts sent (what share of the drafting work was kept)."""
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
        return dict(acceptance_rate=self.acceptance_rate, draft_acceptance_ratio=self.draft_acceptance_ratio,
                    mean_accepted_tokens=self.mean_accepted_tokens, num_checked=self.num_checked,
                    tokens_per_target_forward=self.tokens_per_target_forward,
                    target_forwards=self.target_forwards, draft_forwards=self.draft_forwards,
                    spec_steps=self.spec_steps, num_drafts=self.num_drafts, num_accepted=self.num_accepted,
                    verify_rows=self.verify_rows, decode_rows=self.decode_rows, decode_tokens=self.decode_tokens)


class Speculator:
    """Drafting and verification for one paged engine (no KV space, no runner of its own)."""

    def __init__(self, config: SpeculativeConfig, drafter: Any):
        self.config = config
        self.drafter = drafter
        self.stats = SpecStats()
        self.verifier: Verifier = coupled_verify  # the exactness test swaps in a wrong one
        self.requests: dict[Request, deque] = {}  # recent (drafts, accepted) per request, for adaptive k
        # K/V to move after a candidate tree's verification: (request, from position, to position).
        # The accepted path's nodes were written in node order; the engine moves them to where the
        # path's tokens now sit (``take_kv_moves``, ``ModelRunner.move_kv``) before the blocks past
        # them are given back.
        self.kv_moves: list[tuple[Request, int, int]] = []

    def reset_stats(self) -> None:
        """Start the counters afresh (e.g. after a warm-up run)."""
        self.stats = SpecStats()

    # -- 2. propose ----------------------------------------------------------------
    def propose(self, out: SchedulerOutput) -> int:
        """Fill each row's reserved lookahead with drafts. Returns the number of drafts."""
        rows = [row for row in out.rows if row.max_drafts > 0]
        if not rows:
            return 0
        before = self.drafter.num_forwards
        drafts, probs = self.drafter.propose([row.request for row in rows], [row.max_drafts for row in rows])
        self.stats.draft_forwards += self.drafter.num_forwards - before
        tree = getattr(self.drafter, "tree", None)  # a candidate tree: the drafts are its first nodes
        for j, (row, d) in enumerate(zip(rows, drafts)):
            row.spec_token_ids = list(d)
            if probs is not None and d:
                row.draft_probs = probs[j]
            if tree is not None and d:
                row.spec_tree = tree.prefix(len(d))
        return sum(len(d) for d in drafts)

    # -- 4. verify ---------------------------------------------------------------------
    def verify(self, out: SchedulerOutput, model_out: ModelOutput) -> dict[int, list[int]]:
        """Verify every sampling row -> row index -> emitted tokens.

        Rows are grouped by their number of drafts s, so each group is one batched call.
        A row's logits j predict the token at position ``request.num_tokens + j``: its
        noise comes from there.

        Host traffic: none until the end. Logits rows and their sampling parameters (the
        step's upload carries them) are picked by slicing with host offsets, the drafts are
        read from the step's input_ids already on the device, and every group's
        (tokens, count) lands in one tensor that is read back once.
        """
        self.stats.target_forwards += 1
        logits = model_out.logits
        rule = seams.plugged("rejection_sample_one")  # a learner's rule, one request at a time (chapter 5)
        verifier = self.verifier if rule is None else per_row_verifier(rule)
        groups: dict[int, list[tuple[int, int, int | None]]] = defaultdict(list)  # s -> [(row, logits row, token)]
        starts_t = model_out.token_starts or [None] * len(model_out.rows)
        trees: list[tuple[int, int]] = []  # (row, logits row) of the rows that verify a candidate tree
        for i, offset, t0 in zip(model_out.rows, model_out.offsets, starts_t):
            if out.rows[i].spec_tree is not None:
                trees.append((i, offset))
            else:
                groups[len(out.rows[i].spec_token_ids)].append((i, offset, t0))
        results: list[torch.Tensor] = []  # per group, flattened: tokens [G, s+1] then num [G]
        for s, members in groups.items():
            reqs = [out.rows[i].request for i, _, _ in members]
            params = [r.sampling_params for r in reqs]
            seeds, starts, gens = [r.seed for r in reqs], [r.num_tokens for r in reqs], [r.generator for r in reqs]
            # Each member's parameter rows, already on the device (sliced with host offsets: no upload)
            table = None if model_out.sampling_table is None else \
                torch.cat([model_out.sampling_table[o:o + s + 1] for _, o, _ in members])  # [G * (s+1), 3]
            if s == 0:  # nothing to verify: the plain sampler
                rows = torch.stack([logits[o] for _, o, _ in members])  # [G, V]
                tokens = sample_at(rows, params, seeds, starts, gens, table)  # [G]
                results.append(torch.cat([tokens.long(), torch.ones_like(tokens, dtype=torch.long)]))
                continue
            rows = torch.stack([logits[o:o + s + 1] for _, o, _ in members])  # [G, s+1, V]
            p = target_probs_from_logits(rows, params, table)  # [G, s+1, V]
            noise = noise_for_rows(params, seeds, starts, s + 1, p.shape[-1], gens, p.device)  # [G, s+1, V]
            d = self._drafts(out, model_out, members, s, logits.device)  # [G, s]
            tokens, num = verifier(d, p, noise)  # [G, s+1], [G]
            results.append(torch.cat([tokens.long().flatten(), num.long()]))
        flat = torch.cat(results).tolist() if results else []  # the step's one host read
        emitted: dict[int, list[int]] = {}
        at = 0
        for s, members in groups.items():
            G = len(members)
            toks, num = flat[at:at + G * (s + 1)], flat[at + G * (s + 1):at + G * (s + 2)]
            at += G * (s + 2)
            for j, ((i, _, _), n) in enumerate(zip(members, num)):
                emitted[i] = toks[j * (s + 1):j * (s + 1) + n]
        last_node = {i: len(toks) - 1 for i, toks in emitted.items()}  # a chain's accepted drafts, then its token
        checked = {}
        for i, offset in trees:
            emitted[i], path = self._verify_tree(out.rows[i], logits[offset:offset + out.rows[i].num_logits],
                                                 model_out.sampling_table, offset)
            last_node[i] = path[-1]
            checked[i] = len(path) - 1 + bool(out.rows[i].spec_tree.children(path[-1]))  # and the miss, if any
        self._count(out, emitted, checked)
        observe = getattr(self.drafter, "observe", None)
        if observe is not None:  # Medusa: each request's last token came from the logits row of its last node
            rows = {i: o for i, o in zip(model_out.rows, model_out.offsets)}
            done = [i for i in emitted if emitted[i]]
            observe([out.rows[i].request for i in done], [rows[i] + last_node[i] for i in done], model_out.hidden)
        return emitted

    def _verify_tree(self, row, logits: torch.Tensor, table: torch.Tensor | None,
                     offset: int) -> tuple[list[int], list[int]]:
        """One row's candidate tree: its emitted tokens and accepted nodes (``tree.walk_tree``).

        The accepted nodes' K/V were written in node order (node n at the root's position + n);
        each accepted node at depth d is queued to move to the root's position + d.
        """
        r, tree = row.request, row.spec_tree
        table = None if table is None else table[offset:offset + tree.num_nodes]
        p = target_probs_from_logits(logits[None], [r.sampling_params], table)[0]  # [N+1, V]
        noise = noise_for_rows([r.sampling_params], [r.seed], [r.num_tokens], tree.depth + 1, p.shape[-1],
                               [r.generator], p.device)[0]  # [depth+1, V]: the positions the depths land at
        tokens = torch.tensor([r.all_token_ids[r.num_computed_tokens + row.num_known_tokens - 1]]
                              + row.spec_token_ids, dtype=torch.long, device=p.device)
        path, emitted = walk_tree(tree, tokens, p, noise, self.config.acceptance,
                                  self.config.typical_epsilon, self.config.typical_delta)
        root = r.num_computed_tokens + row.num_known_tokens - 1
        self.kv_moves.extend((r, root + n, root + d) for d, n in enumerate(path) if n != d)
        return emitted, path

    def take_kv_moves(self) -> list[tuple[Request, int, int]]:
        """The K/V moves the last verification queued (and forget them)."""
        moves, self.kv_moves = self.kv_moves, []
        return moves

    @staticmethod
    def _drafts(out: SchedulerOutput, model_out: ModelOutput, members, s: int, device) -> torch.Tensor:
        """[G, s] draft tokens: row i fed them right after its first logits token, so they
        are already on the device in the step's input_ids; uploaded only without those."""
        if model_out.input_ids is not None and all(t0 is not None for _, _, t0 in members):
            return torch.stack([model_out.input_ids[t0 + 1:t0 + 1 + s] for _, _, t0 in members])
        return torch.tensor([out.rows[i].spec_token_ids for i, _, _ in members], device=device)

    def _count(self, out: SchedulerOutput, emitted: dict[int, list[int]],
               checked: dict[int, int] | None = None) -> None:
        """The counters of one verification; ``checked``: the drafts a tree's walk judged, per row."""
        checked = checked or {}
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
                # accepted drafts, and the rejected one if the walk stopped early (a tree: its node without a match)
                st.num_checked += checked[i] if i in checked else min(len(toks), s)
                history = self.requests.setdefault(row.request, deque(maxlen=policy.HISTORY))
                history.append((s, len(toks) - 1))
                if self.config.adaptive:
                    r = row.request
                    k = self.config.num_speculative_tokens if r.num_speculative_tokens is None \
                        else r.num_speculative_tokens
                    acceptance = policy.recent_acceptance(history)
                    k_max = self.config.num_speculative_tokens
                    mine = seams.plugged("next_num_speculative_tokens")  # a learner's policy (chapter 5)
                    r.num_speculative_tokens = policy.next_num_speculative_tokens(k, acceptance, k_max) \
                        if mine is None else _checked_next_k(mine(k, acceptance, k_max), k, acceptance, k_max)
        st.spec_steps += any(out.rows[i].spec_token_ids for i in emitted)

    # -- after the scheduler's update -----------------------------------------------------
    def finish_step(self, out: SchedulerOutput, finished: list[Request]) -> None:
        """The drafter forgets rejected drafts' K/V, and finished requests altogether."""
        for row in out.rows:
            if row.spec_token_ids:
                self.drafter.rollback(row.request)
        for r in finished:
            self.forget(r)

    def forget(self, request: Request) -> None:
        self.requests.pop(request, None)
        self.drafter.forget(request)


def _checked_next_k(next_k, k: int, acceptance: float | None, k_max: int) -> int:
    """A plugged adaptive-k policy's answer, checked before the scheduler reserves a lookahead
    with it: a number of drafts in [k_min, k_max], k_min = 1 (the engine asks with the
    default), so a request never drafts more than it was configured for, nor stops drafting
    for good (its acceptance, which could raise k again, is measured on drafts only)."""
    if isinstance(next_k, bool) or not isinstance(next_k, int) or not 1 <= next_k <= k_max:
        raise seams.SeamContractError(
            "next_num_speculative_tokens", f"the next k is an integer clamped to [k_min=1, k_max={k_max}]",
            f"from k={k} at acceptance {acceptance if acceptance is None else round(acceptance, 4)} "
            f"it returns {next_k!r}")
    return next_k


__all__ = ["SpecStats", "Speculator"]
