"""The exactness test: speculative decoding must not change the output distribution.

Two checks, both on toy autoregressive "models" over a tiny vocabulary (a model here
is any function ``prefix tuple -> probabilities [V]``):

1. Exact enumeration. ``enumerate_output_distribution`` walks every draft sequence
   (weighted by the drafter's probabilities) and every accept/reject branch (weighted
   by the rule's acceptance probabilities), through as many verification rounds as it
   takes to emit m tokens, and returns the probability of each m-token output. It
   must equal the target's own joint distribution (``target_distribution``) up to
   float64 rounding. The rule is passed in as a function with the signature of
   ``verify_probs`` -- the function ``rejection_sample`` itself runs -- so a wrong
   rule (``WRONG_RULES``) or a wrong q shows up as a measurable gap.
2. Sampling. ``compare_samplers`` draws n outputs from two samplers (e.g. speculative
   decoding with ``rejection_sample`` vs plain sampling from the target) and compares
   the empirical distributions by total variation against a threshold derived from n.

The engine verifies with ``coupled_verify`` instead (noise fixed per token position, see
``minillm/spec_decode/rejection_sampler.py``); ``sample_speculative_coupled`` and
``sample_plain_at`` run that scheme and plain sampling on the toy models with the same
seeds, so the two can be compared token for token as well as in distribution.
"""
from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from typing import Callable, Sequence

import torch

from minillm.sampling import exponential_race, position_noise
from minillm.sampling_params import SamplingParams
from minillm.spec_decode.rejection_sampler import coupled_verify, draft_probs_from_logits, rejection_sample, verify_probs
from minillm.spec_decode.tree import TreeRule, TreeSpec, candidate_tokens, walk_tree

ToyModel = Callable[[tuple[int, ...]], torch.Tensor]  # prefix -> probabilities [V], float64
Rule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
Distribution = dict[tuple[int, ...], float]  # m-token output -> probability


# ---------------------------------------------------------------- toy models


def toy_logits_model(vocab_size: int, seed: int, scale: float = 2.0,
                     base: ToyModel | None = None) -> ToyModel:
    """Random logits [V] for every prefix, the same on every call (seeded by the prefix).

    With ``base`` the logits are base's plus scaled noise: a drafter that roughly
    agrees with its target, as a small model does with a large one.
    """
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            key = hashlib.blake2b(repr((seed, prefix)).encode(), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 2)  # stable across Pythons
            noise = scale * torch.randn(vocab_size, generator=g, dtype=torch.float64)
            cache[prefix] = noise if base is None else base(prefix) + noise
        return cache[prefix]

    return logits


