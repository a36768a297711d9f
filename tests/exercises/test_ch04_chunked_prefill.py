"""Grades exercises/ch04_chunked_prefill.py (or solutions/, with MINILLM_IMPL=solutions).

Oracles are written here (plain Python loops, dense float64 attention), never taken
from minillm, so the tests stay meaningful for the solutions. The whole file runs in
about a second.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

import adapters
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch04_chunked_prefill"
split_budget = adapters.function(CHAPTER, "split_budget")
early_step = adapters.function(CHAPTER, "early_step")
chunk_causal_mask = adapters.function(CHAPTER, "chunk_causal_mask")
chunked_prefill_latency = adapters.function(CHAPTER, "chunked_prefill_latency")
decode_stall_steps = adapters.function(CHAPTER, "decode_stall_steps")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


# ---------------------------------------------------------------- split_budget


def _split(d, prompts, budget):
    """split_budget's answer, or the exception it raised, named (so a wrong raise reads as "got ValueError: ...")."""
    try:
        return split_budget(d, list(prompts), budget)
    except Exception as e:  # not pytest.fail: a stub's "not implemented yet" passes through
        return f"{type(e).__name__}: {e}"


def test_split_budget_examples():
    """Contract: decodes first; then each prompt in order takes min(its tokens left, what is left of the budget)."""
    cases = [
        (3, [30, 5], 16, [13, 0]),  # 3 decodes take 3 of 16; the 30-token prompt takes the 13 left
        (3, [30, 5], 40, [30, 5]),  # room for everything: every prompt whole
        (0, [7, 7, 7], 10, [7, 3, 0]),  # the prompt that does not fit takes what is left (a chunk)
        (4, [], 4, []),  # only decodes
        (4, [9], 4, [0]),  # the decodes used the whole budget
    ]
    for d, prompts, budget, want in cases:
        adapters.expect(_split(d, prompts, budget), want,
                        f"split_budget({d} decodes, prefill_tokens_left {prompts}, budget {budget})")


def test_split_budget_does_not_modify_its_input():
    """Contract: one chunk size per entry of prefill_tokens_left, in the same order; the input list is not modified."""
    left = [5, 8]
    split_budget(1, left, 6)
    adapters.expect(left, [5, 8], "split_budget(1 decode, prefill_tokens_left [5, 8], budget 6): "
                                  "prefill_tokens_left after the call")


def test_split_budget_random():
    """Contract: chunks fit what the decodes leave, in arrival order; once the budget is spent the rest get 0."""
    rng = random.Random(0)
    cases = []
    for _ in range(300):
        budget = rng.randint(1, 64)
        d = rng.randint(0, budget)
        prompts = [rng.randint(1, 40) for _ in range(rng.randint(0, 5))]
        cases.append((d, prompts, budget))
    for d, prompts, budget in sorted(cases, key=lambda c: (c[2], len(c[1]), sum(c[1]))):  # smallest first
        got = _split(d, prompts, budget)
        want, left = [], budget - d
        for n in prompts:
            want.append(min(n, left))
            left -= want[-1]
        what = f"split_budget({d} decodes, prefill_tokens_left {prompts}, budget {budget})"
        if isinstance(got, list) and all(isinstance(n, int) for n in got):
            adapters.expect_that(d + sum(got) <= budget, what, want,
                                 f"{got} ({d} decodes + {sum(got)} prompt tokens: more than the budget)")
        adapters.expect(got, want, what)


@pytest.mark.parametrize("d, budget", [(5, 4), (1, 0), (0, -3)])
def test_split_budget_bad_input(d, budget):
    """Contract: budget < 1, or num_decodes > budget (the decodes alone would not fit) -> ValueError."""
    adapters.expect_raises(ValueError, f"split_budget({d} decodes, [3], budget {budget})", split_budget, d, [3], budget)


# ---------------------------------------------------------------- early_step


