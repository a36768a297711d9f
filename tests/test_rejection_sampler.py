"""Speculative sampling leaves the target distribution unchanged (design.md §4).

Three kinds of evidence, each of which a wrong sampler must fail:
- exact enumeration of the output distribution on toy models, driven through
  ``verify_probs`` -- the deterministic half that ``rejection_sample`` runs;
- a sampling test of ``rejection_sample`` itself against plain target sampling, with a
  threshold derived from the sample size (``exactness.tv_threshold``);
- equalities: greedy is the argmax chain, batched == per-row reference, a row's tokens
  do not depend on its batch.
"""
from __future__ import annotations

import pytest
import torch

from minillm.sampling import compute_probs, sample, sample_from_probs
from minillm.sampling_params import SamplingParams
from minillm.bench import exactness as ex
from minillm.spec_decode.rejection_sampler import (
    acceptance_rate,
    draft_probs_from_logits,
    emit_tokens,
    expected_num_emitted,
    rejection_sample,
    rejection_sample_ref,
    residual_distribution,
    verify_probs,
)

EXACT_TOL = 1e-6  # float64 enumeration; a correct rule is off by ~1e-16
WRONG_MIN_GAP = 1e-3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _toy(V: int, seed: int, target: SamplingParams, draft: SamplingParams, before_top_k_top_p: bool = False):
    """(target model, draft model, the q a buggy verifier would be told) on a V-token vocabulary."""
    t_logits = ex.toy_logits_model(V, seed, scale=1.5)
    d_logits = ex.toy_logits_model(V, seed + 1000, scale=1.5, base=t_logits)  # a drafter that roughly agrees
    return (ex.toy_probs_model(t_logits, target), ex.toy_probs_model(d_logits, draft),
            ex.toy_probs_model(d_logits, draft, before_top_k_top_p=True))


def _random_probs(shape, generator, zero_frac=0.3) -> torch.Tensor:
    """Random distributions over the last dim, some entries exactly 0 (like top-k output)."""
    logits = 2 * torch.randn(shape, generator=generator)
    zeros = torch.rand(shape, generator=generator) < zero_frac
    zeros[..., 0] = False  # keep at least one token
    return logits.masked_fill(zeros, float("-inf")).softmax(-1)


def _draft_from(q: torch.Tensor, generator) -> torch.Tensor:
    """Draft tokens [B, k] sampled from q [B, k, V]."""
    B, k, V = q.shape
    return torch.multinomial(q.reshape(B * k, V), 1, generator=generator).reshape(B, k)


# ---------------------------------------------------------------- exact enumeration

SAMPLED = SamplingParams(temperature=1.0)
EXACT_CASES = [  # (V, k, m, seed, target params, draft params)
    (3, 1, 3, 0, SAMPLED, SAMPLED),
    (5, 2, 3, 1, SamplingParams(temperature=0.7), SamplingParams(temperature=1.3)),
    (8, 3, 2, 2, SAMPLED, SamplingParams(temperature=1.0, top_k=3)),
    (6, 2, 2, 3, SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, top_p=0.7)),
    (6, 3, 2, 4, SamplingParams(temperature=0.0), SAMPLED),  # greedy target, sampled draft
    (6, 2, 3, 5, SAMPLED, SamplingParams(temperature=0.0)),  # one-hot (deterministic) drafter
    (4, 2, 3, 6, SamplingParams(temperature=0.0), SamplingParams(temperature=0.0)),  # greedy both
]


@pytest.mark.parametrize("V, k, m, seed, target_params, draft_params", EXACT_CASES)
def test_exact_enumeration_matches_target(V, k, m, seed, target_params, draft_params):
    target, draft, _ = _toy(V, seed, target_params, draft_params)
    spec = ex.enumerate_output_distribution(target, draft, verify_probs, k, m)
    want = ex.target_distribution(target, m)
    assert abs(sum(spec.values()) - 1) < EXACT_TOL
    gap = ex.max_abs_difference(spec, want)
    assert gap < EXACT_TOL, (
        f"speculative decoding (V={V}, k={k}) changes the distribution of the first {m} tokens "
        f"by up to {gap:.2e}; it must equal the target's exactly"
    )


