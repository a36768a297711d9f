"""Grades exercises/ch05_speculative_sampling.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here in float64, never taken from minillm, so the tests stay
meaningful for the solutions that wrap minillm. Small tensors only: seconds to run.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch05_speculative_sampling"
accept_probability = adapters.function(CHAPTER, "accept_probability")
residual_distribution = adapters.function(CHAPTER, "residual_distribution")
acceptance_rate = adapters.function(CHAPTER, "acceptance_rate")
rejection_sample_one = adapters.function(CHAPTER, "rejection_sample_one")
ngram_propose = adapters.function(CHAPTER, "ngram_propose")
expected_tokens_per_forward = adapters.function(CHAPTER, "expected_tokens_per_forward")
speculative_speedup = adapters.function(CHAPTER, "speculative_speedup")
rollback_blocks = adapters.function(CHAPTER, "rollback_blocks")
next_num_speculative_tokens = adapters.function(CHAPTER, "next_num_speculative_tokens")
pick_strategy = adapters.function(CHAPTER, "pick_strategy")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _dist(*shape: int, seed: int, zero_frac: float = 0.3) -> torch.Tensor:
    """Random float64 distributions over the last dim, some entries exactly 0."""
    g = _gen(seed)
    logits = 2 * torch.randn(shape, generator=g, dtype=torch.float64)
    zeros = torch.rand(shape, generator=g) < zero_frac
    zeros[..., 0] = False
    return logits.masked_fill(zeros, float("-inf")).softmax(-1)


def _residual_ref(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = (p - q).clamp(min=0)
    return r / r.sum()


def _v(t: torch.Tensor) -> list:
    """A tensor's values, rounded for a failure line."""
    return [round(float(x), 4) for x in t.flatten()] if t.dim() else round(float(t), 4)


# ---------------------------------------------------------------- accept_probability


def test_accept_probability_values():
    """Contract: elementwise min(1, p_x / q_x); p >= q is always kept, p = 0 never is."""
    p_x = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.2])
    q_x = torch.tensor([0.25, 0.4, 0.3, 0.3, 0.1])
    adapters.expect_close(accept_probability(p_x, q_x), torch.tensor([1.0, 0.25, 0.0, 1.0, 1.0]),
                          f"accept_probability(p_x={_v(p_x)}, q_x={_v(q_x)})",
                          note="min(1, p(x) / q(x)): 1 when p >= q, 0 when p = 0")


def test_accept_probability_broadcasts():
    """Contract: p_x and q_x of the same or broadcastable shapes give that shape, elementwise."""
    p_x, q_x = torch.rand(3, 4, generator=_gen(0)), torch.rand(3, 4, generator=_gen(1)) + 0.01
    adapters.expect_close(accept_probability(p_x, q_x), torch.minimum(torch.ones(()), p_x / q_x),
                          "accept_probability(p_x [3, 4], q_x [3, 4])")
    for q_shape in [(4,), (3, 1)]:
        q_b = torch.rand(q_shape, generator=_gen(2)) + 0.01
        adapters.expect_close(accept_probability(p_x, q_b), torch.minimum(torch.ones(()), p_x / q_b),
                              f"accept_probability(p_x [3, 4], q_x {list(q_shape)}) (broadcast)")


# ---------------------------------------------------------------- residual_distribution


def test_residual_hand_example():
    """Contract: r = max(0, p - q) divided by its sum; tokens where q >= p get 0."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.3, 0.3])
    adapters.expect_close(residual_distribution(p, q), torch.tensor([0.75, 0.25, 0.0, 0.0]),
                          f"residual_distribution(p={_v(p)}, q={_v(q)})",
                          note="max(0, p - q) = [0.3, 0.1, 0, 0], normalized to sum 1 = [0.75, 0.25, 0, 0]")


def test_residual_rows_on_their_own():
    """Contract: each row of [..., V] is normalized on its own; a row with p == q is p."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.2, 0.2, 0.3, 0.3], [0.1, 0.2, 0.2, 0.5], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    want = torch.tensor([[0.75, 0.25, 0.0, 0.0], [0.0, 0.8, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]],
                        dtype=torch.float64)
    adapters.expect_close(residual_distribution(p, q), want, "residual_distribution(p [3, 4], q [3, 4])",
                          note="row 0: norm([0.3, 0.1, 0, 0]); row 1: norm([0, 0.4, 0.1, 0]); row 2: p == q, so p")