def _early_ref(d, waiting, budget, free):
    """The contract of early_step, and which kind of step it is."""
    admitted, left = [], budget
    for n in waiting:
        if len(admitted) == free or n > left:
            break
        admitted.append(n)
        left -= n
    if admitted:
        return admitted, "prefill"
    return [1] * d, "decode" if d else "empty"


def _expect_early(d, waiting, budget, free, want):
    __tracebackhide__ = True
    what = f"early_step({d} decodes, waiting {waiting}, budget {budget}, {free} free slots)"
    got = early_step(d, list(waiting), budget, free)
    # A broken cap or queue order is named only for an answer that admits prompts and breaks it
    # (not for one that could be a decode step).
    admits = isinstance(got, list) and got and got != want and got != [1] * d
    if admits and got == waiting[:len(got)]:
        adapters.expect_that(len(got) <= free, what, want, f"{got} ({len(got)} prompts: more than the "
                             f"{free} free slots)")
        adapters.expect_that(sum(got) <= budget, what, want, f"{got} ({sum(got)} tokens: more than the budget)")
    elif admits and _is_subsequence(got, waiting):
        adapters.expect_that(False, what, want, f"{got} (skips a prompt ahead of {got[-1]} in the queue "
                             f"{waiting}: out of queue order)")
    adapters.expect(got, want, what)


def _is_subsequence(xs, ys) -> bool:
    it = iter(ys)
    return all(any(x == y for y in it) for x in xs)


def test_early_step_examples():
    """Contract: admit whole prompts in order while a slot is free and each fits what is left; else a decode step."""
    cases = [
        (2, [10, 50, 3], 32, 4, [10]),  # 50 does not fit, and 3 may not jump ahead of it
        (2, [50], 32, 4, [1, 1]),  # no prompt can start: a decode step
        (3, [4, 4, 4], 64, 2, [4, 4]),  # only 2 batch slots are free
        (3, [4, 4], 64, 0, [1, 1, 1]),  # no free batch slot: a decode step
        (0, [], 8, 2, []),  # nothing to run
        (5, [8, 8], 16, 8, [8, 8]),  # a prefill step: the decodes stall
    ]
    # each kind of step is the right answer in some case
    assert {_early_ref(*c[:4])[1] for c in cases} == {"prefill", "decode", "empty"}
    for d, waiting, budget, free, want in cases:
        _expect_early(d, waiting, budget, free, want)


def test_early_step_random():
    """Contract: first come, first served: stop at the first prompt that does not fit; a prefill step stalls decodes."""
    rng = random.Random(1)
    cases = []
    for _ in range(300):
        budget, free, d = rng.randint(1, 64), rng.randint(0, 4), rng.randint(0, 4)
        waiting = [rng.randint(1, 40) for _ in range(rng.randint(0, 5))]
        cases.append((d, waiting, budget, free))
    kinds = [_early_ref(*c)[1] for c in cases]
    # prefill and decode steps are each the right answer many times, and so is a prefill
    # that stops at a prompt that does not fit while a slot is free (first come, first served)
    assert kinds.count("prefill") >= 50 and kinds.count("decode") >= 50, (
        f"prefill steps {kinds.count('prefill')}, decode steps {kinds.count('decode')}: the cases must have both")
    assert any(0 < len(_early_ref(*c)[0]) < min(c[3], len(c[1])) for c, k in zip(cases, kinds) if k == "prefill")
    for d, waiting, budget, free in sorted(cases, key=lambda c: (len(c[1]), c[2], c[0])):  # smallest first
        _expect_early(d, waiting, budget, free, _early_ref(d, waiting, budget, free)[0])


# ---------------------------------------------------------------- chunk_causal_mask