def test_exact_enumeration_with_context():
    target, draft, _ = _toy(5, 7, SAMPLED, SamplingParams(temperature=1.0, top_k=2))
    assert ex.exactness_error(target, draft, verify_probs, k=2, m=2, context=(3, 1, 4)) < EXACT_TOL


@pytest.mark.parametrize("name", sorted(ex.WRONG_RULES))
@pytest.mark.parametrize("k", [1, 2])
def test_exact_enumeration_catches_wrong_rules(name, k):
    target, draft, _ = _toy(6, 11, SAMPLED, SamplingParams(temperature=1.0, top_k=4))
    gap = ex.exactness_error(target, draft, ex.WRONG_RULES[name], k, m=k + 1)  # m > k: the bonus is seen
    assert gap > WRONG_MIN_GAP, f"the wrong rule {name!r} should change the distribution, gap {gap:.2e}"


def test_exact_enumeration_catches_q_before_top_k():
    target, draft, q_before = _toy(6, 12, SAMPLED, SamplingParams(temperature=1.0, top_k=2))
    assert ex.exactness_error(target, draft, verify_probs, 2, 2) < EXACT_TOL
    gap = ex.exactness_error(target, draft, verify_probs, 2, 2, reported_draft=q_before)
    assert gap > WRONG_MIN_GAP, f"q taken before top-k must be caught, gap {gap:.2e}"


def test_expected_num_emitted_matches_enumeration():
    # Distributions that do not depend on the prefix make acceptances independent, so
    # E[num_emitted] is exactly 1 + alpha + ... + alpha^k with alpha = sum min(p, q).
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.3, 0.3], dtype=torch.float64)
    alpha = float(acceptance_rate(p, q))
    assert alpha == pytest.approx(0.2 + 0.2 + 0.2)
    for k in (1, 2, 3):
        drafts = torch.cartesian_prod(*[torch.arange(4)] * k).reshape(-1, k)  # every draft sequence
        weight = q[drafts].prod(-1)  # [N]
        a, _ = verify_probs(drafts, q.expand(len(drafts), k, 4), p.expand(len(drafts), k + 1, 4))
        mean = float((weight * (1 + a.cumprod(-1).sum(-1))).sum())  # 1 + sum_i P(first i+1 accepted)
        assert mean == pytest.approx(expected_num_emitted(alpha, k), abs=1e-12)
    assert expected_num_emitted(1.0, 3) == 4 and expected_num_emitted(0.0, 3) == 1


# ---------------------------------------------------------------- sampling test

V_MC, N_MC, DRAFT_MC = 4, 20_000, SamplingParams(temperature=1.0, top_k=2)


@pytest.fixture(scope="module")
def mc_toy():
    target, draft, q_before = _toy(V_MC, 23, SAMPLED, DRAFT_MC)  # every wrong sampler is off by TV > 0.2
    direct = ex.sample_target(target, N_MC, m=2, generator=_gen(0))
    return target, draft, q_before, direct


def _spec_tv(mc_toy, k, sampler=rejection_sample, reported=None, seed=1):
    target, draft, _, direct = mc_toy
    spec = ex.sample_speculative(target, draft, k, N_MC, m=2, generator=_gen(seed), sampler=sampler,
                                 reported_draft=reported)
    return ex.empirical_tv(spec, direct), ex.tv_threshold(N_MC, V_MC ** 2)


@pytest.mark.parametrize("k", [1, 3])
def test_sampling_matches_target(mc_toy, k):
    tv, threshold = _spec_tv(mc_toy, k)
    assert tv <= threshold, (
        f"first two tokens from rejection_sample (k={k}) vs from the target: TV {tv:.4f} > {threshold:.4f}"
    )


def _wrong_sampler(rule):
    return lambda d, q, p, g: emit_tokens(d, *rule(d, q, p), g)


# unnormalized_residual is absent on purpose: the exponential race normalizes implicitly,
# so that bug is harmless to this sampler (the enumeration still flags the contract).
@pytest.mark.parametrize("name", ["always_accept", "resample_target", "resample_draft", "bonus_off_by_one",
                                  "q_before_top_k"])