def test_residual_batched():
    """Contract: shapes [..., V] -> [..., V], norm(max(0, p - q)) over the last dim of each row."""
    p, q = _dist(2, 3, 7, seed=2), _dist(2, 3, 7, seed=3)
    got = residual_distribution(p, q)
    adapters.expect(adapters.shape_of(got), tuple(p.shape), "residual_distribution(p [2, 3, 7], q [2, 3, 7]): shape")
    for idx in [(0, 0), (0, 2), (1, 1)]:
        adapters.expect_close(got[idx], _residual_ref(p[idx], q[idx]),
                              f"residual_distribution(p [2, 3, 7], q [2, 3, 7]), row {idx}",
                              note="norm(max(0, p - q)) over the last dim, each row on its own")


def test_residual_when_p_equals_q():
    """Contract: if max(0, p - q) sums to 0 (p == q), the row is p, not nan."""
    p = _dist(2, 5, seed=4)
    got = residual_distribution(p, p.clone())
    what = "residual_distribution(p, q=p) [2, 5]"
    adapters.expect_that(isinstance(got, torch.Tensor) and not bool(got.isnan().any()), what,
                         "no nan (the residual has no mass: return p, not 0 / 0)", got)
    adapters.expect_close(got, p, what, note="with p == q the residual must fall back to p")


# ---------------------------------------------------------------- acceptance_rate


def test_acceptance_rate_hand_examples():
    """Contract: alpha = E_{x~q}[min(1, p(x)/q(x))], one value per row: 1 when q is p, 0 with no shared token."""
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.3, 0.3], dtype=torch.float64)
    what = f"acceptance_rate(p={_v(p)}, q={_v(q)})"
    got = acceptance_rate(p, q)
    adapters.expect(adapters.shape_of(got), (), f"{what}: shape ([V] -> [], one value)")
    adapters.expect_approx(float(got), 0.6, what, rel=1e-9)
    disjoint = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    adapters.expect_approx(float(acceptance_rate(p, disjoint)), 0.0, f"acceptance_rate(p={_v(p)}, q={_v(disjoint)}) "
                           "(no token in common)", abs=1e-12)
    adapters.expect_approx(float(acceptance_rate(p, p.clone())), 1.0, f"acceptance_rate(p={_v(p)}, q=p)", rel=1e-9)


def test_acceptance_rate():
    """Contract: alpha = E_{x~q}[min(1, p(x)/q(x))] computed exactly, [..., V] -> [...]."""
    P, Q = _dist(4, 6, seed=5), _dist(4, 6, seed=6)
    got = acceptance_rate(P, Q)
    adapters.expect(adapters.shape_of(got), (4,), "acceptance_rate(p [4, 6], q [4, 6]): shape (one alpha per row)")
    expected = (Q * torch.where(Q > 0, P / Q, 0.0).clamp(max=1)).sum(-1)  # E_{x~q}[min(1, p/q)]
    adapters.expect_close(got, expected, "acceptance_rate(p [4, 6], q [4, 6])",
                          note="alpha = E_{x~q}[min(1, p(x)/q(x))]")
    adapters.expect_close(acceptance_rate(P, P), torch.ones(4, dtype=torch.float64), "acceptance_rate(p [4, 6], q=p)",
                          note="a drafter equal to the target is always accepted")


# ---------------------------------------------------------------- rejection_sample_one


def _setup(k: int, V: int, seed: int):
    q, p = _dist(k, V, seed=seed), _dist(k + 1, V, seed=seed + 1)
    draft = torch.multinomial(q.float(), 1, generator=_gen(seed + 2))[:, 0].tolist()
    a = [min(1.0, float(p[i, x] / q[i, x])) for i, x in enumerate(draft)]
    return draft, q, p, a


def _check_result(result, k: int, V: int, what: str):
    """(accepted drafts as a list, last_probs), once the result has the contract's shape."""
    adapters.expect_that(isinstance(result, tuple) and len(result) == 2, what,
                         "a tuple (accepted tokens, last_probs)", result)
    accepted, last = result
    adapters.expect_that(isinstance(last, torch.Tensor) and tuple(last.shape) == (V,), f"{what}: last_probs",
                         f"one distribution, a tensor [V={V}]", adapters.shape_of(last))
    accepted = [int(x) for x in accepted]
    adapters.expect_that(len(accepted) <= k, f"{what}: accepted", f"at most k={k} drafts", accepted)
    return accepted, last