def toy_probs_model(logits_model: ToyModel, params: SamplingParams,
                    before_top_k_top_p: bool = False) -> ToyModel:
    """The distribution a request with ``params`` samples from, as a float64 toy model.

    Goes through ``draft_probs_from_logits`` (temperature, top-k, top-p), then float64
    renormalization so the enumeration is exact to ~1e-15. ``before_top_k_top_p=True``
    is the classic bug on the draft side: softmax(logits / temperature) with no top-k
    or top-p, i.e. not the distribution the draft was sampled from.
    """
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def probs(prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in cache:
            logits = logits_model(prefix)
            if before_top_k_top_p:
                temperature = params.temperature if not params.greedy else 1.0
                q = (logits / temperature).softmax(-1)
            else:
                q = draft_probs_from_logits(logits[None, None], [params])[0, 0].double()
            cache[prefix] = q / q.sum()
        return cache[prefix]

    return probs


# ---------------------------------------------------------------- wrong rules (each must fail)


def always_accept_rule(d, q, p):
    """Accept every draft: the output follows the drafter, not the target."""
    a, e = verify_probs(d, q, p)
    return torch.ones_like(a), e


def resample_target_rule(d, q, p):
    """On rejection sample p_i instead of the residual: tokens where q > p are over-counted."""
    a, _ = verify_probs(d, q, p)
    return a, p.to(a.dtype)


def resample_draft_rule(d, q, p):
    """On rejection sample q_i again: the rejected mass goes back to the drafter's choices."""
    a, e = verify_probs(d, q, p)
    e = e.clone()
    e[:, :-1] = q.to(e.dtype)
    return a, e


def unnormalized_residual_rule(d, q, p):
    """max(0, p - q) without dividing by its mass: emitted 'probabilities' no longer sum to 1.

    (An exponential-race or multinomial draw would forgive this -- both normalize
    implicitly -- but an inverse-CDF draw with one uniform would not.)
    """
    a, e = verify_probs(d, q, p)
    e = e.clone()
    e[:, :-1] = (p[:, :-1] - q).clamp(min=0).to(e.dtype)
    return a, e


def bonus_off_by_one_rule(d, q, p):
    """The bonus token from p_{k-1} (the last draft's slot) instead of p_k (the next slot)."""
    a, e = verify_probs(d, q, p)
    e = e.clone()
    e[:, -1] = p[:, -2].to(e.dtype)
    return a, e


WRONG_RULES: dict[str, Rule] = {
    "always_accept": always_accept_rule,
    "resample_target": resample_target_rule,
    "resample_draft": resample_draft_rule,
    "unnormalized_residual": unnormalized_residual_rule,
    "bonus_off_by_one": bonus_off_by_one_rule,
}


# ---------------------------------------------------------------- exact enumeration


def target_distribution(target: ToyModel, m: int, context: tuple[int, ...] = ()) -> Distribution:
    """P(first m tokens) when sampling from the target alone: the product of its conditionals."""
    dist: Distribution = {(): 1.0}
    for _ in range(m):
        nxt: Distribution = defaultdict(float)
        for seq, w in dist.items():
            for t, pt in enumerate(target(context + seq).tolist()):
                if pt > 0:
                    nxt[seq + (t,)] += w * pt
        dist = nxt
    return dict(dist)


def enumerate_output_distribution(target: ToyModel, draft: ToyModel, rule: Rule = verify_probs, k: int = 2,
                                  m: int = 2, context: tuple[int, ...] = (),
                                  reported_draft: ToyModel | None = None) -> Distribution:
    """P(first m emitted tokens) under speculative decoding with ``rule``, exactly.

    Each round drafts k tokens from ``draft`` given the context so far, asks
    ``rule(draft_ids [N, k], draft_probs [N, k, V], target_probs [N, k+1, V])`` -- one
    batched call for all N possible draft sequences -- for (accept_probs, emit_probs),
    and follows every branch: stop at position i with probability
    a_0 ... a_{i-1} (1 - a_i) (a_k := 0), emitting the accepted drafts and then token t
    with probability emit_probs[i, t]. Rounds repeat until m tokens are out.

    ``reported_draft`` is the q handed to the rule when it differs from the distribution
    the drafts are really sampled from (``draft``): the wrong-q bug.
    """
    reported = draft if reported_draft is None else reported_draft
    memo: dict[tuple[tuple[int, ...], int], Distribution] = {}

    def rounds(ctx: tuple[int, ...], need: int) -> Distribution:
        if (ctx, need) in memo:
            return memo[(ctx, need)]
        drafts: list[tuple[tuple[int, ...], float]] = [((), 1.0)]  # (draft tokens, their probability)
        for _ in range(k):
            drafts = [(xs + (x,), w * qx) for xs, w in drafts
                      for x, qx in enumerate(draft(ctx + xs).tolist()) if qx > 0]
        ids = torch.tensor([xs for xs, _ in drafts], dtype=torch.long).reshape(len(drafts), k)
        V = target(ctx).numel()
        q = torch.stack([torch.stack([reported(ctx + xs[:i]) for i in range(k)]) if k else
                         torch.zeros(0, V, dtype=torch.float64) for xs, _ in drafts])  # [N, k, V]
        p = torch.stack([torch.stack([target(ctx + xs[:i]) for i in range(k + 1)]) for xs, _ in drafts])
        accept, emit = rule(ids, q, p)  # [N, k], [N, k+1, V]
        accept, emit = accept.double().tolist(), emit.double().tolist()
        out: Distribution = defaultdict(float)
        for n, (xs, w) in enumerate(drafts):
            reach = w  # probability of drafting xs and accepting xs[:i]
            for i in range(k + 1):
                stop = reach * (1.0 - accept[n][i] if i < k else 1.0)
                for t, pt in enumerate(emit[n][i]):
                    if stop * pt == 0:
                        continue
                    emitted = xs[:i] + (t,)
                    if len(emitted) >= need:
                        out[emitted[:need]] += stop * pt
                    else:
                        for rest, w_rest in rounds(ctx + emitted, need - len(emitted)).items():
                            out[emitted + rest] += stop * pt * w_rest
                if i < k:
                    reach *= accept[n][i]
        memo[(ctx, need)] = dict(out)
        return memo[(ctx, need)]

    return rounds(tuple(context), m)


def max_abs_difference(a: Distribution, b: Distribution) -> float:
    """max over outputs of |a - b| (a missing output has probability 0)."""
    return max((abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b)), default=0.0)


