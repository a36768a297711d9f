"""Rejection sampling: verify k drafted tokens against the target model, exactly.

A cheap drafter proposes tokens x_0 .. x_{k-1}, each sampled from its distribution
q_i; one forward of the target model over those k tokens gives k + 1 distributions
p_0 .. p_k (p_i is the target's distribution for the slot of x_i, p_k the one after
the last draft). Walking left to right (Leviathan et al. 2023, "Fast Inference from
Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling"):

    accept x_i with probability  min(1, p_i(x_i) / q_i(x_i))
    at the first rejection       emit a sample of  norm(max(0, p_i - q_i))  and stop
    if all k are accepted        emit a "bonus" sample of p_k

Every emitted token then has exactly the target's distribution: the accepted mass is
min(p, q), the rejected mass is sum(max(0, q - p)) = sum(max(0, p - q)), and the residual
puts that mass where p exceeds q. One step emits between 1 and k + 1 tokens.

The code is split in two so the exactness test (``minillm/bench/exactness.py``) can check
the very function the sampler runs:

    verify_probs   deterministic: the acceptance probability of every draft and the
                   distribution of the token emitted wherever the walk stops;
    emit_tokens    the random half: k uniforms and one categorical draw per row.

Greedy needs no special case: ``minillm.sampling.compute_probs`` makes greedy rows
one-hot, so a draft is accepted iff it is the target's argmax and the residual is the
one-hot of that argmax.

The engine verifies with ``coupled_verify``, the same rule for a deterministic drafter
but driven by noise fixed per token position, so that a seeded request's text does not
depend on what was drafted (and hence on its batch); see its docstring for the proof and
``coupled_acceptance_rate`` for what it costs a sampling drafter.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from minillm.sampling import compute_probs, exponential_race
from minillm.sampling_params import SamplingParams
from minillm.seams import SeamContractError

Generators = torch.Generator | Sequence[torch.Generator | None] | None


# ---------------------------------------------------------------- the pieces of the rule


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)), elementwise. q(x) must be > 0: x was sampled from q."""
    return (p_x / q_x).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim: where a rejected token is resampled from.

    p, q [..., V] -> [..., V]. When p == q the residual has no mass; we return p then.
    That choice never changes the output distribution: with p == q every acceptance
    probability is 1, so this row is never the one sampled from. (With rounding the
    mass can be tiny rather than zero; the walk stops here with probability equal to
    that mass, so the noise it normalizes is reached just as rarely.)
    """
    r = (p - q).clamp(min=0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


def acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q): the chance one draft is accepted.

    p, q [..., V] -> [...]. It is E_{x~q}[min(1, p(x)/q(x))], the expectation of
    ``acceptance_probability`` over the drafts.
    """
    return torch.minimum(p, q).sum(dim=-1)


