"""Grades exercises/ch05_speculative_sampling.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here in float64, never taken from minillm, so the tests stay
meaningful for the solutions that wrap minillm. Small tensors only: seconds to run.
"""
from __future__ import annotations

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


# ---------------------------------------------------------------- accept_probability


def test_accept_probability_values():
    p_x = torch.tensor([0.5, 0.1, 0.0, 0.3, 0.2])
    q_x = torch.tensor([0.25, 0.4, 0.3, 0.3, 0.1])
    got = accept_probability(p_x, q_x)
    assert isinstance(got, torch.Tensor) and got.shape == p_x.shape, "one probability per drafted token"
    torch.testing.assert_close(
        got, torch.tensor([1.0, 0.25, 0.0, 1.0, 1.0]),
        msg=lambda m: "accept probability must be min(1, p(x) / q(x)): 1 when p >= q, 0 when p = 0\n" + m,
    )


def test_accept_probability_broadcasts():
    p_x, q_x = torch.rand(3, 4, generator=_gen(0)), torch.rand(3, 4, generator=_gen(1)) + 0.01
    got = accept_probability(p_x, q_x)
    torch.testing.assert_close(got, torch.minimum(torch.ones(()), p_x / q_x))


# ---------------------------------------------------------------- residual_distribution


def test_residual_hand_example():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.2, 0.3, 0.3])
    torch.testing.assert_close(
        residual_distribution(p, q), torch.tensor([0.75, 0.25, 0.0, 0.0]),
        msg=lambda m: "max(0, p - q) = [0.3, 0.1, 0, 0], normalized to sum 1 = [0.75, 0.25, 0, 0]\n" + m,
    )


def test_residual_batched():
    p, q = _dist(2, 3, 7, seed=2), _dist(2, 3, 7, seed=3)
    got = residual_distribution(p, q)
    assert got.shape == p.shape, (
        f"residual_distribution works on [..., V]: shape {tuple(p.shape)}, got {tuple(got.shape)}"
    )
    for idx in [(0, 0), (0, 2), (1, 1)]:
        torch.testing.assert_close(
            got[idx], _residual_ref(p[idx], q[idx]),
            msg=lambda m: f"row {idx}: norm(max(0, p - q)) over the last dim, each row on its own\n" + m,
        )


def test_residual_when_p_equals_q():
    p = _dist(2, 5, seed=4)
    got = residual_distribution(p, p.clone())
    assert not got.isnan().any(), "with p == q the residual has no mass: return p, not nan (0 / 0)"
    torch.testing.assert_close(got, p, msg=lambda m: "with p == q the residual must fall back to p\n" + m)


# ---------------------------------------------------------------- acceptance_rate


def test_acceptance_rate():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.3, 0.3], dtype=torch.float64)
    got = acceptance_rate(p, q)
    assert float(got) == pytest.approx(0.6), "alpha = sum_x min(p(x), q(x)) = 0.2 + 0.2 + 0.2 + 0 = 0.6"
    P, Q = _dist(4, 6, seed=5), _dist(4, 6, seed=6)
    got = acceptance_rate(P, Q)
    assert got.shape == (4,), f"one alpha per row: [..., V] -> [...], got {tuple(got.shape)}"
    expected = (Q * torch.where(Q > 0, P / Q, 0.0).clamp(max=1)).sum(-1)  # E_{x~q}[min(1, p/q)]
    torch.testing.assert_close(got, expected, msg=lambda m: "alpha = E_{x~q}[min(1, p(x)/q(x))]\n" + m)
    torch.testing.assert_close(acceptance_rate(P, P), torch.ones(4, dtype=torch.float64),
                               msg=lambda m: "a drafter equal to the target is always accepted\n" + m)


# ---------------------------------------------------------------- rejection_sample_one


def _setup(k: int, V: int, seed: int):
    q, p = _dist(k, V, seed=seed), _dist(k + 1, V, seed=seed + 1)
    draft = torch.multinomial(q.float(), 1, generator=_gen(seed + 2))[:, 0].tolist()
    a = [min(1.0, float(p[i, x] / q[i, x])) for i, x in enumerate(draft)]
    return draft, q, p, a


def _check_result(result, k: int, V: int):
    assert isinstance(result, tuple) and len(result) == 2, "return (accepted tokens, last_probs)"
    accepted, last = result
    assert isinstance(last, torch.Tensor) and last.shape == (V,), f"last_probs is one distribution [V={V}]"
    return list(accepted), last