def total_variation(a: Distribution, b: Distribution) -> float:
    """1/2 sum |a - b|: the largest difference in probability the two give to any event."""
    return 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in set(a) | set(b))


def exactness_error(target: ToyModel, draft: ToyModel, rule: Rule = verify_probs, k: int = 2, m: int = 2,
                    context: tuple[int, ...] = (), reported_draft: ToyModel | None = None) -> float:
    """max |P_spec(output) - P_target(output)| over m-token outputs: ~1e-16 for a correct rule."""
    spec = enumerate_output_distribution(target, draft, rule, k, m, context, reported_draft)
    return max_abs_difference(spec, target_distribution(target, m, context))


# ---------------------------------------------------------------- sampling


def _rows(model: ToyModel, prefixes: Sequence[tuple[int, ...]]) -> torch.Tensor:
    """model(prefix) for every prefix: [N, V], evaluating each distinct prefix once."""
    index: dict[tuple[int, ...], int] = {}
    ids = [index.setdefault(pr, len(index)) for pr in prefixes]
    return torch.stack([model(pr) for pr in index])[torch.tensor(ids, dtype=torch.long)]


def sample_target(target: ToyModel, n: int, m: int = 2, generator: torch.Generator | None = None,
                  context: tuple[int, ...] = ()) -> torch.Tensor:
    """n independent m-token outputs of plain autoregressive sampling: [n, m] long."""
    seqs = [tuple(context)] * n
    for _ in range(m):
        nxt = torch.multinomial(_rows(target, seqs), 1, generator=generator)[:, 0].tolist()
        seqs = [s + (t,) for s, t in zip(seqs, nxt)]
    return torch.tensor([s[len(context):] for s in seqs], dtype=torch.long).reshape(n, m)


def sample_speculative(target: ToyModel, draft: ToyModel, k: int, n: int, m: int = 2,
                       generator: torch.Generator | None = None, sampler=rejection_sample,
                       reported_draft: ToyModel | None = None,
                       context: tuple[int, ...] = ()) -> torch.Tensor:
    """n independent m-token outputs of speculative decoding, all n as one batch: [n, m].

    Each round drafts k tokens per unfinished row, then calls
    ``sampler(draft_ids [N, k], draft_probs [N, k, V], target_probs [N, k+1, V], generator)``
    (``rejection_sample`` by default) and appends what it emits.
    """
    reported = draft if reported_draft is None else reported_draft
    out: list[list[int]] = [[] for _ in range(n)]
    while active := [r for r in range(n) if len(out[r]) < m]:
        ctx = [tuple(context) + tuple(out[r]) for r in active]
        xs: list[tuple[int, ...]] = [()] * len(active)
        q_rows, p_rows = [], []
        for _ in range(k):
            pre = [c + x for c, x in zip(ctx, xs)]
            drawn = torch.multinomial(_rows(draft, pre), 1, generator=generator)[:, 0].tolist()
            q_rows.append(_rows(reported, pre))
            p_rows.append(_rows(target, pre))
            xs = [x + (t,) for x, t in zip(xs, drawn)]
        p_rows.append(_rows(target, [c + x for c, x in zip(ctx, xs)]))
        V = p_rows[0].shape[-1]
        ids = torch.tensor(xs, dtype=torch.long).reshape(len(active), k)
        q = torch.stack(q_rows, 1) if k else torch.zeros(len(active), 0, V, dtype=torch.float64)
        tokens, num = sampler(ids, q, torch.stack(p_rows, 1), generator)
        for r, row, c in zip(active, tokens.tolist(), num.tolist()):
            out[r].extend(row[:c])
    return torch.tensor([o[:m] for o in out], dtype=torch.long)