def expected_num_emitted(alpha: float, k: int) -> float:
    """Mean tokens per verification step if each draft is accepted with probability alpha.

    1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha); k + 1 when alpha = 1.
    (Assumes acceptances are independent, the simplification both papers use.)
    """
    if not 0.0 <= alpha <= 1.0 or k < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and k >= 0, got alpha={alpha}, k={k}")
    return float(k + 1) if alpha == 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def draft_probs_from_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                            table: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, n, V] -> probabilities [B, n, V] float32, row b under params[b].

    q must be *exactly* the distribution the draft token was sampled from: after
    temperature, top-k and top-p, in the same dtype. A classic bug takes q as a plain
    softmax of the draft logits (before top-k/top-p) or in another dtype: the ratio
    p(x)/q(x) is then wrong and the output drifts from the target distribution, which
    only a distribution test notices (``tests/test_rejection_sampler.py`` checks it).
    Sample the draft from these very probabilities (``sample_from_probs``) and pass
    them on. The target rows [B, k + 1, V] are computed the same way
    (``target_probs_from_logits``), so greedy requests get one-hot rows on both sides.
    ``table``: the [B * n, 3] parameter table already on the device (``compute_probs``;
    the engine's step upload carries it), or None to upload it here.
    """
    B, n, V = logits.shape
    if len(params) != B:
        raise ValueError(f"need one SamplingParams per row: {B} rows, {len(params)} params")
    flat = [p for p in params for _ in range(n)]  # row b repeated for each of its n positions
    return compute_probs(logits.reshape(B * n, V), flat, table).reshape(B, n, V)


target_probs_from_logits = draft_probs_from_logits


# ---------------------------------------------------------------- deterministic half


def _check_shapes(draft_token_ids, draft_probs, target_probs) -> tuple[int, int, int]:
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, k], got shape {tuple(draft_token_ids.shape)}")
    B, k = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], got {tuple(target_probs.shape)}")
    V = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (B, k, V):
        raise ValueError(f"draft_probs must be [B, k, V] = [{B}, {k}, {V}], got {tuple(draft_probs.shape)}")
    return B, k, V


def verify_probs(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule, without randomness: (accept_probs [B, k], emit_probs [B, k+1, V]).

    accept_probs[b, i] = min(1, p_i(x_i) / q_i(x_i));
    emit_probs[b, i]   = the distribution of the token emitted if the walk stops at i:
                         the residual norm(max(0, p_i - q_i)) for i < k, p_k for i = k.

    draft_token_ids [B, k] long; -1 marks "no draft here" for rows with fewer than k
    drafts (it must be a suffix): the walk stops there with probability 1 and emits a
    sample of p_i, the bonus for that row. draft_probs [B, k, V], or None for a
    deterministic drafter (n-gram lookup): q is then the one-hot of each draft.
    target_probs [B, k+1, V]. Computes in float32 or wider.

    Raises ValueError if a draft has q(x) = 0: a correct drafter cannot sample such a
    token, so its q is not the distribution it sampled from (the bug this catches).
    """
    B, k, V = _check_shapes(draft_token_ids, draft_probs, target_probs)
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    p = target_probs.to(dtype)  # [B, k+1, V]
    valid = draft_token_ids >= 0  # [B, k]
    if (valid[:, 1:] & ~valid[:, :-1]).any():
        raise ValueError("-1 in draft_token_ids must only pad the end of a row")
    x = draft_token_ids.clamp(min=0)  # [B, k], padding gathers token 0 and is masked below
    if draft_probs is None:
        q = torch.nn.functional.one_hot(x, V).to(dtype)  # [B, k, V]
    else:
        q = draft_probs.to(dtype)
    q_x = q.gather(-1, x[..., None]).squeeze(-1)  # [B, k]
    p_x = p[:, :k].gather(-1, x[..., None]).squeeze(-1)  # [B, k]
    if (valid & (q_x <= 0)).any():
        b, i = (valid & (q_x <= 0)).nonzero()[0].tolist()
        raise ValueError(
            f"draft token {int(draft_token_ids[b, i])} (row {b}, position {i}) has probability 0 under "
            f"draft_probs: q must be the exact distribution the draft was sampled from "
            f"(after temperature, top-k and top-p)"
        )
    accept = torch.where(valid, acceptance_probability(p_x, q_x.clamp(min=torch.finfo(dtype).tiny)), 0.0)
    residual = torch.where(valid[..., None], residual_distribution(p[:, :k], q), p[:, :k])  # [B, k, V]
    return accept, torch.cat([residual, p[:, k:]], dim=1)


# ---------------------------------------------------------------- random half


def _draw_randomness(B: int, k: int, V: int, generator: Generators,
                     device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """k uniforms and V exponentials per row, whatever the outcome.

    A fixed budget per row keeps a request's random stream in step with its own
    history only: with one generator per row, row b's tokens do not depend on how
    many drafts other rows accepted, nor on the batch they share.
    """
    if generator is None or isinstance(generator, torch.Generator):
        u = torch.rand(B, k, generator=generator, device=device, dtype=dtype)
        e = torch.empty(B, V, device=device, dtype=dtype).exponential_(generator=generator)
        return u, e
    if len(generator) != B:
        raise ValueError(f"need one generator per row: {B} rows, {len(generator)} generators")
    u = torch.empty(B, k, device=device, dtype=dtype)
    e = torch.empty(B, V, device=device, dtype=dtype)
    for b, g in enumerate(generator):
        u[b] = torch.rand(k, generator=g, device=device, dtype=dtype)
        e[b].exponential_(generator=g)
    return u, e


def _categorical(probs: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """argmax(probs / e), E ~ Exp(1): index i with probability probs[i] / sum(probs).

    The same exponential race as ``minillm.sampling.sample_from_probs``. Zero-probability
    entries are forced to score 0 so an exponential that is exactly 0 cannot make 0/0 = nan
    win the argmax.
    """
    return torch.where(probs > 0, probs / e, 0.0).argmax(dim=-1)


def emit_tokens(draft_token_ids: torch.Tensor, accept_probs: torch.Tensor, emit_probs: torch.Tensor,
                generator: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Walk the drafts with the rule's probabilities; see ``rejection_sample`` for the output.

    Draft i is accepted iff u_i < accept_probs[b, i] (probability exactly accept_probs,
    u ~ U[0, 1)); the walk stops at the first rejection, or after k acceptances, and
    the last token is a sample of emit_probs[b, stop].
    """
    B, k = draft_token_ids.shape
    V = emit_probs.shape[-1]
    u, e = _draw_randomness(B, k, V, generator, emit_probs.device, emit_probs.dtype)
    accepted = u < accept_probs  # [B, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B] leading run of acceptances
    rows = torch.arange(B, device=emit_probs.device)
    last = _categorical(emit_probs[rows, num_accepted], e)  # [B] residual, target or bonus sample
    positions = torch.arange(k + 1, device=emit_probs.device)[None, :]  # [1, k+1]
    out = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], dim=1)  # [B, k+1]
    out = torch.where(positions < num_accepted[:, None], out, -1)
    out[rows, num_accepted] = last
    return out, num_accepted + 1


def rejection_sample(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_probs: torch.Tensor,
                     generator: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for a batch: the tokens to append to each request.

    Shapes: draft_token_ids [B, k] long (-1 pads rows with fewer drafts), draft_probs
    [B, k, V] (None: one-hot, for deterministic drafters), target_probs [B, k+1, V];
    generator: one torch.Generator for the batch, or a list of B (one per request,
    each row then draws only from its own), or None for the global RNG.

    Returns (output_token_ids [B, k+1] long, num_emitted [B] long): row b emits
    output_token_ids[b, :num_emitted[b]] -- the accepted drafts, then one residual or
    bonus token -- and holds -1 after; 1 <= num_emitted[b] <= k + 1.
    """
    accept_probs, emit_probs = verify_probs(draft_token_ids, draft_probs, target_probs)
    return emit_tokens(draft_token_ids, accept_probs, emit_probs, generator)


def rejection_sample_ref(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_probs: torch.Tensor,
                         generator: Generators = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The same algorithm one row and one draft at a time: the oracle for the batched one.

    It draws the same random numbers in the same order, so with equal generators the
    two return equal tokens.
    """
    B, k, V = _check_shapes(draft_token_ids, draft_probs, target_probs)
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    u, e = _draw_randomness(B, k, V, generator, target_probs.device, dtype)
    out = torch.full((B, k + 1), -1, dtype=torch.long)
    num = torch.zeros(B, dtype=torch.long)
    for b in range(B):
        emitted: list[int] = []
        for i in range(k + 1):
            p = target_probs[b, i].to(dtype)
            x = int(draft_token_ids[b, i]) if i < k else -1
            if x < 0:  # past the drafts: the bonus token from the target
                emitted.append(int(_categorical(p, e[b])))
                break
            q = draft_probs[b, i].to(dtype) if draft_probs is not None else torch.zeros(V, dtype=dtype)
            if draft_probs is None:
                q[x] = 1.0
            if q[x] <= 0:
                raise ValueError(f"draft token {x} (row {b}, position {i}) has probability 0 under draft_probs")
            if u[b, i] < min(1.0, float(p[x] / q[x])):
                emitted.append(x)  # accepted: keep it and look at the next draft
                continue
            emitted.append(int(_categorical(residual_distribution(p, q), e[b])))
            break
        out[b, :len(emitted)] = torch.tensor(emitted)
        num[b] = len(emitted)
    return out.to(draft_token_ids.device), num.to(draft_token_ids.device)


# ---------------------------------------------------------------- the engine's verifier


def coupled_verify(draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
                   noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Verification coupled to plain sampling: emit what the target itself samples, as far as the drafts agree.

    draft_token_ids [B, k] long (-1 pads rows with fewer drafts), target_probs [B, k+1, V],
    noise [B, k+1, V] of Exp(1): the noise of the positions the k drafts and the bonus
    token would land at (``minillm.sampling.position_noise``; all ones for greedy rows).
    Returns (output_token_ids [B, k+1], num_emitted [B]) as ``rejection_sample`` does.

    At each slot i the target's own token is y_i = argmax(p_i / E_i) -- the token plain
    sampling draws at that position. Draft x_i is accepted iff x_i == y_i; the walk stops
    at the first mismatch and emits y_i there, or after k acceptances emits the bonus y_k.
    Every emitted token is a y, and the y's before a mismatch are the drafts: the output
    IS plain sampling's output, token for token, whatever was drafted. So it is exact,
    and it does not depend on how many drafts the batch allowed this step.

    Deterministic drafter (n-gram; q one-hot on x): this is the rule of Leviathan et al.
    (2023) and Chen et al. (2023). Accept: P(y = x) = p(x) = min(1, p(x) / q(x)).
    Reject: for z != x the event {y = z} lies inside {y != x}, so
    P(y = z | y != x) = p(z) / (1 - p(x)): p without x, renormalized, which is the
    residual norm(max(0, p - one_hot(x))). Any exact sampler of p would do for this
    drafter; the exponential race matters for the next one.

    Sampling drafter (a draft model at temperature > 0): it must draw x_i = argmax(q_i / E_i)
    with the SAME noise E_i (``ModelDrafter`` does), so that x_i = y_i whenever q_i and p_i
    are close. The acceptance is then P(argmax q/E = argmax p/E), the Gumbel-max coupling
    (Daliri, Musco and Suresh 2024, "Coupling without Communication and Drafter-Invariant
    Speculative Decoding"), which lies between (1 - TV) / (1 + TV) and the rule's
    1 - TV = sum min(p, q) (``coupled_acceptance_rate``): lower acceptance -- for SmolLM2's
    24-layer self-draft at temperature 0.8 about 0.49 against the rule's 0.57 -- bought for
    outputs that do not depend on the drafter. q plays no part in the check: the
    drafter's use of the noise is what couples it.
    """
    if draft_token_ids.dim() != 2:
        raise ValueError(f"draft_token_ids must be [B, k], got shape {tuple(draft_token_ids.shape)}")
    B, k = draft_token_ids.shape
    if target_probs.dim() != 3 or tuple(target_probs.shape[:2]) != (B, k + 1):
        raise ValueError(f"target_probs must be [B, k+1, V] = [{B}, {k + 1}, V], got {tuple(target_probs.shape)}")
    if noise.shape != target_probs.shape:
        raise ValueError(f"noise must have target_probs' shape {tuple(target_probs.shape)}, got {tuple(noise.shape)}")
    # No check that -1 only pads the end (it would read the device): a -1 never matches,
    # so the walk stops at the first one wherever it is, and what is emitted is still y.
    y = exponential_race(target_probs, noise.to(target_probs.dtype))  # [B, k+1]: the target's own tokens
    match = draft_token_ids == y[:, :k]  # padding (-1) never matches
    num_accepted = match.long().cumprod(dim=-1).sum(dim=-1)  # [B] leading run of agreements
    positions = torch.arange(k + 1, device=y.device)[None, :]
    out = torch.where(positions <= num_accepted[:, None], y, -1)
    return out, num_accepted + 1


def coupled_acceptance_rate(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P(argmax q/E = argmax p/E), E ~ Exp(1)^V: one draft's acceptance under ``coupled_verify``.

    p, q [..., V] -> [...]. Both races pick i iff E_j > E_i m_j for every j != i, with
    m_j = max(p_j / p_i, q_j / q_i); given E_i = e that has probability prod_j exp(-e m_j),
    and integrating over e ~ Exp(1) gives P(both pick i) = 1 / (1 + sum_{j != i} m_j).
    Sum over i with p_i, q_i > 0. Equals p(x) for a one-hot q on x (the rule's
    acceptance), 1 for p == q, and is at most ``acceptance_rate(p, q)`` = sum min(p, q)
    (a coupling cannot agree more often than 1 - TV). O(V^2): for toy vocabularies.
    """
    dtype = torch.promote_types(p.dtype, torch.float64)
    p, q = p.to(dtype), q.to(dtype)
    both = (p > 0) & (q > 0)  # [..., V] tokens both races can pick
    safe_p, safe_q = torch.where(both, p, 1.0), torch.where(both, q, 1.0)
    ratios = torch.maximum(p[..., None, :] / safe_p[..., :, None], q[..., None, :] / safe_q[..., :, None])
    return torch.where(both, 1.0 / ratios.sum(dim=-1), 0.0).sum(dim=-1)


def _checked_rule_answer(answer, drafts: list[int], V: int) -> tuple[list[int], torch.Tensor]:
    """A plugged rule's (accepted drafts, distribution of the next token), checked before a token
    is drawn from it: the walk emits the accepted drafts, then one token sampled from a
    distribution over the V tokens; after a rejection that distribution is norm(max(0, p - q))
    with q the one-hot of the rejected draft, which gives that draft nothing (the coupling of
    ``per_row_verifier`` is exact only then)."""

    def broken(invariant: str, got: str) -> SeamContractError:
        return SeamContractError("rejection_sample_one", invariant, got)

    k = len(drafts)
    if not (isinstance(answer, (tuple, list)) and len(answer) == 2):
        raise broken("it returns (accepted draft tokens, distribution of the next token)",
                     f"it returned {type(answer).__name__} {str(answer)[:80]}")
    accepted, dist = answer
    accepted = [int(x) for x in accepted]
    if len(accepted) > k:
        raise broken(f"it accepts between 0 and k={k} drafts", f"it accepted {len(accepted)}: {accepted}")
    if accepted != drafts[:len(accepted)]:
        raise broken(f"the accepted tokens are a prefix of the drafts {drafts}", f"it returned {accepted}")
    if not isinstance(dist, torch.Tensor) or tuple(dist.shape) != (V,):
        shape = tuple(dist.shape) if isinstance(dist, torch.Tensor) else type(dist).__name__
        raise broken(f"the next token's distribution is one tensor [V={V}]", f"it returned {shape}")
    d = dist.detach().double()
    j = len(accepted)
    where = f"after accepting {j} of {k} drafts {drafts}"
    if not bool(torch.isfinite(d).all()) or bool((d < 0).any()):
        raise broken("the next token's distribution holds probabilities, finite and >= 0",
                     f"{where} it holds {str(dist.tolist())[:120]}")
    total = float(d.sum())
    if abs(total - 1.0) > 1e-3:
        raise broken("the next token's distribution sums to 1", f"{where} it sums to {total:.6g}")
    if j < k and float(d[drafts[j]]) > 1e-6:
        raise broken(f"after draft {j} (token {drafts[j]}) is rejected, the next token comes from "
                     "norm(max(0, p - q)), which gives the rejected draft probability 0",
                     f"{where} it gives token {drafts[j]} probability {float(d[drafts[j]]):.4g}")
    return accepted, dist


def per_row_verifier(rule: Callable) -> Callable:
    """A verifier (``coupled_verify``'s signature) built on a one-request rule with the
    signature of chapter 5's exercise ``rejection_sample_one(draft_tokens, q, p, uniforms)
    -> (accepted draft tokens, distribution of the next token)``.

    q is the one-hot of each draft (a deterministic drafter: prompt lookup, or any drafter
    at temperature 0). The randomness comes from the same per-position Exp(1) noise as
    plain sampling: draft i is judged with u_i = exp(-E_i[x_i]), which is Uniform(0, 1),
    and the next token is argmax(r / E_j) of the returned distribution r at the stopping
    slot j. After a rejection r(x_j) = 0, so the sample reads only E_j[z] for z != x_j,
    which are independent of u_j: the pair is an exact sample of the rule. Greedy rows
    (noise all ones) emit exactly the library's tokens. Each answer is checked before a
    token is drawn from it (``_checked_rule_answer``): a broken one is a SeamContractError.
    """
    def verify(draft_token_ids: torch.Tensor, target_probs: torch.Tensor,
               noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, k = draft_token_ids.shape
        V = target_probs.shape[-1]
        out = torch.full((B, k + 1), -1, dtype=torch.long, device=target_probs.device)
        num = torch.zeros(B, dtype=torch.long, device=target_probs.device)
        for b in range(B):
            drafts = [int(x) for x in draft_token_ids[b].tolist() if x >= 0]
            s = len(drafts)
            p = target_probs[b, :s + 1].float()  # [s+1, V]
            idx = torch.tensor(drafts, dtype=torch.long, device=p.device)
            q = torch.zeros(s, V, dtype=p.dtype, device=p.device)
            q[torch.arange(s, device=p.device), idx] = 1.0
            u = torch.exp(-noise[b, torch.arange(s, device=p.device), idx].float()) if s else p.new_zeros(0)
            accepted, dist = _checked_rule_answer(rule(drafts, q, p, u), drafts, V)
            j = len(accepted)
            nxt = exponential_race(dist.to(p.dtype)[None], noise[b, j][None].to(p.dtype))[0]
            row = accepted + [int(nxt)]
            out[b, :len(row)] = torch.tensor(row, dtype=torch.long, device=out.device)
            num[b] = len(row)
        return out, num

    return verify
