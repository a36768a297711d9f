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


def test_split_budget_examples():
    got = split_budget(3, [30, 5], 16)
    assert got == [13, 0], (
        f"3 decodes take 3 of the 16 tokens; the 30-token prompt takes the 13 left, the next prompt waits: "
        f"expected [13, 0], got {got}")
    assert split_budget(3, [30, 5], 40) == [30, 5], "with room for everything, every prompt goes in whole"
    assert split_budget(0, [7, 7, 7], 10) == [7, 3, 0], "a prompt that does not fit takes what is left (a chunk)"
    assert split_budget(4, [], 4) == [], "only decodes: no prompt to chunk"
    assert split_budget(4, [9], 4) == [0], "the decodes used the whole budget: the prompt waits"


def test_split_budget_does_not_modify_its_input():
    left = [5, 8]
    split_budget(1, left, 6)
    assert left == [5, 8], "split_budget must not modify prefill_tokens_left"


def test_split_budget_random():
    rng = random.Random(0)
    for _ in range(300):
        budget = rng.randint(1, 64)
        d = rng.randint(0, budget)
        prompts = [rng.randint(1, 40) for _ in range(rng.randint(0, 5))]
        got = split_budget(d, list(prompts), budget)
        want, left = [], budget - d
        for n in prompts:
            want.append(min(n, left))
            left -= want[-1]
        assert got == want, f"{d} decodes, prompts {prompts}, budget {budget}: expected {want}, got {got}"
        assert d + sum(got) <= budget, "a step never exceeds its budget"


@pytest.mark.parametrize("d, budget", [(5, 4), (1, 0), (0, -3)])
def test_split_budget_bad_input(d, budget):
    with pytest.raises(ValueError):
        split_budget(d, [3], budget)


# ---------------------------------------------------------------- early_step


def test_early_step_examples():
    assert early_step(2, [10, 50, 3], 32, 4) == [10], (
        "the 10-token prompt fits, the 50-token one does not, and the 3-token one may not jump ahead of it")
    assert early_step(2, [50], 32, 4) == [1, 1], "no prompt can start: a decode step, one token per decode"
    assert early_step(3, [4, 4, 4], 64, 2) == [4, 4], "only 2 batch slots are free"
    assert early_step(3, [4, 4], 64, 0) == [1, 1, 1], "no free batch slot: a decode step"
    assert early_step(0, [], 8, 2) == [], "nothing to run"
    assert early_step(5, [8, 8], 16, 8) == [8, 8], "a prefill step ignores the decodes: they stall"


def test_early_step_random():
    rng = random.Random(1)
    for _ in range(300):
        budget, free, d = rng.randint(1, 64), rng.randint(0, 4), rng.randint(0, 4)
        waiting = [rng.randint(1, 40) for _ in range(rng.randint(0, 5))]
        got = early_step(d, list(waiting), budget, free)
        admitted, left = [], budget
        for n in waiting:
            if len(admitted) == free or n > left:
                break
            admitted.append(n)
            left -= n
        want = admitted or [1] * d
        assert got == want, f"{d} decodes, waiting {waiting}, budget {budget}, {free} free slots: " \
                            f"expected {want}, got {got}"


# ---------------------------------------------------------------- chunk_causal_mask


def test_chunk_causal_mask_small():
    got = chunk_causal_mask(2, 5)
    want = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bool and got.shape == (2, 5), (
        "the mask is a bool tensor [num_new_tokens, context_len]")
    assert torch.equal(got, want), (
        f"2 new tokens after 3 cached ones sit at positions 3 and 4: query 0 sees keys 0..3, query 1 keys 0..4;\n"
        f"expected {want.int().tolist()}, got {got.int().tolist()}")
    assert torch.equal(chunk_causal_mask(4, 4), torch.ones(4, 4, dtype=torch.bool).tril()), (
        "a whole prompt (num_new_tokens == context_len) gets the plain causal mask")
    assert torch.equal(chunk_causal_mask(1, 7), torch.ones(1, 7, dtype=torch.bool)), "a decode sees every key"


