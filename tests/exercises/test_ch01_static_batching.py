"""Grades exercises/ch01_static_batching.py (or solutions/, with MINILLM_IMPL=solutions).

The oracles are written here, from the definitions in the exercise docstrings, never
taken from minillm, so the tests stay meaningful for the solutions that wrap minillm.
"""
from __future__ import annotations

import random

import random
from collections import deque

import pytest
import torch

import adapters
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.course import quiz

pytestmark = pytest.mark.exercises

CHAPTER = "ch01_static_batching"
left_pad = adapters.function(CHAPTER, "left_pad")
static_num_steps = adapters.function(CHAPTER, "static_num_steps")
static_token_slots = adapters.function(CHAPTER, "static_token_slots")
static_schedule = adapters.function(CHAPTER, "static_schedule")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _groups(xs, B):
    return [xs[i:i + B] for i in range(0, len(xs), B)]


def _steps_ref(outputs, B):
    return sum(max(g) for g in _groups(outputs, B))


def _slots_ref(prompts, outputs, B):
    useful = total = 0
    for ps, os in zip(_groups(prompts, B), _groups(outputs, B)):
        W, M = max(ps), max(os)
        useful += sum(ps)
        total += B * W
        for k in range(1, M):  # decode steps
            total += B
            useful += sum(1 for o in os if o > k)
    return useful, total


# ---------------------------------------------------------------- left_pad


def test_left_pad_layout():
    prompts = [[5, 6, 7], [8], [9, 10]]
    ids, mask = left_pad(prompts, 0)
    assert isinstance(ids, torch.Tensor) and isinstance(mask, torch.Tensor), "return two tensors"
    assert ids.shape == (3, 3) and mask.shape == (3, 3), f"want [B, W] = [3, 3], got {tuple(ids.shape)}"
    assert ids.dtype == torch.long and mask.dtype == torch.long, "input_ids and attention_mask are torch.long"
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 9, 10]], "pad on the LEFT: the last column holds each last token"
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 1, 1]], "the mask is 1 on real tokens, 0 on padding"
    assert prompts == [[5, 6, 7], [8], [9, 10]], "left_pad must not modify its input"


def test_left_pad_random():
    rng = random.Random(0)
    for _ in range(20):
        prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(1, 9))] for _ in range(rng.randint(1, 6))]
        ids, mask = left_pad(prompts, 2)
        W = max(map(len, prompts))
        assert ids.shape == (len(prompts), W)
        for row, p in enumerate(prompts):
            assert ids[row, W - len(p):].tolist() == p
            assert (ids[row, :W - len(p)] == 2).all()
            assert mask[row].sum().item() == len(p)


# ---------------------------------------------------------------- static_num_steps


def test_static_num_steps_barrel():
    assert static_num_steps([20, 20, 800, 20], 2) == 820, "groups (20, 20) then (800, 20): 20 + 800 steps"
    assert static_num_steps([20, 20, 800, 20], 4) == 800, "one group: it lasts as long as its longest member"
    assert static_num_steps([5, 3, 7], 1) == 15, "B = 1: one request at a time"
    assert static_num_steps([4, 4, 4], 8) == 4, "a last group smaller than B still runs"


def test_static_num_steps_random():
    rng = random.Random(1)
    for _ in range(30):
        outs = [rng.randint(1, 40) for _ in range(rng.randint(1, 20))]
        B = rng.randint(1, 9)
        assert static_num_steps(outs, B) == _steps_ref(outs, B), f"outputs {outs}, B = {B}"


# ---------------------------------------------------------------- static_token_slots


def test_static_token_slots_example():
    assert tuple(static_token_slots([3, 5], [1, 3], 2)) == (10, 14), (
        "prefill [2 x 5] = 10 slots, 8 useful; decode steps 1 and 2: 2 slots each, 1 useful each")


def test_static_token_slots_counts_empty_rows_of_a_small_last_group():
    # one request in a batch of 4 slots: prefill 4 x 6, then 2 decodes of 4 slots
    assert tuple(static_token_slots([6], [3], 4)) == (6 + 2, 4 * 6 + 4 * 2)