def _sample_one(draft, q, p, uniforms):
    """rejection_sample_one with a description of its input for the failure line."""
    what = f"rejection_sample_one(drafts {draft}, uniforms {[round(float(u), 6) for u in uniforms]})"
    return _check_result(rejection_sample_one(draft, q, p, uniforms), len(draft), p.shape[-1], what), what


def test_rejection_sample_one_hand_example():
    """Contract: accept draft i iff uniforms[i] < min(1, p_i(x)/q_i(x)); all k accepted: last_probs = p[k]."""
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p = torch.tensor([[0.25, 0.75, 0.0], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]])
    # draft 0 = token 1: p/q = 1.5 -> always accepted; draft 1 = token 2: p/q = 0.4.
    (accepted, last), what = _sample_one([1, 2], q, p, torch.tensor([0.99, 0.3]))
    adapters.expect(accepted, [1, 2], f"{what}: accepted (u = 0.3 < 0.4 accepts the second draft too)")
    adapters.expect_close(last, p[2], f"{what}: last_probs", note="all drafts accepted: the bonus row p[k]")
    (accepted, last), what = _sample_one([1, 2], q, p, torch.tensor([0.99, 0.5]))
    adapters.expect(accepted, [1], f"{what}: accepted (u = 0.5 >= 0.4 rejects the second draft)")
    adapters.expect_close(last, torch.tensor([2 / 3, 1 / 3, 0.0]), f"{what}: last_probs",
                          note="rejected at position 1: norm(max(0, p[1] - q[1])) = norm([0.2, 0.1, 0])")


def test_rejection_sample_one_stops_at_the_first_rejection():
    """Contract: at the first rejection, stop: later drafts are not judged, last_probs = norm(max(0, p_i - q_i))."""
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p = torch.tensor([[0.25, 0.75, 0.0], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]])
    # draft 0 = token 0: p/q = 0.5, u = 0.7 rejects it; draft 1 = token 1 (p/q > 1) would pass any u.
    (accepted, last), what = _sample_one([0, 1], q, p, torch.tensor([0.7, 0.0]))
    adapters.expect(accepted, [], f"{what}: accepted (draft 0 is rejected: the walk stops there)")
    adapters.expect_close(last, torch.tensor([0.0, 1.0, 0.0]), f"{what}: last_probs",
                          note="rejected at position 0: norm(max(0, p[0] - q[0])) = norm([0, 0.25, 0])")


def test_rejection_sample_one_with_no_drafts():
    """Contract: if all k are accepted, last_probs = p[k]; with k = 0 that is p[0] and nothing is accepted."""
    p = torch.tensor([[0.1, 0.6, 0.3]], dtype=torch.float64)
    (accepted, last), what = _sample_one([], torch.zeros(0, 3, dtype=torch.float64), p,
                                         torch.zeros(0, dtype=torch.float64))
    adapters.expect(accepted, [], f"{what}: accepted (k = 0)")
    adapters.expect_close(last, p[0], f"{what}: last_probs", note="no draft: the bonus row p[k] = p[0]")


def test_rejection_sample_one_greedy():
    """Contract: with one-hot p and q a draft is accepted iff it is the target's argmax; then the argmax is emitted."""
    V, k = 5, 3
    target = [2, 4, 1, 0]  # the target's argmax at each of the k + 1 slots
    p = torch.nn.functional.one_hot(torch.tensor(target), V).double()
    draft = [2, 4, 3]  # the third draft is wrong
    q = torch.nn.functional.one_hot(torch.tensor(draft), V).double()
    for u in (0.0, 0.5, 0.999):
        (accepted, last), what = _sample_one(draft, q, p, torch.full((k,), u))
        adapters.expect(accepted, [2, 4], f"{what}, one-hot p (argmax {target}): accepted")
        adapters.expect_close(last, p[2], f"{what}, one-hot p (argmax {target}): last_probs",
                              note="then emit the target's argmax (one-hot residual)")