def test_rejection_sample_one_hand_example():
    q = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    p = torch.tensor([[0.25, 0.75, 0.0], [0.4, 0.4, 0.2], [0.1, 0.1, 0.8]])
    # draft 0 = token 1: p/q = 1.5 -> always accepted; draft 1 = token 2: p/q = 0.4.
    accepted, last = _check_result(rejection_sample_one([1, 2], q, p, torch.tensor([0.99, 0.3])), 2, 3)
    assert accepted == [1, 2], "u = 0.3 < 0.4 accepts the second draft too"
    torch.testing.assert_close(last, p[2], msg=lambda m: "all drafts accepted: last_probs is the bonus row p[k]\n" + m)
    accepted, last = _check_result(rejection_sample_one([1, 2], q, p, torch.tensor([0.99, 0.5])), 2, 3)
    assert accepted == [1], "u = 0.5 >= 0.4 rejects the second draft"
    torch.testing.assert_close(
        last, torch.tensor([2 / 3, 1 / 3, 0.0]),
        msg=lambda m: "rejected at position 1: last_probs = norm(max(0, p[1] - q[1])) = norm([0.2, 0.1, 0])\n" + m,
    )


@pytest.mark.exercises(points=2)
def test_rejection_sample_one_accepts_with_probability_min_1_p_over_q():
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
                accepted, last = _check_result(rejection_sample_one(draft, q, p, uniforms), k, V)
                assert accepted[:i] == draft[:i], "a draft with u < min(1, p/q) must be accepted"
                assert (len(accepted) > i) == accept, (
                    f"draft {i} has min(1, p/q) = {a[i]:.4f}: u = {u:.6f} must "
                    f"{'accept' if accept else 'reject'} it (accept iff u < min(1, p(x)/q(x)))"
                )
                if not accept:
                    assert accepted == draft[:i], "the walk stops at the first rejection"
                    torch.testing.assert_close(
                        last.double(), _residual_ref(p[i], q[i]), atol=1e-6, rtol=1e-6,
                        msg=lambda m: f"rejected at {i}: last_probs = norm(max(0, p[{i}] - q[{i}]))\n" + m,
                    )


@pytest.mark.exercises(points=2)
def test_rejection_sample_one_first_token_is_exact():
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
            accepted, last = _check_result(rejection_sample_one([x], q, p, torch.tensor([1 - 1e-9])), 1, V)
            assert accepted == [], "u close to 1 must reject a draft with min(1, p/q) < 1"
            first += q[0, x] * (1 - a) * last.double()
    torch.testing.assert_close(
        first, p[0], atol=1e-6, rtol=1e-6,
        msg=lambda m: "accepted drafts plus resampled tokens must follow the target p_0 exactly\n" + m,
    )


def test_rejection_sample_one_greedy():
    V, k = 5, 3
    target = [2, 4, 1, 0]  # the target's argmax at each of the k + 1 slots
    p = torch.nn.functional.one_hot(torch.tensor(target), V).double()
    draft = [2, 4, 3]  # the third draft is wrong
    q = torch.nn.functional.one_hot(torch.tensor(draft), V).double()
    for u in (0.0, 0.5, 0.999):
        accepted, last = _check_result(rejection_sample_one(draft, q, p, torch.full((k,), u)), k, V)
        assert accepted == [2, 4], "greedy (one-hot p and q): accept iff the draft is the target's argmax"
        torch.testing.assert_close(last, p[2], msg=lambda m: "then emit the target's argmax (one-hot residual)\n" + m)


# ---------------------------------------------------------------- ngram_propose


def test_ngram_propose():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7]
    assert ngram_propose(tokens, 2, 4) == [8, 9, 1, 6], "suffix [6, 7] occurred at 1; it was followed by 8, 9, 1, 6"
    assert ngram_propose(tokens, 2, 2) == [8, 9], "at most k tokens"
    assert ngram_propose(tokens, 1, 3) == [8, 9, 1], "suffix [7] occurred at 2"
    assert ngram_propose([4, 1, 4, 2, 4, 3, 4], 1, 1) == [3], "the most recent earlier occurrence wins"
    assert ngram_propose([1, 2, 3, 1, 2], 2, 5) == [3, 1, 2], "the proposal stops at the end of the sequence"
    assert ngram_propose([1, 1, 1, 1], 3, 4) == [1], "an occurrence may overlap the suffix, not be it"


def test_ngram_propose_no_match():
    assert ngram_propose([1, 2, 3, 4], 1, 3) == [], "no earlier occurrence: propose nothing"
    assert ngram_propose([1, 2, 3, 2], 2, 3) == [], "only n-grams of length n count (no fallback to n - 1)"
    assert ngram_propose([7, 7], 2, 3) == [], "len(tokens) <= n: there is no earlier position"
    assert ngram_propose([], 1, 3) == []
    assert ngram_propose([1, 2, 1], 1, 0) == [], "k = 0 proposes nothing"


# ---------------------------------------------------------------- expected_tokens_per_forward


def test_expected_tokens_per_forward():
    for alpha, k in [(0.5, 1), (0.5, 4), (0.8, 3), (0.9, 7), (0.3, 0)]:
        expected = sum(alpha ** i for i in range(k + 1))
        got = expected_tokens_per_forward(alpha, k)
        assert got == pytest.approx(expected), (
            f"alpha={alpha}, k={k}: 1 + alpha + ... + alpha^k = {expected:.6f}, got {got}"
        )
    assert expected_tokens_per_forward(1.0, 4) == pytest.approx(5.0), "alpha = 1: every draft accepted, k + 1 tokens"
    assert expected_tokens_per_forward(0.0, 4) == pytest.approx(1.0), "alpha = 0: only the one target token"