def sample_plain_at(target: ToyModel, n: int, m: int = 2, seed: int = 0,
                    context: tuple[int, ...] = ()) -> torch.Tensor:
    """n m-token outputs of plain sampling as the engine does it: [n, m].

    Row r is a request seeded ``seed + r``; the token at position t (the index in
    context + output) is argmax(p / E) with E = ``position_noise(seed + r, [t])``.
    """
    out = []
    for r in range(n):
        seq = tuple(context)
        for _ in range(m):
            p = target(seq)
            seq += (int(exponential_race(p, position_noise(seed + r, [len(seq)], p.numel())[0].to(p.dtype))),)
        out.append(seq[len(context):])
    return torch.tensor(out, dtype=torch.long).reshape(n, m)


def sample_speculative_coupled(target: ToyModel, draft: ToyModel, k: int, n: int, m: int = 2, seed: int = 0,
                               verifier=coupled_verify, context: tuple[int, ...] = ()) -> torch.Tensor:
    """n m-token outputs of speculative decoding as the engine runs it: [n, m].

    Row r is a request seeded ``seed + r``. Each round the drafter samples
    x_t = argmax(q_t / E_t) with the noise of the position t each draft lands at, and
    ``verifier(draft_ids [1, k], target_probs [1, k+1, V], noise [1, k+1, V])`` sees the
    same noise (``coupled_verify`` by default). With a correct verifier row r equals row r
    of ``sample_plain_at`` with the same seed, token for token.
    """
    out = []
    for r in range(n):
        seq = tuple(context)
        while len(seq) - len(context) < m:
            V = target(seq).numel()
            noise = position_noise(seed + r, range(len(seq), len(seq) + k + 1), V).double()  # [k+1, V]
            xs: tuple[int, ...] = ()
            for j in range(k):
                xs += (int(exponential_race(draft(seq + xs), noise[j])),)
            p = torch.stack([target(seq + xs[:j]) for j in range(k + 1)])  # [k+1, V]
            tokens, num = verifier(torch.tensor([xs], dtype=torch.long).reshape(1, k), p[None], noise[None])
            seq += tuple(tokens[0, :int(num[0])].tolist())
        out.append(seq[len(context):len(context) + m])
    return torch.tensor(out, dtype=torch.long).reshape(n, m)


def tv_threshold(n: int, num_cells: int, delta: float = 1e-6, two_sample: bool = True) -> float:
    """The TV a correct sampler stays below with probability >= 1 - delta.

    Two samples of n draws each from the same distribution pi over C = num_cells
    outcomes. Mean: the cell difference D_c = phat_a(c) - phat_b(c) has mean 0 and
    variance 2 pi_c (1 - pi_c) / n, so E|D_c| <= sqrt(Var D_c) and, by Cauchy-Schwarz
    with sum_c pi_c (1 - pi_c) = 1 - sum pi_c^2 <= 1 - 1/C,
        E[TV] = 1/2 sum_c E|D_c| <= sqrt((C - 1) / (2 n)).
    Deviation: TV is a function of 2n independent draws and changing one draw moves
    1/n of mass between two cells, changing TV by at most 1/n; McDiarmid gives
    P(TV >= E[TV] + t) <= exp(-n t^2), so t = sqrt(ln(1/delta) / n).
    Against an exact pi (one sample, ``two_sample=False``): E[TV] <= sqrt((C - 1) / (4 n))
    and t = sqrt(ln(1/delta) / (2 n)). No assumption on pi, so the bound is conservative;
    a sampler whose true TV exceeds twice the threshold fails with high probability.
    """
    if two_sample:
        return math.sqrt((num_cells - 1) / (2 * n)) + math.sqrt(math.log(1 / delta) / n)
    return math.sqrt((num_cells - 1) / (4 * n)) + math.sqrt(math.log(1 / delta) / (2 * n))