@pytest.mark.exercises(points=2)
def test_rejection_sample_one_accepts_with_probability_min_1_p_over_q():
    """Contract: draft i is accepted iff uniforms[i] < min(1, p_i(x)/q_i(x)); a rejection stops the walk."""
    k, V = 4, 6
    for seed in range(5):
        draft, q, p, a = _setup(k, V, 10 * seed)
        for i in range(k):
            # Accept the first i drafts for sure (u = 0 < a whenever a > 0), then probe position i.
            if any(x == 0 for x in a[:i]):
                break
            for u, accept in [(a[i] - 1e-6, True), (a[i] + 1e-6, False)]:
                if not 0 <= u < 1:
                    continue
                uniforms = torch.tensor([0.0] * i + [u] + [0.5] * (k - i - 1), dtype=torch.float64)
                (accepted, last), what = _sample_one(draft, q, p, uniforms)
                adapters.expect(accepted[:i], draft[:i],
                                f"{what}: the first {i} accepted (u = 0 < min(1, p/q) accepts a draft)")
                adapters.expect_that((len(accepted) > i) == accept, f"{what}: draft {i}",
                                     f"{'accepted' if accept else 'rejected'} (min(1, p/q) = {a[i]:.6f}, "
                                     f"u = {u:.6f})", f"{'accepted' if len(accepted) > i else 'rejected'}",
                                     note="accept iff u < min(1, p(x)/q(x))")
                if not accept:
                    adapters.expect(accepted, draft[:i], f"{what}: accepted (the walk stops at the first rejection)")
                    adapters.expect_close(last.double(), _residual_ref(p[i], q[i]), f"{what}: last_probs",
                                          atol=1e-6, rtol=1e-6, note=f"rejected at {i}: norm(max(0, p[{i}] - q[{i}]))")


@pytest.mark.exercises(points=2)
def test_rejection_sample_one_first_token_is_exact():
    """Contract: every emitted token has exactly the target's distribution (the first one: p_0)."""
    # P(first emitted token = t) = sum_x q(x) [a(x) 1{t = x} + (1 - a(x)) r_x(t)] must be p_0(t),
    # where r_x is what the learner resamples from after rejecting x (u = 1 - 1e-9 rejects unless a = 1).
    V = 5
    q, p = _dist(1, V, seed=40), _dist(2, V, seed=41)
    first = torch.zeros(V, dtype=torch.float64)
    for x in range(V):
        if q[0, x] == 0:
            continue
        a = min(1.0, float(p[0, x] / q[0, x]))
        first[x] += q[0, x] * a
        if a < 1:
            (accepted, last), what = _sample_one([x], q, p, torch.tensor([1 - 1e-9]))
            adapters.expect(accepted, [], f"{what}: accepted (u close to 1 rejects a draft with min(1, p/q) < 1)")
            first += q[0, x] * (1 - a) * last.double()
    adapters.expect_close(first, p[0], f"P(first emitted token) over drafts x ~ q_0 = {_v(q[0])}",
                          atol=1e-6, rtol=1e-6, note="accepted drafts plus resampled tokens must follow p_0 exactly")


def _total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


