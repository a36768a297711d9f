"""Wrong answers to exercises/ch05_speculative_sampling.py, each a mistake the contract rules out."""
from __future__ import annotations

import torch

from mutants import mutant
from solutions import ch05_speculative_sampling as ref

# ---------------------------------------------------------------- accept_probability


@mutant("accept_probability", "the ratio is inverted: min(1, q(x) / p(x))")
def _accept_inverted(p_x, q_x):
    return (q_x / p_x).clamp(max=1.0)


@mutant("accept_probability", "the ratio is not capped at 1: p(x) / q(x)")
def _accept_uncapped(p_x, q_x):
    return p_x / q_x


@mutant("accept_probability", "q is left out: the target's probability p(x) alone")
def _accept_p_only(p_x, q_x):
    return p_x * torch.ones_like(q_x)


@mutant("accept_probability", "min(p(x), q(x)), the term of alpha, instead of min(1, p(x) / q(x))")
def _accept_min_of_the_two(p_x, q_x):
    return torch.minimum(p_x, q_x)


# ---------------------------------------------------------------- residual_distribution


@mutant("residual_distribution", "max(0, p - q) is not renormalized")
def _residual_not_normalized(p, q):
    r = (p - q).clamp(min=0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


@mutant("residual_distribution", "the wrong sign: norm(max(0, q - p))")
def _residual_wrong_sign(p, q):
    return ref.residual_distribution(q, p)


@mutant("residual_distribution", "normalized by the sum over the whole tensor, not over each row's last dim")
def _residual_global_sum(p, q):
    r = (p - q).clamp(min=0)
    mass = r.sum()
    out = r / mass.clamp(min=torch.finfo(r.dtype).tiny)
    return torch.where(r.sum(-1, keepdim=True) > 0, out, p)


@mutant("residual_distribution", "p == q is not handled: 0 / 0 gives nan")
def _residual_nan_when_equal(p, q):
    r = (p - q).clamp(min=0)
    return r / r.sum(-1, keepdim=True)


# ---------------------------------------------------------------- acceptance_rate


@mutant("acceptance_rate", "the expectation is not weighted by q: sum_x min(1, p(x) / q(x))")
def _alpha_unweighted(p, q):
    ratio = torch.where(q > 0, p / q, torch.zeros_like(p))
    return ratio.clamp(max=1.0).sum(-1)


@mutant("acceptance_rate", "a mean over the vocabulary where a sum belongs")
def _alpha_mean(p, q):
    return torch.minimum(p, q).mean(-1)


@mutant("acceptance_rate", "1 - sum |p - q|: the total variation without its 1/2")
def _alpha_tv_without_half(p, q):
    return 1.0 - (p - q).abs().sum(-1)


@mutant("acceptance_rate", "the summed dim is kept: [..., 1] instead of [...]")
def _alpha_keepdim(p, q):
    return torch.minimum(p, q).sum(-1, keepdim=True)


# ---------------------------------------------------------------- rejection_sample_one


def _walk(draft_tokens, q, p, uniforms, accept, on_reject, after_all):
    """The walk of the contract with its three pieces swappable: the acceptance probability,
    the distribution after a rejection at i, the one after all k acceptances."""
    for i, x in enumerate(draft_tokens):
        if not uniforms[i] < accept(p[i, x], q[i, x]):
            return list(draft_tokens[:i]), on_reject(p, q, i)
    return list(draft_tokens), after_all(p, q)


def _accept(p_x, q_x):
    return min(1.0, float(p_x / q_x))


def _residual(p, q, i):
    return ref.residual_distribution(p[i], q[i])


def _bonus(p, q):
    return p[len(q)]


@mutant("rejection_sample_one", "the acceptance ratio is inverted: u < min(1, q(x) / p(x))")
def _rule_inverted(draft_tokens, q, p, uniforms):
    return _walk(draft_tokens, q, p, uniforms, lambda px, qx: min(1.0, float(qx / px)) if px > 0 else 1.0,
                 _residual, _bonus)


@mutant("rejection_sample_one", "accepted with probability p(x), q left out of the ratio",
        same_in_engine="the engine's drafters for this seam are deterministic: per_row_verifier passes q as the "
                       "one-hot of each draft, so q(x) = 1 and p(x) = min(1, p(x) / q(x)) at every call")
def _rule_p_only(draft_tokens, q, p, uniforms):
    return _walk(draft_tokens, q, p, uniforms, lambda px, qx: float(px), _residual, _bonus)


@mutant("rejection_sample_one", "after a rejection, max(0, p - q) is not renormalized")
def _rule_residual_not_normalized(draft_tokens, q, p, uniforms):
    return _walk(draft_tokens, q, p, uniforms, _accept, lambda p, q, i: (p[i] - q[i]).clamp(min=0), _bonus)


@mutant("rejection_sample_one", "after a rejection, the token is resampled from p itself, not the residual")
def _rule_resample_from_p(draft_tokens, q, p, uniforms):
    return _walk(draft_tokens, q, p, uniforms, _accept, lambda p, q, i: p[i], _bonus)


@mutant("rejection_sample_one", "no bonus token: with all k accepted, the extra token comes from p[k-1], not p[k]")
def _rule_no_bonus(draft_tokens, q, p, uniforms):
    return _walk(draft_tokens, q, p, uniforms, _accept, _residual, lambda p, q: p[len(q) - 1])


@mutant("rejection_sample_one", "the walk does not stop at a rejection: later drafts that pass are kept too")
def _rule_does_not_stop(draft_tokens, q, p, uniforms):
    accepted, first_rejected = [], None
    for i, x in enumerate(draft_tokens):
        if uniforms[i] < _accept(p[i, x], q[i, x]):
            accepted.append(x)
        elif first_rejected is None:
            first_rejected = i
    last = p[len(draft_tokens)] if first_rejected is None else ref.residual_distribution(p[first_rejected],
                                                                                         q[first_rejected])
    return accepted, last


# ---------------------------------------------------------------- ngram_propose


@mutant("ngram_propose", "the oldest earlier occurrence wins, not the most recent")
def _ngram_oldest(tokens, n, k):
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(0, L - n):
        if tokens[j:j + n] == suffix:
            return tokens[j + n:j + n + k]
    return []


@mutant("ngram_propose", "the search starts at the suffix itself (j from len - n), which always matches")
def _ngram_matches_itself(tokens, n, k):
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(L - n, -1, -1):
        if tokens[j:j + n] == suffix:
            return tokens[j + n:j + n + k]
    return []


@mutant("ngram_propose", "an occurrence that overlaps the suffix is skipped (j from len - n - 2)")
def _ngram_no_overlap(tokens, n, k):
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(L - n - 2, -1, -1):
        if tokens[j:j + n] == suffix:
            return tokens[j + n:j + n + k]
    return []


@mutant("ngram_propose", "the proposal is not cut at k tokens")
def _ngram_uncut(tokens, n, k):
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(L - n - 1, -1, -1):
        if tokens[j:j + n] == suffix:
            return tokens[j + n:]
    return []


@mutant("ngram_propose", "the proposal starts one token late: tokens[j+n+1 : j+n+1+k]")
def _ngram_starts_late(tokens, n, k):
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(L - n - 1, -1, -1):
        if tokens[j:j + n] == suffix:
            return tokens[j + n + 1:j + n + 1 + k]
    return []


@mutant("ngram_propose", "no match for n: falls back to shorter suffixes")
def _ngram_falls_back(tokens, n, k):
    for m in range(n, 0, -1):
        proposal = ref.ngram_propose(tokens, m, k)
        if proposal:
            return proposal
    return []


# ---------------------------------------------------------------- expected_tokens_per_forward


@mutant("expected_tokens_per_forward", "the one target token is left out: only the accepted drafts are counted")
def _tokens_no_plus_one(alpha, k):
    return sum(alpha ** i for i in range(1, k + 1))


@mutant("expected_tokens_per_forward", "the walk is taken not to stop at a rejection: 1 + k * alpha")
def _tokens_linear(alpha, k):
    return 1.0 + k * alpha


@mutant("expected_tokens_per_forward", "one term short: 1 + alpha + ... + alpha^(k-1)")
def _tokens_one_term_short(alpha, k):
    return sum(alpha ** i for i in range(k)) if k else 1.0


@mutant("expected_tokens_per_forward", "the closed form's alpha == 1 case returns k instead of k + 1")
def _tokens_alpha_one_is_k(alpha, k):
    return float(k) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


# ---------------------------------------------------------------- speculative_speedup


def _check_speedup_input(alpha, k, c_draft, c_verify, k_min=1):
    if not (0.0 <= alpha <= 1.0) or k < k_min or c_draft < 0 or c_verify <= 0:
        raise ValueError(f"bad input: alpha={alpha}, k={k}, c_draft={c_draft}, c_verify={c_verify}")


@mutant("speculative_speedup", "the k draft forwards are charged once: c_draft instead of k * c_draft")
def _speedup_one_draft_cost(alpha, k, c_draft, c_verify):
    _check_speedup_input(alpha, k, c_draft, c_verify)
    return ref.expected_tokens_per_forward(alpha, k) / (c_draft + c_verify)


@mutant("speculative_speedup", "the verification is charged per token: (k + 1) * c_verify")
def _speedup_verify_per_token(alpha, k, c_draft, c_verify):
    _check_speedup_input(alpha, k, c_draft, c_verify)
    return ref.expected_tokens_per_forward(alpha, k) / (k * c_draft + (k + 1) * c_verify)


@mutant("speculative_speedup", "k = 0 is let through (k >= 0 checked, not k >= 1)")
def _speedup_k_zero_allowed(alpha, k, c_draft, c_verify):
    _check_speedup_input(alpha, k, c_draft, c_verify, k_min=0)
    return ref.expected_tokens_per_forward(alpha, k) / (k * c_draft + c_verify)


@mutant("speculative_speedup", "the tokens per step, not per unit of cost: the step's cost is left out")
def _speedup_no_cost(alpha, k, c_draft, c_verify):
    _check_speedup_input(alpha, k, c_draft, c_verify)
    return ref.expected_tokens_per_forward(alpha, k)


# ---------------------------------------------------------------- rollback_blocks


@mutant("rollback_blocks", "floor instead of ceil: the partly filled last block is freed with its kept tokens")
def _rollback_floor(block_ids, num_tokens, block_size):
    keep = num_tokens // block_size
    freed = block_ids[keep:]
    del block_ids[keep:]
    return freed


@mutant("rollback_blocks", "kept tokens that end exactly on a block edge keep one empty block too many")
def _rollback_edge_keeps_one_more(block_ids, num_tokens, block_size):
    keep = num_tokens // block_size + 1
    freed = block_ids[keep:]
    del block_ids[keep:]
    return freed


@mutant("rollback_blocks", "the removed blocks are returned last first, not in table order")
def _rollback_reversed(block_ids, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    freed = block_ids[keep:]
    del block_ids[keep:]
    return freed[::-1]


@mutant("rollback_blocks", "the table is not trimmed in place (a new list is bound to the name)")
def _rollback_not_in_place(block_ids, num_tokens, block_size):
    keep = -(-num_tokens // block_size)
    freed = block_ids[keep:]
    block_ids = block_ids[:keep]  # noqa: F841 (the caller's list keeps every block)
    return freed


# ---------------------------------------------------------------- next_num_speculative_tokens


@mutant("next_num_speculative_tokens", "the upper threshold is inclusive: acceptance == up goes up")
def _next_k_up_inclusive(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    if acceptance is None:
        return k
    if acceptance >= up:
        k += 1
    elif acceptance < down:
        k -= 1
    return max(k_min, min(k, k_max))


@mutant("next_num_speculative_tokens", "the lower threshold is inclusive: acceptance == down goes down")
def _next_k_down_inclusive(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    if acceptance is None:
        return k
    if acceptance > up:
        k += 1
    elif acceptance <= down:
        k -= 1
    return max(k_min, min(k, k_max))


@mutant("next_num_speculative_tokens", "the directions are swapped: high acceptance drafts fewer")
def _next_k_swapped(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    if acceptance is None:
        return k
    if acceptance > up:
        k -= 1
    elif acceptance < down:
        k += 1
    return max(k_min, min(k, k_max))


@mutant("next_num_speculative_tokens", "clamped before the step, not after: k_max + 1 and k_min - 1 get out")
def _next_k_clamp_first(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    k = max(k_min, min(k, k_max))
    if acceptance is None:
        return k
    return k + 1 if acceptance > up else k - 1 if acceptance < down else k


@mutant("next_num_speculative_tokens", "only k_max is enforced: k goes below k_min")
def _next_k_no_floor(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    if acceptance is None:
        return k
    if acceptance > up:
        k += 1
    elif acceptance < down:
        k -= 1
    return min(k, k_max)


@mutant("next_num_speculative_tokens", "no acceptance yet (None) is read as 0: k goes down",
        same_in_engine="the speculator records a request's history only for steps that drafted, so the "
                       "acceptance it passes (recent_acceptance of that history) is never None")
def _next_k_none_is_zero(k, acceptance, k_max, k_min=1, up=0.8, down=0.5):
    return ref.next_num_speculative_tokens(k, 0.0 if acceptance is None else acceptance, k_max, k_min, up, down)


# ---------------------------------------------------------------- pick_strategy


def _throughputs(n, alpha, k, step_time):
    emitted = ref.expected_tokens_per_forward(alpha, k)
    return {"continuous": n / step_time(n, 1), "speculative": emitted / step_time(1, k + 1),
            "both": n * emitted / step_time(n, k + 1)}


def _check_pick_input(n, alpha, k):
    if n < 1 or not 0.0 <= alpha <= 1.0 or k < 1:
        raise ValueError(f"bad input: num_requests={n}, alpha={alpha}, k={k}")


def _pick(throughput, margin=1.01):
    pick = "continuous"
    for name in ("speculative", "both"):
        if throughput[name] > margin * throughput[pick]:
            pick = name
    return pick


@mutant("pick_strategy", "no 1% margin: any gain, however small, replaces the pick")
def _pick_no_margin(num_requests, alpha, k, step_time):
    _check_pick_input(num_requests, alpha, k)
    return _pick(_throughputs(num_requests, alpha, k, step_time), margin=1.0)


@mutant("pick_strategy", "each strategy is compared with continuous batching, not with the current pick")
def _pick_against_continuous(num_requests, alpha, k, step_time):
    _check_pick_input(num_requests, alpha, k)
    t = _throughputs(num_requests, alpha, k, step_time)
    pick = "continuous"
    for name in ("speculative", "both"):
        if t[name] > 1.01 * t["continuous"]:
            pick = name
    return pick


@mutant("pick_strategy", "a verification step is costed as a plain decode step: step_time(rows, 1)")
def _pick_verify_free(num_requests, alpha, k, step_time):
    _check_pick_input(num_requests, alpha, k)
    return _pick(_throughputs(num_requests, alpha, k, lambda rows, tokens: step_time(rows, 1)))


@mutant("pick_strategy", "throughput per request, not of all the requests together")
def _pick_per_request(num_requests, alpha, k, step_time):
    _check_pick_input(num_requests, alpha, k)
    t = _throughputs(num_requests, alpha, k, step_time)
    return _pick({"continuous": t["continuous"] / num_requests, "speculative": t["speculative"],
                  "both": t["both"] / num_requests})