def empirical_tv(samples_a: torch.Tensor, samples_b: torch.Tensor) -> float:
    """TV between the empirical distributions of two sets of outputs (rows of [n, m])."""
    a, b = defaultdict(float), defaultdict(float)
    for row in samples_a.tolist():
        a[tuple(row)] += 1.0 / len(samples_a)
    for row in samples_b.tolist():
        b[tuple(row)] += 1.0 / len(samples_b)
    return total_variation(a, b)


def compare_samplers(sampler_a: Callable[[int], torch.Tensor], sampler_b: Callable[[int], torch.Tensor],
                     n: int, num_cells: int, delta: float = 1e-6) -> tuple[float, float, bool]:
    """Draw n outputs from each sampler (``sampler(n) -> [n, m]``) and test them for equality.

    num_cells is the number of possible outputs (V ** m for m tokens). Returns
    (tv, threshold, passed): passed is tv <= threshold, which a pair of samplers with
    the same distribution fails with probability at most delta (see ``tv_threshold``).
    """
    tv = empirical_tv(sampler_a(n), sampler_b(n))
    threshold = tv_threshold(n, num_cells, delta)
    return tv, threshold, tv <= threshold


# ---------------------------------------------------------------- candidate trees (Medusa)

Ranking = Callable[[tuple[int, ...]], torch.Tensor]  # context -> [K, W] candidate tokens per head, best first


def toy_ranking(draft: ToyModel, num_heads: int, width: int) -> Ranking:
    """Toy Medusa heads: head d ranks the tokens of ``draft`` at d steps along draft's own greedy path.

    Like real heads they see only the context (nothing of the tokens the tree guesses
    before theirs), and are deterministic: the same ranking for the same context.
    """
    def ranking(ctx: tuple[int, ...]) -> torch.Tensor:
        rows, path = [], ()
        for _ in range(num_heads):
            q = draft(ctx + path)
            rows.append(q.argsort(descending=True, stable=True)[:width])
            path += (int(rows[-1][0]),)
        return torch.stack(rows)

    return ranking


def _tree_round(target: ToyModel, ranking: Ranking, tree: TreeSpec, ctx: tuple[int, ...]):
    """The nodes' tokens, each node's token path after the root, and the target at every node."""
    tokens = candidate_tokens(tree, ctx[-1] if ctx else 0, ranking(ctx))
    paths: list[tuple[int, ...]] = []
    for n, parent in enumerate(tree.parents):
        paths.append(() if parent < 0 else paths[parent] + (int(tokens[n]),))
    p = torch.stack([target(ctx + path) for path in paths])  # [N+1, V]
    return tokens, paths, p