def test_static_token_slots_random():
    rng = random.Random(2)
    for _ in range(30):
        n = rng.randint(1, 12)
        prompts = [rng.randint(1, 30) for _ in range(n)]
        outs = [rng.randint(1, 30) for _ in range(n)]
        B = rng.randint(1, 6)
        assert tuple(static_token_slots(prompts, outs, B)) == _slots_ref(prompts, outs, B), (
            f"prompts {prompts}, outputs {outs}, B = {B}")


def test_skewed_batch_wastes_most_slots():
    useful, total = static_token_slots([16] * 8, [20] * 7 + [800], 8)
    assert useful / total < 0.2, "one 800-token request among 20-token ones keeps 7 of 8 slots idle"


# ---------------------------------------------------------------- static_schedule


def _sreq(rid: str, prompt: int, max_tokens: int = 4):
    return Request(rid, [5] * prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0)


def _drive(schedule, prompts, outputs, B, T):
    """Run a whole workload through a static policy with a fake forward; returns each step's rows."""
    waiting = deque(_sreq(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs)))
    group, steps = [], []
    while waiting or any(not r.is_finished for r in group):
        rows = schedule(group, waiting, B, T)
        assert rows, "a step with work left must schedule something"
        for r, n in rows:
            r.num_computed_tokens += n
            r.output_token_ids.append(7)
            if r.num_output_tokens == r.sampling_params.max_tokens:
                r.status = RequestStatus.FINISHED
        steps.append([(r.request_id, n) for r, n in rows])
        assert len(steps) < 1000
    return steps


def _static_ref(prompts, outputs, B, T):
    steps, i, n = [], 0, len(prompts)
    while i < n:
        members, budget = [], T
        while i < n and len(members) < B and prompts[i] <= budget:
            members.append(i); budget -= prompts[i]; i += 1
        steps.append([(str(j), prompts[j]) for j in members])
        gen = {j: 1 for j in members}
        while any(gen[j] < outputs[j] for j in members):
            live = [j for j in members if gen[j] < outputs[j]]
            steps.append([(str(j), 1) for j in live])
            for j in live:
                gen[j] += 1
    return steps


def test_static_schedule_forms_a_group_then_decodes_it_out():
    waiting = deque([_sreq("a", 3), _sreq("b", 5), _sreq("c", 2)])
    group = []
    rows = static_schedule(group, waiting, 2, 64)
    assert [(r.request_id, n) for r, n in rows] == [("a", 3), ("b", 5)], "the first B requests prefill together"
    assert [r.request_id for r in group] == ["a", "b"] and [r.request_id for r in waiting] == ["c"]
    assert all(r.status is RequestStatus.RUNNING for r in group)
    group[0].status = RequestStatus.FINISHED
    rows = static_schedule(group, waiting, 2, 64)
    assert [(r.request_id, n) for r, n in rows] == [("b", 1)], (
        "while a member is unfinished, only the unfinished decode and nobody is admitted (the barrel)")
    assert len(group) == 2, "a finished member stays in the group until the group is done"


def test_static_schedule_respects_the_token_budget_fcfs():
    waiting = deque([_sreq("a", 6), _sreq("b", 6), _sreq("c", 1)])
    rows = static_schedule([], waiting, 4, 10)
    assert [(r.request_id, n) for r, n in rows] == [("a", 6)], "b does not fit and c may not overtake it"


def test_static_schedule_drives_whole_runs():
    rng = random.Random(1)
    for _ in range(20):
        n = rng.randint(1, 9)
        prompts = [rng.randint(1, 10) for _ in range(n)]
        outputs = [rng.randint(1, 8) for _ in range(n)]
        B, T = rng.randint(1, 4), rng.randint(10, 30)
        assert _drive(static_schedule, prompts, outputs, B, T) == _static_ref(prompts, outputs, B, T), (
            f"prompts {prompts}, outputs {outputs}, B={B}, T={T}")


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