def test_sampling_catches_wrong_samplers(mc_toy, name):
    target, draft, q_before, _ = mc_toy
    threshold = ex.tv_threshold(N_MC, V_MC ** 2)
    rule, reported = (verify_probs, q_before) if name == "q_before_top_k" else (ex.WRONG_RULES[name], None)
    exact = ex.total_variation(ex.enumerate_output_distribution(target, draft, rule, 1, 2, reported_draft=reported),
                               ex.target_distribution(target, 2))
    assert exact > 2 * threshold, f"toy too weak to test {name}: exact TV {exact:.3f}, threshold {threshold:.3f}"
    tv, _ = _spec_tv(mc_toy, 1, sampler=_wrong_sampler(rule), reported=reported)
    assert tv > threshold, f"the wrong sampler {name!r} passed the sampling test: TV {tv:.4f} <= {threshold:.4f}"


def test_compare_samplers_api():
    draws = lambda seed: lambda n: torch.randint(0, 3, (n, 2), generator=_gen(seed))  # noqa: E731
    tv, threshold, passed = ex.compare_samplers(draws(0), draws(1), 5000, num_cells=9)
    assert passed and 0 <= tv <= threshold
    skewed = lambda n: torch.zeros(n, 2, dtype=torch.long)  # noqa: E731
    assert not ex.compare_samplers(draws(0), skewed, 5000, num_cells=9)[2]


# ---------------------------------------------------------------- equalities and edge cases


def _batch(B, k, V, seed, dtype=torch.float32):
    g = _gen(seed)
    q = _random_probs((B, k, V), g).to(dtype)
    p = _random_probs((B, k + 1, V), g).to(dtype)
    d = _draft_from(q.float(), g)
    return d, q, p


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference(dtype):
    B, k, V = 16, 3, 7
    d, q, p = _batch(B, k, V, 0, dtype)
    p[1, :k] = q[1]  # p == q: accept everything
    p[2] = torch.nn.functional.one_hot(p[2].argmax(-1), V).to(dtype)  # greedy target
    d[3, 1:] = -1  # a row with a single draft
    d[4, :] = -1  # a row with none
    for gens in (_gen(5), [_gen(100 + b) for b in range(B)]):
        ref_gens = _gen(5) if isinstance(gens, torch.Generator) else [_gen(100 + b) for b in range(B)]
        out, num = rejection_sample(d, q, p, gens)
        ref_out, ref_num = rejection_sample_ref(d, q, p, ref_gens)
        assert torch.equal(out, ref_out) and torch.equal(num, ref_num)
    assert int(num[1]) == k + 1 and int(num[4]) == 1 and int(num[3]) <= 2


def test_output_format():
    B, k, V = 64, 4, 9
    d, q, p = _batch(B, k, V, 1)
    out, num = rejection_sample(d, q, p, _gen(2))
    assert out.shape == (B, k + 1) and out.dtype == torch.long and num.shape == (B,) and num.dtype == torch.long
    assert ((num >= 1) & (num <= k + 1)).all()
    for b in range(B):
        n = int(num[b])
        assert torch.equal(out[b, :n - 1], d[b, :n - 1]), "the emitted prefix is the accepted drafts"
        assert (out[b, n:] == -1).all() and 0 <= int(out[b, n - 1]) < V
        if n <= k:  # stopped by a rejection: the last token comes from the residual
            assert residual_distribution(p[b, n - 1], q[b, n - 1])[out[b, n - 1]] > 0
    assert (num < k + 1).any() and (num > 1).any(), "this batch should see both rejections and acceptances"


def test_greedy_is_the_argmax_chain():
    B, k, V = 8, 4, 11
    greedy = [SamplingParams(temperature=0.0)] * B
    t_logits = torch.randn(B, k + 1, V, generator=_gen(3))
    p = draft_probs_from_logits(t_logits, greedy)  # one-hot rows
    d = t_logits[:, :k].argmax(-1)
    d[::2, 2] = (d[::2, 2] + 1) % V  # even rows: the third draft is wrong
    q = draft_probs_from_logits(torch.nn.functional.one_hot(d, V).float() * 5, greedy)
    outs = [rejection_sample(d, q, p, _gen(s)) for s in (0, 1, 2)]
    assert all(torch.equal(o[0], outs[0][0]) for o in outs), "greedy must not depend on the random numbers"
    out, num = outs[0]
    argmax = t_logits.argmax(-1)  # [B, k+1]
    for b in range(B):
        n = 3 if b % 2 == 0 else k + 1
        assert int(num[b]) == n
        assert out[b, :n].tolist() == argmax[b, :n].tolist(), "accept while draft == argmax, then emit the argmax"