def test_chunk_causal_mask_small():
    """Contract: a bool [n, context_len] mask: query j, at position context_len - n + j, sees every key at or before it."""
    # 2 new tokens after 3 cached ones sit at positions 3 and 4: query 0 sees keys 0..3, query 1 keys 0..4;
    # a whole prompt (num_new_tokens == context_len) gets the plain causal mask; a decode sees every key
    cases = [(2, 5, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]),
             (4, 4, torch.ones(4, 4, dtype=torch.int).tril().tolist()),
             (1, 7, [[1] * 7])]
    for n, ctx, want in cases:
        what = f"chunk_causal_mask(num_new_tokens={n}, context_len={ctx})"
        got = chunk_causal_mask(n, ctx)
        adapters.expect(adapters.shape_of(got), (n, ctx), f"{what}: shape")
        adapters.expect(got.dtype, torch.bool, f"{what}: dtype")
        adapters.expect(got.int().tolist(), want, f"{what} (1 = may attend)")


@pytest.mark.parametrize("n, ctx", [(0, 4), (5, 4)])
def test_chunk_causal_mask_bad_input(n, ctx):
    """Contract: num_new_tokens must be in [1, context_len], else ValueError."""
    adapters.expect_raises(ValueError, f"chunk_causal_mask(num_new_tokens={n}, context_len={ctx})",
                           chunk_causal_mask, n, ctx)


def test_chunked_attention_with_the_mask_equals_whole_prompt_attention():
    """Contract: each query sees exactly the keys it would have seen had the prompt been fed whole."""
    # Attention of a 23-token prompt fed whole, against the same prompt fed in chunks of
    # 7, 7, 5 and 4 tokens, each attending the keys written so far through the mask.
    g = torch.Generator().manual_seed(0)
    L, H, D = 23, 2, 8
    q, k, v = (torch.randn(H, L, D, generator=g, dtype=torch.float64) for _ in range(3))

    def attend(qs, ks, vs, mask):
        s = qs @ ks.transpose(-1, -2) / math.sqrt(D)
        return s.masked_fill(~mask, -math.inf).softmax(-1) @ vs

    whole = attend(q, k, v, torch.ones(L, L, dtype=torch.bool).tril())
    pieces, done = [], 0
    for n in (7, 7, 5, 4):
        ctx = done + n
        mask = chunk_causal_mask(n, ctx)
        pieces.append(attend(q[:, done:ctx], k[:, :ctx], v[:, :ctx], mask))
        done = ctx
    adapters.expect_close(torch.cat(pieces, dim=1), whole,
                          "attention of a 23-token prompt fed in chunks of 7, 7, 5, 4 through chunk_causal_mask "
                          "vs the prompt fed whole with a causal mask", atol=1e-12, rtol=0)


# ---------------------------------------------------------------- chunked_prefill_latency


def test_chunked_prefill_latency_example():
    """Contract: each step costs overhead + per token fed (decodes, then a chunk); the last chunk can be shorter."""
    # 100-token prompt, 4 decodes, budget 36: chunks of 32, 32, 32, 4.
    ttft, itl = chunked_prefill_latency(100, 4, 36, overhead_s=0.01, per_token_s=0.001)
    steps = [0.01 + 0.001 * 36] * 3 + [0.01 + 0.001 * 8]
    what = "chunked_prefill_latency(prompt 100, 4 decodes, budget 36, overhead 0.01 s, 0.001 s per token)"
    # chunks of 32, 32, 32 and 4 next to 4 decodes: TTFT is the sum of 4 steps, the longest feeds 36 tokens
    adapters.expect_approx(ttft, sum(steps), f"{what}: TTFT", rel=1e-9, unit=" s")
    adapters.expect_approx(itl, 0.046, f"{what}: max ITL", rel=1e-9, unit=" s")