@pytest.mark.exercises(points=2)
def test_rejection_sample_one_output_follows_the_target():
    """Contract: every emitted token (the accepted drafts, then one from last_probs) has exactly the target's p_i."""
    # Drafts x_i ~ q_i and uniforms are drawn here, seeded. Given that the first j drafts were
    # accepted, the token emitted at position j must follow p_j: an accepted draft counts as
    # its one-hot, the extra token as last_probs itself (its exact distribution, no sampling).
    # The mean of N such vectors is within total variation 1/2 sqrt((V-1)/N) of p_j on average,
    # and one vector moves it by at most 1/N, so (McDiarmid) it exceeds that by t with
    # probability at most exp(-2 N t^2): the threshold below is passed by an exact rule with
    # probability 1 - 1e-6, while a nearly right rule misses p_j by 0.1 to 0.6.
    k, V, trials = 2, 4, 4000
    q, p = _dist(k, V, seed=60), _dist(k + 1, V, seed=61)
    g = _gen(62)
    drafts = torch.stack([torch.multinomial(q[i].float(), trials, replacement=True, generator=g) for i in range(k)], 1)
    uniforms = torch.rand(trials, k, generator=g, dtype=torch.float64)
    sums = torch.zeros(k + 1, V, dtype=torch.float64)
    reached = [0] * (k + 1)
    for t in range(trials):
        (accepted, last), _ = _sample_one(drafts[t].tolist(), q, p, uniforms[t])
        for j, x in enumerate(accepted):
            sums[j, x] += 1.0
            reached[j] += 1
        sums[len(accepted)] += last.double()
        reached[len(accepted)] += 1
    for j in range(k + 1):
        n = reached[j]
        if n < 200:  # too rare to judge (an exact rule reaches every position hundreds of times here)
            continue
        threshold = 0.5 * math.sqrt((V - 1) / n) + math.sqrt(math.log(1e6) / (2 * n))
        got = sums[j] / n
        tv = _total_variation(got, p[j])
        adapters.expect_that(tv <= threshold,
                             f"rejection_sample_one over {trials} seeded trials (k={k}, V={V}): the token emitted at "
                             f"position {j} (reached {n} times)",
                             f"p[{j}] = {_v(p[j])}, to a total variation of {threshold:.3f}",
                             f"{_v(got)} (total variation {tv:.3f})",
                             note="accept with min(1, p/q), resample from norm(max(0, p - q)), bonus from p[k]")


# ---------------------------------------------------------------- ngram_propose


def _ngram_ref(tokens: list[int], n: int, k: int) -> list[int]:
    """Written from the docstring: the most recent earlier occurrence of the last n tokens."""
    L = len(tokens)
    if k == 0 or L <= n:
        return []
    suffix = tokens[L - n:]
    for j in range(L - n - 1, -1, -1):  # j + n < L: at least one token after it, and not the suffix itself
        if tokens[j:j + n] == suffix:
            return tokens[j + n:j + n + k]
    return []


def _expect_ngram(tokens: list[int], n: int, k: int, want: list[int], why: str = "") -> None:
    __tracebackhide__ = True
    got = ngram_propose(list(tokens), n, k)
    adapters.expect_all(list(got) if isinstance(got, (list, tuple)) else got, want,
                        f"ngram_propose({tokens}, n={n}, k={k}){f' ({why})' if why else ''}")


def test_ngram_propose():
    """Contract: propose up to k tokens that followed the most recent earlier occurrence of the last n tokens."""
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    _expect_ngram([3, 3], 1, 2, [3], "the occurrence right before the suffix counts")
    _expect_ngram(tokens, 2, 4, [8, 9, 1, 6], "suffix [6, 7] occurred at 1; it was followed by 8, 9, 1, 6")
    _expect_ngram(tokens, 2, 2, [8, 9], "at most k tokens")
    _expect_ngram(tokens, 1, 3, [8, 9, 1], "suffix [7] occurred at 2")
    _expect_ngram([4, 1, 4, 2, 4, 3, 4], 1, 1, [3], "the most recent earlier occurrence wins")
    _expect_ngram([1, 2, 3, 1, 2], 2, 5, [3, 1, 2], "the proposal stops at the end of the sequence")
    _expect_ngram([1, 1, 1, 1], 3, 4, [1], "an occurrence may overlap the suffix, not be it")
    _expect_ngram([9, 1, 2, 9, 1, 5, 9, 1], 2, 3, [5, 9, 1], "the most recent of two occurrences")


def test_ngram_propose_no_match():
    """Contract: [] if the suffix did not occur earlier, if len(tokens) <= n, or if k == 0; no shorter suffixes."""
    _expect_ngram([1, 2, 3, 4], 1, 3, [], "no earlier occurrence: propose nothing")
    _expect_ngram([1, 2, 3, 2], 2, 3, [], "only n-grams of length n count (no fallback to n - 1)")
    _expect_ngram([7, 7], 2, 3, [], "len(tokens) <= n: there is no earlier position")
    _expect_ngram([], 1, 3, [])
    _expect_ngram([1, 2, 1], 1, 0, [], "k = 0 proposes nothing")


def test_ngram_propose_random_contexts():
    """Contract: tokens[j+n : j+n+k] for the most recent j < len - n with tokens[j:j+n] equal to the last n tokens."""
    rng = random.Random(5)
    for length in range(2, 25):  # short contexts first: the first failure is the smallest one
        for _ in range(4):
            tokens = [rng.randrange(3) for _ in range(length)]
            n, k = rng.randint(1, 3), rng.randint(0, 4)
            _expect_ngram(tokens, n, k, _ngram_ref(tokens, n, k))