def test_batch_independence():
    B, k, V = 6, 3, 8
    d, q, p = _batch(B, k, V, 4)
    alone = rejection_sample(d[:1], q[:1], p[:1], [_gen(42)])
    for seed in (5, 6):
        d2, q2, p2 = _batch(B, k, V, seed)
        d2[0], q2[0], p2[0] = d[0], q[0], p[0]
        out, num = rejection_sample(d2, q2, p2, [_gen(42)] + [_gen(seed + b) for b in range(1, B)])
        assert torch.equal(out[0], alone[0][0]) and num[0] == alone[1][0], "row 0 must not see its batch"


def test_one_hot_drafts_and_none():
    B, k, V = 10, 3, 6
    g = _gen(7)
    p = _random_probs((B, k + 1, V), g)
    d = torch.randint(0, V, (B, k), generator=g)
    d = torch.where(p[:, :k].gather(-1, d[..., None])[..., 0] > 0, d, p[:, :k].argmax(-1))  # some accepts
    one_hot = torch.nn.functional.one_hot(d, V).float()
    a, _ = verify_probs(d, None, p)
    assert torch.allclose(a, p[:, :k].gather(-1, d[..., None])[..., 0]), "a one-hot q accepts x with probability p(x)"
    assert torch.equal(rejection_sample(d, None, p, _gen(1))[0], rejection_sample(d, one_hot, p, _gen(1))[0])


def test_k_zero_is_plain_sampling():
    p = _random_probs((5, 1, 6), _gen(8))
    out, num = rejection_sample(torch.zeros(5, 0, dtype=torch.long), torch.zeros(5, 0, 6), p, _gen(9))
    assert out.shape == (5, 1) and (num == 1).all() and (p[:, 0].gather(-1, out) > 0).all()


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2, 0.0]), torch.tensor([0.2, 0.2, 0.3, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.75, 0.25, 0.0, 0.0]))
    torch.testing.assert_close(residual_distribution(p, p), p)  # no mass: fall back to p (never sampled)


def test_zero_draft_probability_is_an_error():
    d, q, p = _batch(2, 2, 5, 10)
    q[1, 0] = torch.nn.functional.one_hot((d[1, 0] + 1) % 5, 5).float()  # q(x) = 0 for the drafted x
    with pytest.raises(ValueError, match="probability 0"):
        rejection_sample(d, q, p)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(d, q, p[:, :2])
    bad = d.clone()
    bad[0] = torch.tensor([-1, 2])
    with pytest.raises(ValueError, match="-1"):
        rejection_sample(bad, q, p)


def test_draft_probs_are_what_the_draft_sampled_from():
    B, k, V = 4, 3, 50
    logits = (3 * torch.randn(B, k, V, generator=_gen(11))).to(torch.bfloat16)  # a low-precision draft model
    params = [SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.2, top_p=0.6),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=10, top_p=0.9)]
    q = draft_probs_from_logits(logits, params)
    assert q.dtype == torch.float32 and q.shape == (B, k, V)
    assert ((q > 0).sum(-1)[0] <= 5).all() and ((q > 0).sum(-1)[2] == 1).all(), "after top-k; greedy is one-hot"
    torch.testing.assert_close(q.sum(-1), torch.ones(B, k))
    naive = (logits.float() / 0.8).softmax(-1)[0]  # the bug: a softmax before top-k
    assert not torch.allclose(q[0], naive)
    for i in range(k):  # the engine's own sampler draws from exactly these rows
        gens_a = [_gen(20 + b) for b in range(B)]
        gens_b = [_gen(20 + b) for b in range(B)]
        sampled = sample(logits[:, i], params, gens_a)
        non_greedy = [0, 1, 3]
        from_q = sample_from_probs(q[non_greedy, i], [gens_b[b] for b in non_greedy])
        assert torch.equal(sampled[non_greedy], from_q)
        torch.testing.assert_close(q[:, i], compute_probs(logits[:, i], params))