def enumerate_tree_output_distribution(target: ToyModel, ranking: Ranking, tree: TreeSpec, rule: TreeRule, m: int = 2,
                                       context: tuple[int, ...] = ()) -> Distribution:
    """P(first m emitted tokens) when every round verifies ``tree`` with ``rule``, exactly.

    ``rule(tree, tokens [N+1], target_probs [N+1, V]) -> (move [N+1], emit [N+1, V])``
    (``minillm.spec_decode.tree.exact_tree_rule``'s signature). The walk reaches node n with
    the product of ``move`` along its path, stops there with that times
    1 - sum(move of n's children), and then emits its path's tokens and t ~ emit[n].
    """
    memo: dict[tuple[tuple[int, ...], int], Distribution] = {}

    def rounds(ctx: tuple[int, ...], need: int) -> Distribution:
        if (ctx, need) in memo:
            return memo[(ctx, need)]
        tokens, paths, p = _tree_round(target, ranking, tree, ctx)
        move, emit = rule(tree, tokens, p)
        move, emit = move.double().tolist(), emit.double().tolist()
        reach = [0.0] * tree.num_nodes
        out: Distribution = defaultdict(float)
        for n, parent in enumerate(tree.parents):
            reach[n] = 1.0 if parent < 0 else reach[parent] * move[n]
            stop = reach[n] * (1.0 - sum(move[c] for c in tree.children(n)))
            for t, pt in enumerate(emit[n]):
                if stop * pt <= 0:
                    continue
                emitted = paths[n] + (t,)
                if len(emitted) >= need:
                    out[emitted[:need]] += stop * pt
                else:
                    for rest, w_rest in rounds(ctx + emitted, need - len(emitted)).items():
                        out[emitted + rest] += stop * pt * w_rest
        memo[(ctx, need)] = dict(out)
        return memo[(ctx, need)]

    return rounds(tuple(context), m)


def sample_tree_coupled(target: ToyModel, ranking: Ranking, tree: TreeSpec, n: int, m: int = 2, seed: int = 0,
                        rule: str = "exact", context: tuple[int, ...] = (),
                        **rule_args) -> tuple[torch.Tensor, float]:
    """n m-token outputs of tree verification with the engine's per-position noise: ([n, m], tokens per round).

    Row r is a request seeded ``seed + r``, as in ``sample_plain_at``; each round calls
    ``minillm.spec_decode.tree.walk_tree`` with the noise of the positions the tree's
    depths land at. With ``rule="exact"`` row r equals ``sample_plain_at``'s row r.
    """
    out, emitted, num_rounds = [], 0, 0
    rounds: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # context -> (node tokens, target at nodes)
    for r in range(n):
        seq = tuple(context)
        while len(seq) - len(context) < m:
            if seq not in rounds:
                rounds[seq] = _tree_round(target, ranking, tree, seq)[::2]
            tokens, p = rounds[seq]
            noise = position_noise(seed + r, range(len(seq), len(seq) + tree.depth + 1), p.shape[1]).double()
            _, new = walk_tree(tree, tokens, p, noise, rule, **rule_args)
            seq += tuple(new)
            emitted, num_rounds = emitted + len(new), num_rounds + 1
        out.append(seq[len(context):len(context) + m])
    return torch.tensor(out, dtype=torch.long).reshape(n, m), emitted / max(num_rounds, 1)


def chi_square_p_value(samples: torch.Tensor, exact: Distribution, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value of samples [n, m] against an exact distribution.

    Cells expected fewer than ``min_expected`` times are pooled into one (the chi-square
    approximation needs a few per cell). A sample the exact distribution gives
    probability 0 makes the p-value 0. Survival function of chi-square with df degrees of
    freedom: the regularized upper incomplete gamma Q(df / 2, x / 2).
    """
    n = len(samples)
    counts: dict[tuple[int, ...], int] = defaultdict(int)
    for row in samples.tolist():
        counts[tuple(row)] += 1
    if any(exact.get(c, 0.0) <= 0 for c in counts):
        return 0.0
    big = [c for c, pc in exact.items() if pc * n >= min_expected]
    small = [c for c, pc in exact.items() if pc * n < min_expected and pc > 0]
    cells = [([c], exact[c]) for c in big]
    if small:
        cells.append((small, sum(exact[c] for c in small)))
    if len(cells) < 2:
        return 1.0
    stat = sum((sum(counts.get(c, 0) for c in group) - n * pg) ** 2 / (n * pg) for group, pg in cells)
    df = torch.tensor(len(cells) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, torch.tensor(stat, dtype=torch.float64) / 2))