# ---------------------------------------------------------------- speculative_speedup


def _speedup_ref(alpha: float, k: int, c_draft: float, c_verify: float) -> float:
    tokens = sum(alpha ** i for i in range(k + 1))  # 1 + alpha + ... + alpha^k
    return tokens / (k * c_draft + c_verify)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95, 1.0])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_speculative_speedup_values(alpha, k):
    for c_draft, c_verify in [(0.0, 1.0), (0.1, 1.2), (0.3, 2.5), (0.05, 0.9)]:
        got = speculative_speedup(alpha, k, c_draft, c_verify)
        want = _speedup_ref(alpha, k, c_draft, c_verify)
        assert abs(got - want) <= 1e-9 * want, (
            f"alpha={alpha}, k={k}, c_draft={c_draft}, c_verify={c_verify}: expected tokens per step / step cost "
            f"= {want:.6f}, got {got}")


def test_speculative_speedup_break_even():
    assert speculative_speedup(0.0, 4, 0.0, 1.0) == pytest.approx(1.0), "no acceptance, free verify: plain decoding"
    assert speculative_speedup(0.0, 4, 0.1, 1.0) < 1.0, "drafts that are never accepted only cost"
    assert speculative_speedup(1.0, 4, 0.0, 1.0) == pytest.approx(5.0), "every draft accepted: k + 1 tokens a step"


@pytest.mark.parametrize("bad", [(-0.1, 4, 0.0, 1.0), (1.2, 4, 0.0, 1.0), (0.5, 0, 0.0, 1.0),
                                 (0.5, 4, -0.1, 1.0), (0.5, 4, 0.1, 0.0)])
def test_speculative_speedup_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        speculative_speedup(*bad)


# ---------------------------------------------------------------- rollback_blocks / next_num_speculative_tokens


@pytest.mark.parametrize("num_tokens,block_size,kept", [(33, 16, 3), (32, 16, 2), (1, 16, 1), (0, 16, 0), (17, 4, 5)])
def test_rollback_blocks_keeps_what_the_kept_tokens_need(num_tokens, block_size, kept):
    table = [9, 4, 7, 1, 8, 3]
    freed = rollback_blocks(table, num_tokens, block_size)
    assert table == [9, 4, 7, 1, 8, 3][:kept], f"{num_tokens} tokens of block size {block_size} need {kept} blocks"
    assert freed == [9, 4, 7, 1, 8, 3][kept:], "return the removed blocks, in table order"


def test_rollback_blocks_with_nothing_to_free():
    table = [5, 6]
    assert rollback_blocks(table, 20, 16) == [] and table == [5, 6]


@pytest.mark.parametrize("k,acc,want", [(3, None, 3), (3, 0.9, 4), (3, 0.8, 3), (3, 0.5, 3), (3, 0.49, 2),
                                        (4, 1.0, 4), (1, 0.0, 1), (2, 0.7, 2)])
def test_next_num_speculative_tokens(k, acc, want):
    assert next_num_speculative_tokens(k, acc, 4) == want, (
        f"k={k}, acceptance={acc}, k_max=4: up above 0.8, down below 0.5, clamped to [1, 4]")


def test_next_num_speculative_tokens_custom_thresholds():
    assert next_num_speculative_tokens(2, 0.6, 8, k_min=2, up=0.5, down=0.2) == 3
    assert next_num_speculative_tokens(2, 0.1, 8, k_min=2, up=0.5, down=0.2) == 2


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
    oracle = [_pick_strategy_ref(*c[1:5]) for c in PICK_CASES]
    assert oracle == [c[5] for c in PICK_CASES], "the test table disagrees with its own oracle"
    assert set(oracle) == set(STRATEGIES), "every strategy must win at least one graded case"
    what, n, alpha, k, step_time, want = case
    got = pick_strategy(n, alpha, k, step_time)
    adapters.expect(got, want, f"pick_strategy({n}, alpha={alpha}, k={k}, {step_time.__name__.lstrip('_')}) "
                               f"[{what}]")


def test_pick_strategy_one_request_prefers_speculative_to_both():
    # With one request "both" and "speculative" are the same strategy: the tie keeps "speculative".
    for alpha in (0.5, 0.9, 1.0):
        adapters.expect(pick_strategy(1, alpha, 3, _weight_bound), "speculative",
                        f"pick_strategy(1, alpha={alpha}, k=3, weight_bound): one request, free verification")


@pytest.mark.parametrize("bad", [(0, 0.5, 4), (4, -0.1, 4), (4, 1.1, 4), (4, 0.5, 0)],
                         ids=["no request", "alpha < 0", "alpha > 1", "k = 0"])
def test_pick_strategy_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        pick_strategy(*bad, _weight_bound)


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