# ---------------------------------------------------------------- expected_tokens_per_forward


def test_expected_tokens_per_forward():
    """Contract: mean accepted drafts (the walk stops at the first rejection) plus one: 1 at alpha = 0, k + 1 at 1."""
    for alpha, k in [(0.3, 0), (0.5, 1), (0.5, 4), (0.8, 3), (0.9, 7)]:
        expected = sum(alpha ** i for i in range(k + 1))
        adapters.expect_approx(expected_tokens_per_forward(alpha, k), expected,
                               f"expected_tokens_per_forward(alpha={alpha}, k={k}) (1 + alpha + ... + alpha^k)")
    adapters.expect_approx(expected_tokens_per_forward(1.0, 4), 5.0,
                           "expected_tokens_per_forward(alpha=1, k=4) (every draft accepted: k + 1 tokens)")
    adapters.expect_approx(expected_tokens_per_forward(1.0, 1), 2.0,
                           "expected_tokens_per_forward(alpha=1, k=1) (every draft accepted: k + 1 tokens)")
    adapters.expect_approx(expected_tokens_per_forward(0.0, 4), 1.0,
                           "expected_tokens_per_forward(alpha=0, k=4) (only the one target token)")


# ---------------------------------------------------------------- speculative_speedup


def _speedup_ref(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    tokens = sum(alpha ** i for i in range(k + 1))  # 1 + alpha + ... + alpha^k
    return tokens / (k * c_draft + c_verify)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_speculative_speedup_values(alpha, k):
    """Contract: expected tokens of a speculative step over its cost, k * c_draft + c_verify (plain decoding: 1)."""
    for c_draft, c_verify in [(0.0, 1.0), (0.1, 1.2), (0.3, 2.5), (0.05, 0.9)]:
        got = speculative_speedup(alpha, k, c_draft, c_verify)
        want = _speedup_ref(alpha, k, c_draft, c_verify)
        adapters.expect_approx(got, want, f"speculative_speedup(alpha={alpha}, k={k}, c_draft={c_draft}, "
                                          f"c_verify={c_verify}) (expected tokens per step / step cost)", rel=1e-9)


def test_speculative_speedup_break_even():
    """Contract: speculative_speedup(0, k, 0, 1) == 1: no draft accepted and a free verification is plain decoding."""
    adapters.expect_approx(speculative_speedup(0.0, 4, 0.0, 1.0), 1.0,
                           "speculative_speedup(alpha=0, k=4, c_draft=0, c_verify=1) (plain decoding)")
    got = speculative_speedup(0.0, 4, 0.1, 1.0)
    adapters.expect_that(got < 1.0, "speculative_speedup(alpha=0, k=4, c_draft=0.1, c_verify=1)",
                         "below 1 (drafts that are never accepted only cost)", got)
    adapters.expect_approx(speculative_speedup(1.0, 4, 0.0, 1.0), 5.0,
                           "speculative_speedup(alpha=1, k=4, c_draft=0, c_verify=1) (k + 1 tokens a step)")


@pytest.mark.parametrize("bad", [(-0.1, 4, 0.0, 1.0), (1.2, 4, 0.0, 1.0), (0.5, 0, 0.0, 1.0),
                                 (0.5, 4, -0.1, 1.0), (0.5, 4, 0.1, 0.0)])
def test_speculative_speedup_rejects_bad_input(bad):
    """Contract: raise ValueError unless 0 <= alpha <= 1, k >= 1, c_draft >= 0 and c_verify > 0."""
    alpha, k, c_draft, c_verify = bad
    adapters.expect_raises(ValueError, f"speculative_speedup(alpha={alpha}, k={k}, c_draft={c_draft}, "
                                       f"c_verify={c_verify})", speculative_speedup, *bad)


# ---------------------------------------------------------------- rollback_blocks / next_num_speculative_tokens


@pytest.mark.parametrize("num_tokens,block_size,kept", [(33, 16, 3), (32, 16, 2), (1, 16, 1), (0, 16, 0), (17, 4, 5),
                                                         (8, 4, 2), (9, 4, 3), (6, 1, 6)])
def test_rollback_blocks_keeps_what_the_kept_tokens_need(num_tokens, block_size, kept):
    """Contract: remove from the end, in place, every block past those the kept tokens need; return them in order."""
    before = [9, 4, 7, 1, 8, 3]
    table = list(before)
    what = f"rollback_blocks({before}, num_tokens={num_tokens}, block_size={block_size})"
    freed = rollback_blocks(table, num_tokens, block_size)
    adapters.expect_all(table, before[:kept], f"{what}: the table after the call ({num_tokens} tokens need {kept} "
                                              "blocks; trimmed in place)")
    adapters.expect_all(list(freed) if isinstance(freed, (list, tuple)) else freed, before[kept:],
                        f"{what}: the blocks returned (the removed ones, in table order)")


def test_rollback_blocks_with_nothing_to_free():
    """Contract: a block that still holds a kept token stays; nothing past them: nothing is removed."""
    table = [5, 6]
    freed = rollback_blocks(table, 20, 16)
    adapters.expect_all(list(freed) if isinstance(freed, (list, tuple)) else freed, [],
                        "rollback_blocks([5, 6], num_tokens=20, block_size=16): the blocks returned")
    adapters.expect_all(table, [5, 6],
                        "rollback_blocks([5, 6], num_tokens=20, block_size=16): the table after the call")


@pytest.mark.parametrize("k,acc,want", [(3, None, 3), (3, 0.9, 4), (3, 0.8, 3), (3, 0.5, 3), (3, 0.49, 2),
                                        (4, 1.0, 4), (1, 0.0, 1), (2, 0.7, 2)])
def test_next_num_speculative_tokens(k, acc, want):
    """Contract: None -> k; above up (0.8) -> k + 1; below down (0.5) -> k - 1; else k; clamped to [k_min, k_max]."""
    adapters.expect(next_num_speculative_tokens(k, acc, 4), want,
                    f"next_num_speculative_tokens(k={k}, acceptance={acc}, k_max=4) (up above 0.8, down below 0.5, "
                    "clamped to [1, 4])")


def test_next_num_speculative_tokens_custom_thresholds():
    """Contract: the thresholds up and down and the bounds k_min and k_max are the ones given."""
    adapters.expect(next_num_speculative_tokens(2, 0.6, 8, k_min=2, up=0.5, down=0.2), 3,
                    "next_num_speculative_tokens(k=2, acceptance=0.6, k_max=8, k_min=2, up=0.5, down=0.2)")
    adapters.expect(next_num_speculative_tokens(2, 0.1, 8, k_min=2, up=0.5, down=0.2), 2,
                    "next_num_speculative_tokens(k=2, acceptance=0.1, k_max=8, k_min=2, up=0.5, down=0.2)")


# ---------------------------------------------------------------- pick_strategy

STRATEGIES = ("continuous", "speculative", "both")


def _pick_strategy_ref(num_requests: int, alpha: float, k: int, step_time) -> str:
    """Written from the docstring: throughput = expected tokens a step emits / its seconds."""
    n = num_requests
    emitted = sum(alpha ** i for i in range(k + 1))  # per request per verification step
    throughput = {"continuous": n / step_time(n, 1),               # n rows, one token each
                  "speculative": emitted / step_time(1, k + 1),     # one row, k drafts
                  "both": n * emitted / step_time(n, k + 1)}        # n rows, k drafts each
    pick = "continuous"
    for name in STRATEGIES[1:]:
        if throughput[name] > 1.01 * throughput[pick]:
            pick = name
    return pick


# Step costs in seconds, as functions of (rows, tokens per row):
def _weight_bound(rows, n):  # a step reads the weights once: flat until 64 tokens, then compute-bound
    return 0.010 + 0.0002 * max(0, rows * n - 64)


def _compute_bound(rows, n):  # every token pays its matmuls from the start (a small CPU)
    return 0.020 + 0.005 * rows * n


def _fitted_like(rows, n):  # shaped like a fitted cost model: overhead, per token, per logits row, per row
    return 0.030 + 0.0046 * rows * n + 0.002 * rows


def _per_row_heavy(rows, n):  # long contexts: each row's attention costs more than its tokens
    return 0.010 + 0.010 * rows + 0.0001 * rows * n


def _batching_hurts(rows, n):  # a device that thrashes when requests share a step
    return 0.010 * rows * rows * (1 + 0.02 * (n - 1))


# (what the case is, num_requests, alpha, k, step_time, the answer by the contract)
PICK_CASES = [
    ("one request, weight-bound, good drafts", 1, 0.8, 4, _weight_bound, "speculative"),
    ("one request, weight-bound, no draft ever accepted (a tie)", 1, 0.0, 4, _weight_bound, "continuous"),
    ("one request, compute-bound, good drafts", 1, 0.8, 4, _compute_bound, "speculative"),
    ("one request, compute-bound, poor drafts", 1, 0.3, 4, _compute_bound, "continuous"),
    ("8 requests, weight-bound, good drafts", 8, 0.8, 4, _weight_bound, "both"),
    ("8 requests, weight-bound, poor drafts", 8, 0.1, 4, _weight_bound, "both"),
    ("8 requests, compute-bound, good drafts", 8, 0.8, 4, _compute_bound, "continuous"),
    ("64 requests, weight-bound: the verify step is compute-bound", 64, 0.8, 4, _weight_bound, "continuous"),
    ("16 requests, weight-bound, k = 2", 16, 0.9, 2, _weight_bound, "both"),
    ("one request, fitted-like cost", 1, 0.9, 4, _fitted_like, "speculative"),
    ("8 requests, fitted-like cost", 8, 0.9, 4, _fitted_like, "both"),
    ("32 requests, fitted-like cost, alpha 0.5", 32, 0.5, 4, _fitted_like, "continuous"),
    ("8 requests, long contexts (cost per row)", 8, 0.5, 4, _per_row_heavy, "both"),
    ("4 requests, batching hurts on this device", 4, 0.8, 4, _batching_hurts, "speculative"),
    ("8 requests, both 0.4% faster than continuous: not more than 1%", 8, 0.004, 1, _weight_bound, "continuous"),
    ("8 requests, both 2% faster than continuous", 8, 0.02, 1, _weight_bound, "both"),
]


@pytest.mark.parametrize("case", PICK_CASES, ids=[c[0] for c in PICK_CASES])
def test_pick_strategy(case):
    """Contract: the strategy of highest throughput; a later one replaces the pick only when more than 1% higher."""
    oracle = [_pick_strategy_ref(*c[1:5]) for c in PICK_CASES]
    assert oracle == [c[5] for c in PICK_CASES], "the test table disagrees with its own oracle"
    assert set(oracle) == set(STRATEGIES), "every strategy must win at least one graded case"
    what, n, alpha, k, step_time, want = case
    got = pick_strategy(n, alpha, k, step_time)
    adapters.expect(got, want, f"pick_strategy({n}, alpha={alpha}, k={k}, {step_time.__name__.lstrip('_')}) "
                               f"[{what}]")


def test_pick_strategy_one_request_prefers_speculative_to_both():
    """Contract: with one request "both" is "speculative"; the tie keeps "speculative"."""
    # With one request "both" and "speculative" are the same strategy: the tie keeps "speculative".
    for alpha in (0.5, 0.9, 1.0):
        adapters.expect(pick_strategy(1, alpha, 3, _weight_bound), "speculative",
                        f"pick_strategy(1, alpha={alpha}, k=3, weight_bound): one request, free verification")


@pytest.mark.parametrize("bad", [(0, 0.5, 4), (4, -0.1, 4), (4, 1.1, 4), (4, 0.5, 0)],
                         ids=["no request", "alpha < 0", "alpha > 1", "k = 0"])
def test_pick_strategy_rejects_bad_input(bad):
    """Contract: raise ValueError unless num_requests >= 1, 0 <= alpha <= 1 and k >= 1."""
    n, alpha, k = bad
    adapters.expect_raises(ValueError, f"pick_strategy({n}, alpha={alpha}, k={k}, weight_bound)",
                           pick_strategy, *bad, _weight_bound)


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Each question's answer, checked against its digest."""
    answers = quiz_answers()
    adapters.expect_that(isinstance(answers, dict), "quiz_answers()", "a dict of answers", type(answers).__name__)
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:  # the right answer is kept secret (a digest): the line says what was given
        pytest.fail(why, pytrace=False)
