"""Speculative sampling on the real model leaves the output distribution unchanged.

Layer (b) of the exactness test (layer (a), exact enumeration on toy vocabularies, is in
test_rejection_sampler.py; layer (c), greedy equality, in test_spec_engine.py).

The statistic: the joint distribution of the first two generated tokens. Without
speculation it is known exactly: P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1), with
p the distribution the sampler draws from (temperature, top-k), computed from the
model's logits -- 1 + top_k forwards. With speculation we draw n samples: n copies of
the request with different seeds, all in ONE engine run (they batch). The first token
comes from the prefill; the second is where the drafts are verified (the prompt
repeats itself, so prompt lookup drafts at almost every request).

The threshold (``exactness.tv_threshold``, one sample against an exact distribution):
with C cells and n draws, E[TV] <= 1/2 sum_c sqrt(pi_c (1 - pi_c) / n) <= sqrt((C - 1) / (4n))
(Cauchy-Schwarz), and TV moves by at most 1/n when one draw changes, so McDiarmid gives
P(TV >= E[TV] + t) <= exp(-2 n t^2): t = sqrt(ln(1/delta) / (2n)). A correct sampler
fails with probability < delta = 1e-6. With C = 9 cells (top_k = 3) and n = 800 the
threshold is about 0.143.

A deliberately wrong verifier must fail the same test: "always accept" the drafts makes
the second token follow the n-gram proposal (its exact TV from the target is ~0.7 here),
so a smaller sample (n = 300, threshold 0.233) already exposes it. It is swapped in where
the engine's verifier sits (``Speculator.verifier``, ``coupled_verify`` by default).
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from minillm import SamplingParams, loader
from minillm.config import EngineConfig
from minillm.engine import build_engine
from minillm.model_runner import prompt_logits
from minillm.sampling import compute_probs, exponential_race
from minillm.bench import exactness as ex

pytestmark = pytest.mark.slow

PROMPT = "cat dog cat dog cat"  # repeats itself: prompt lookup drafts the continuation
# max_tokens=3: the step that samples the second token may then draft (the last token of a
# request is never drafted: it could only be emitted as the bonus). Only t1, t2 are counted.
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
N = 800
N_WRONG = 300
DELTA = 1e-6


@pytest.fixture(scope="module")
def setup():
    weights, tok = loader.load_weights(None), loader.load_tokenizer(None)
    return weights, tok, tok(PROMPT).input_ids


def exact_joint(weights, tok, ids) -> dict[tuple[int, int], float]:
    """P(t1, t2) without speculation, from the target's own distributions."""
    engine = make_engine(weights, tok, None)
    model = engine.model
    with torch.inference_mode():
        p1 = compute_probs(prompt_logits(model, ids)[-1:], [PARAMS])[0].double()
        joint = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = compute_probs(prompt_logits(model, ids + [t1])[-1:], [PARAMS])[0].double()
            for t2 in p2.nonzero().flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
    return joint


def make_engine(weights, tok, spec):
    cfg = EngineConfig(engine="paged", device="cpu", dtype="float32", max_model_len=32, max_num_seqs=400,
                       max_num_batched_tokens=4096, seed=1234, speculative=spec)
    return build_engine(cfg, weights=weights, tokenizer=tok)


def sample_joint(engine, ids, n) -> dict[tuple[int, int], float]:
    """Empirical P(t1, t2) of n requests, each with its own seed (engine-assigned): its own noise."""
    outs = engine.run([engine.make_request(ids, PARAMS) for _ in range(n)])
    counts = Counter(tuple(o.token_ids[:2]) for o in outs)
    return {c: v / n for c, v in counts.items()}


def always_accept(draft_token_ids, target_probs, noise):
    """The wrong verifier: every draft is accepted, whatever the target samples; then the bonus token."""
    B = draft_token_ids.shape[0]
    rows = torch.arange(B, device=draft_token_ids.device)
    n = (draft_token_ids >= 0).sum(dim=-1)  # all of each row's drafts
    out = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], dim=1)
    out[rows, n] = exponential_race(target_probs, noise)[rows, n]
    return out, n + 1


# Suffixes down to one token, so a draft is proposed whether t1 is " cat" or " dog".
SPEC = dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=1, disable_by_batch_size=None)


def tv_test(engine, ids, exact, n) -> tuple[float, float]:
    """(TV between n speculative samples and the exact joint, the threshold for n)."""
    got = sample_joint(engine, ids, n)
    return ex.total_variation(got, exact), ex.tv_threshold(n, num_cells=len(exact), delta=DELTA, two_sample=False)


def test_sampling_matches_the_target_and_a_wrong_sampler_fails(setup):
    weights, tok, ids = setup
    exact = exact_joint(weights, tok, ids)

    engine = make_engine(weights, tok, SPEC)
    tv, threshold = tv_test(engine, ids, exact, N)
    stats = engine.spec_stats
    assert stats.verify_rows > N // 2, "prompt lookup should draft for most requests"
    assert 0 < stats.num_accepted < stats.num_drafts, "the test needs both accepted and rejected drafts"
    assert tv < threshold, (f"speculative sampling changed the distribution of the first two tokens: "
                            f"TV {tv:.3f} >= threshold {threshold:.3f} (n={N}, {len(exact)} cells)")

    wrong = make_engine(weights, tok, SPEC)
    wrong.speculator.verifier = always_accept
    bad_tv, bad_threshold = tv_test(wrong, ids, exact, N_WRONG)
    assert bad_tv > bad_threshold, (
        f"the always-accept verifier passed the test (TV {bad_tv:.3f} < {bad_threshold:.3f}): "
        "the test cannot tell a wrong sampler from a right one")