@pytest.mark.parametrize("n, ctx", [(0, 4), (5, 4)])
def test_chunk_causal_mask_bad_input(n, ctx):
    with pytest.raises(ValueError):
        chunk_causal_mask(n, ctx)


def test_chunked_attention_with_the_mask_equals_whole_prompt_attention():
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
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-12, rtol=0,
                               msg=lambda s: "chunked prefill must reproduce whole-prompt attention exactly\n" + s)


# ---------------------------------------------------------------- chunked_prefill_latency


def test_chunked_prefill_latency_example():
    # 100-token prompt, 4 decodes, budget 36: chunks of 32, 32, 32, 4.
    ttft, itl = chunked_prefill_latency(100, 4, 36, overhead_s=0.01, per_token_s=0.001)
    steps = [0.01 + 0.001 * 36] * 3 + [0.01 + 0.001 * 8]
    assert math.isclose(ttft, sum(steps), rel_tol=1e-9), (
        f"chunks of 32, 32, 32 and 4 next to 4 decodes: TTFT is the sum of 4 steps = {sum(steps):.4f}, got {ttft}")
    assert math.isclose(itl, 0.046, rel_tol=1e-9), f"the longest step feeds 36 tokens: 0.046 s, got {itl}"


def test_chunked_prefill_latency_trade_off():
    args = dict(prompt_len=2000, num_decodes=8, overhead_s=0.02, per_token_s=0.0005)
    points = [chunked_prefill_latency(budget=b, **args) for b in (16, 64, 256, 1024, 4096)]
    ttfts, itls = zip(*points)
    assert list(ttfts) == sorted(ttfts, reverse=True), (
        f"a bigger budget means fewer steps, fewer overheads: TTFT must fall as the budget grows, got {ttfts}")
    assert list(itls) == sorted(itls), f"a bigger budget means longer steps: the max ITL must grow, got {itls}"
    ttft, itl = points[-1]  # budget above prompt + decodes: one step
    assert math.isclose(ttft, itl) and math.isclose(itl, 0.02 + 0.0005 * 2008)


def test_chunked_prefill_latency_bad_budget():
    with pytest.raises(ValueError):
        chunked_prefill_latency(100, 8, 8, 0.01, 0.001)


# ---------------------------------------------------------------- decode_stall_steps


def test_decode_stall_steps_example():
    ends = [1.0, 2.0, 3.0, 4.0, 5.0]
    a = [1.0, 2.0, 4.0, 5.0]  # step 3 (ends at 3.0) gives a nothing: a stall
    b = [3.0, 4.0]  # prefilled in step 3; no stall before its first token
    assert decode_stall_steps(ends, [a, b]) == 1, "one step (ending at 3.0) left a decoding request without a token"
    assert decode_stall_steps(ends, [a, b, [2.0, 4.0]]) == 1, "a step stalling two requests counts once"
    assert decode_stall_steps(ends, [[1.0, 2.0, 3.0, 4.0, 5.0], [2.0, 3.0]]) == 0
    assert decode_stall_steps(ends, [[], [5.0]]) == 0, "a request without tokens, or with only one, never stalls"
    assert decode_stall_steps(ends, [[1.0, 5.0]]) == 3, "steps 2, 3 and 4 all stall the request"


def test_decode_stall_steps_random():
    rng = random.Random(2)
    for _ in range(200):
        ends = [float(i) for i in range(1, 15)]
        times = []
        for _ in range(rng.randint(0, 4)):
            first, last = sorted(rng.sample(range(1, 15), 2))
            times.append([float(t) for t in range(first, last + 1) if t in (first, last) or rng.random() < 0.8])
        want = 0
        for k, e in enumerate(ends):
            if any(t and t[0] < e <= t[-1] and e not in t for t in times):
                want += 1
        assert decode_stall_steps(ends, times) == want


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