def test_chunked_prefill_latency_trade_off():
    """Contract: TTFT ends with the step feeding the prompt's last token; max ITL is the longest step while it is fed."""
    args = dict(prompt_len=2000, num_decodes=8, overhead_s=0.02, per_token_s=0.0005)
    budgets = (16, 64, 256, 1024, 4096)
    points = [chunked_prefill_latency(budget=b, **args) for b in budgets]
    ttfts, itls = zip(*points)
    what = "chunked_prefill_latency(prompt 2000, 8 decodes, overhead 0.02 s, 0.0005 s per token)"
    adapters.expect_that(list(ttfts) == sorted(ttfts, reverse=True), f"{what}: TTFT at budgets {list(budgets)}",
                         "values that do not grow with the budget", [round(t, 6) for t in ttfts])
    adapters.expect_that(list(itls) == sorted(itls), f"{what}: max ITL at budgets {list(budgets)}",
                         "values that do not fall as the budget grows", [round(t, 6) for t in itls])
    ttft, itl = points[-1]  # budget above prompt + decodes: one step
    adapters.expect_approx(itl, 0.02 + 0.0005 * 2008, f"{what}: max ITL at budget 4096 (one step)", rel=1e-9,
                           unit=" s")
    adapters.expect_approx(ttft, itl, f"{what}: TTFT at budget 4096 (one step, the same as its ITL)", rel=1e-9,
                           unit=" s")


def test_chunked_prefill_latency_bad_budget():
    """Contract: budget <= num_decodes (no room for the prompt: it would never start) -> ValueError."""
    adapters.expect_raises(ValueError, "chunked_prefill_latency(prompt 100, 8 decodes, budget 8, ...) "
                           "(no token left for the prompt)", chunked_prefill_latency, 100, 8, 8, 0.01, 0.001)


# ---------------------------------------------------------------- decode_stall_steps


def test_decode_stall_steps_example():
    """Contract: step k stalls when a request with first token < step_ends[k] <= last token has none stamped then."""
    ends = [1.0, 2.0, 3.0, 4.0, 5.0]
    a = [1.0, 2.0, 4.0, 5.0]  # step 3 (ends at 3.0) gives a nothing: a stall
    b = [3.0, 4.0]  # prefilled in step 3; no stall before its first token
    cases = [
        ([a, b], 1),  # the step ending at 3.0 left a decoding request without a token
        ([a, b, [2.0, 4.0]], 1),  # a step stalling two requests counts once
        ([[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0]], 0),
        ([[], [5.0]], 0),  # a request without tokens, or with only one, never stalls
        ([[1.0, 5.0]], 3),  # steps 2, 3 and 4 all stall the request
        ([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 5.0]], 3),  # one request gets its tokens, the other stalls: still a stall
    ]
    for times, want in cases:
        adapters.expect(decode_stall_steps(ends, times), want,
                        f"decode_stall_steps(step ends {ends}, token times {times})")


def test_decode_stall_steps_random():
    """Contract: a stalled step counts once, however many requests it stalled; requests with no tokens never count."""
    rng = random.Random(2)
    cases = []
    for _ in range(200):
        ends = [float(i) for i in range(1, 15)]
        times = []
        for _ in range(rng.randint(0, 4)):
            first, last = sorted(rng.sample(range(1, 15), 2))
            times.append([float(t) for t in range(first, last + 1) if t in (first, last) or rng.random() < 0.8])
        cases.append((ends, times))
    for ends, times in sorted(cases, key=lambda c: sum(len(t) for t in c[1])):  # fewest tokens first
        want = 0
        for k, e in enumerate(ends):
            if any(t and t[0] < e <= t[-1] and e not in t for t in times):
                want += 1
        adapters.expect(decode_stall_steps(ends, times), want, f"decode_stall_steps(step ends 1.0 .. 14.0, "
                                                                f"token times {times})")


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() returns a dict {question id: answer}; each answer matches the question's."""
    answers = quiz_answers()
    adapters.expect_that(isinstance(answers, dict), "quiz_answers()", "a dict of answers", type(answers).__name__)
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:  # the right answer is kept secret (a digest): the line says what was given
        pytest.fail(why, pytrace=False)
