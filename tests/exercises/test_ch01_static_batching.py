"""Grades exercises/ch01_static_batching.py (or solutions/, with MINILLM_IMPL=solutions).

The oracles are written here, from the definitions in the exercise docstrings, never
taken from minillm, so the tests stay meaningful for the solutions that wrap minillm.
"""
from __future__ import annotations

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


def _two_tensors(out, what):
    """(input_ids, attention_mask) as returned, after checking they are two tensors."""
    __tracebackhide__ = True
    pair = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    adapters.expect_that(len(pair) == 2 and all(isinstance(t, torch.Tensor) for t in pair), what,
                         "two tensors (input_ids, attention_mask)", ", ".join(type(t).__name__ for t in pair))
    return pair


def test_left_pad_layout():
    """Contract: row i is W - len(prompts[i]) pads, then the prompt; mask 0 on padding, 1 on tokens; inputs unchanged."""
    prompts = [[5, 6, 7], [8], [9, 10]]
    what = "left_pad([[5, 6, 7], [8], [9, 10]], pad_id=0)"
    ids, mask = _two_tensors(left_pad(prompts, 0), what)
    adapters.expect((adapters.shape_of(ids), adapters.shape_of(mask)), ((3, 3), (3, 3)),
                    f"{what}: shapes of (input_ids, attention_mask)")
    adapters.expect((ids.dtype, mask.dtype), (torch.long, torch.long), f"{what}: dtypes of (input_ids, attention_mask)")
    adapters.expect(ids.tolist(), [[5, 6, 7], [0, 0, 8], [0, 9, 10]], f"{what}: input_ids")
    adapters.expect(mask.tolist(), [[1, 1, 1], [0, 0, 1], [0, 1, 1]], f"{what}: attention_mask")
    adapters.expect(prompts, [[5, 6, 7], [8], [9, 10]], f"{what}: its input prompts after the call")


def test_left_pad_mask_marks_positions_not_token_values():
    """Contract: attention_mask is 0 on padding and 1 on real tokens, even on a real token equal to pad_id."""
    prompts = [[0, 5], [7, 0, 0]]  # token 0 is also the pad id
    what = "left_pad([[0, 5], [7, 0, 0]], pad_id=0)"
    ids, mask = _two_tensors(left_pad(prompts, 0), what)
    adapters.expect(ids.tolist(), [[0, 0, 5], [7, 0, 0]], f"{what}: input_ids")
    adapters.expect(mask.tolist(), [[0, 1, 1], [1, 1, 1]], f"{what}: attention_mask")


def test_left_pad_random():
    """Contract: left padding to the longest prompt, with its mask, for any batch of prompts."""
    rng = random.Random(0)
    for i in range(20):
        prompts = [[rng.randrange(3, 100) for _ in range(rng.randint(1, 1 + i * 8 // 19))]
                   for _ in range(rng.randint(1, 1 + i * 5 // 19))]
        what = f"left_pad({prompts}, pad_id=2)"
        ids, mask = _two_tensors(left_pad(prompts, 2), what)
        W = max(map(len, prompts))
        adapters.expect(adapters.shape_of(ids), (len(prompts), W), f"{what}: shape of input_ids")
        adapters.expect(adapters.shape_of(mask), (len(prompts), W), f"{what}: shape of attention_mask")
        for row, p in enumerate(prompts):
            adapters.expect(ids[row].tolist(), [2] * (W - len(p)) + p, f"{what}: input_ids row {row}")
            adapters.expect(mask[row].tolist(), [0] * (W - len(p)) + [1] * len(p), f"{what}: attention_mask row {row}")


# ---------------------------------------------------------------- static_num_steps


def test_static_num_steps_barrel():
    """Contract: groups of B in arrival order; each takes as many steps as its longest member wants tokens."""
    cases = [([3], 1, 3, "one request: 1 prefill + 2 decodes"),
             ([1, 9, 1, 9], 2, 18, "groups in arrival order (1, 9) then (1, 9), not sorted by length"),
             ([20, 20, 800, 20], 2, 820, "groups (20, 20) then (800, 20): 20 + 800"),
             ([20, 20, 800, 20], 4, 800, "one group, as long as its longest member"),
             ([5, 3, 7], 1, 15, "one request at a time"),
             ([4, 4, 4], 8, 4, "one group smaller than B")]
    for outputs, B, want, why in cases:
        adapters.expect(static_num_steps(outputs, B), want, f"static_num_steps(outputs {outputs}, B={B}) ({why})")


def test_static_num_steps_random():
    """Contract: the total over the groups of their longest member's tokens, for any lengths and B."""
    rng = random.Random(1)
    for i in range(30):
        outs = [rng.randint(1, 40) for _ in range(rng.randint(1, 1 + i * 19 // 29))]
        B = rng.randint(1, 9)
        adapters.expect(static_num_steps(outs, B), _steps_ref(outs, B), f"static_num_steps(outputs {outs}, B={B})")


# ---------------------------------------------------------------- static_token_slots


def _pair(x):
    try:
        return tuple(x)
    except TypeError:
        return x


def test_static_token_slots_example():
    """Contract: a prefill is B x W slots, useful on prompt tokens; decode step k is B slots, useful while k < output."""
    # prefill [2 x 5] = 10 slots, 8 useful; decode steps 1 and 2: 2 slots each, 1 useful each
    adapters.expect(_pair(static_token_slots([3, 5], [1, 3], 2)), (10, 14),
                    "static_token_slots(prompts [3, 5], outputs [1, 3], B=2) as (useful, total)")


def test_static_token_slots_counts_empty_rows_of_a_small_last_group():
    """Contract: every step is a rectangle of B rows, even for a last group smaller than B."""
    # one request in a batch of 4 slots: prefill 4 x 6, then 2 decodes of 4 slots
    adapters.expect(_pair(static_token_slots([6], [3], 4)), (6 + 2, 4 * 6 + 4 * 2),
                    "static_token_slots(prompts [6], outputs [3], B=4) as (useful, total)")


def test_static_token_slots_random():
    """Contract: (useful, total) token-slots summed over every prefill and decode step, for any lengths and B."""
    rng = random.Random(2)
    for i in range(30):
        n = rng.randint(1, 1 + i * 11 // 29)
        prompts = [rng.randint(1, 30) for _ in range(n)]
        outs = [rng.randint(1, 30) for _ in range(n)]
        B = rng.randint(1, 6)
        adapters.expect(_pair(static_token_slots(prompts, outs, B)), _slots_ref(prompts, outs, B),
                        f"static_token_slots(prompts {prompts}, outputs {outs}, B={B}) as (useful, total)")


def test_skewed_batch_wastes_most_slots():
    """Contract: useful / total is the slot utilization; one long member makes its group waste most slots."""
    useful, total = static_token_slots([16] * 8, [20] * 7 + [800], 8)
    adapters.expect_that(useful / total < 0.2, "useful / total of static_token_slots(prompts [16] * 8, "
                         "outputs [20] * 7 + [800], B=8)", "below 0.2", f"{useful} / {total} = {useful / total:.3f}")


# ---------------------------------------------------------------- static_schedule


def _sreq(rid: str, prompt: int, max_tokens: int = 4):
    return Request(rid, [5] * prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=0.0)


def _ids(rows):
    try:
        return [(r.request_id, n) for r, n in rows]
    except (TypeError, ValueError, AttributeError):
        return f"{rows!r:.120} (not a list of (request, tokens) rows)"


def _names(requests) -> list[str]:
    return [r.request_id for r in requests]


def _queues(group, waiting) -> str:
    """The state a step starts from, e.g. "group a (finished) b, waiting c:2" (id:prompt tokens)."""
    grp = " ".join(f"{r.request_id}{' (finished)' if r.is_finished else ''}" for r in group) or "empty"
    wait = " ".join(f"{r.request_id}:{r.num_tokens - r.num_computed_tokens}" for r in waiting) or "none"
    return f"group {grp}, waiting {wait}"


def _expect_rows(rows, want, what, B, T, waiting_before) -> None:
    """One step's rows against the contract's, "<what>: rows: expected [..], got [..]"; a cap or
    the queue order is named only when the rows break it."""
    __tracebackhide__ = True
    got = _ids(rows)
    what = f"{what}: rows"
    if isinstance(got, str):
        adapters.expect_all(got, want, what)
    adapters.expect_that(len(got) <= B, what, want, f"{got} ({len(got)} rows: more than max_num_seqs={B})")
    admitted = [(rid, n) for rid, n in got if rid in waiting_before]
    tokens = sum(n for _, n in admitted)
    adapters.expect_that(tokens <= T, what, want,
                         f"{got} ({tokens} prompt tokens: more than max_num_batched_tokens={T})")
    ids = [rid for rid, _ in admitted]
    skipped = [rid for rid in waiting_before[:waiting_before.index(ids[-1])] if rid not in ids] if ids else []
    verb = "wait" if len(skipped) > 1 else "waits"
    adapters.expect_that(not skipped, what, want, f"{got} (admits {ids[-1] if ids else ''} while "
                         f"{', '.join(skipped)} {verb} ahead of it: out of queue order)")
    adapters.expect_all(got, want, what)


def _drive(schedule, prompts, outputs, B, T, want):
    """Run a whole workload through a static policy with a fake forward, checking each step's
    rows against ``want`` (the contract's rows, step by step) as it goes."""
    workload = f"prompts {prompts}, outputs {outputs}, max_num_seqs={B}, budget {T}"
    waiting = deque(_sreq(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs)))
    group, steps = [], 0
    while waiting or any(not r.is_finished for r in group):
        before = _names(waiting)
        rows = schedule(group, waiting, B, T)
        expected = want[steps] if steps < len(want) else "the end of the run (all requests finished)"
        _expect_rows(rows, expected, f"step {steps + 1} ({workload})", B, T, before)
        for r, n in rows:
            r.num_computed_tokens += n
            r.output_token_ids.append(7)
            if r.num_output_tokens == r.sampling_params.max_tokens:
                r.status = RequestStatus.FINISHED
        steps += 1
    adapters.expect_that(steps == len(want), f"step {steps + 1} ({workload}): rows",
                         want[steps] if steps < len(want) else "", "no step: no request left in the queues")


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
    """Contract: a group forms from the front of `waiting` (RUNNING, whole prompts), then its unfinished members decode."""
    waiting = deque([_sreq("a", 3), _sreq("b", 5), _sreq("c", 2)])
    group = []
    what = f"static_schedule({_queues(group, waiting)}, max_num_seqs=2, budget 64)"
    rows = static_schedule(group, waiting, 2, 64)
    _expect_rows(rows, [("a", 3), ("b", 5)], what, 2, 64, ["a", "b", "c"])
    adapters.expect(_names(group), ["a", "b"], f"{what}: `group` after the step")
    adapters.expect(_names(waiting), ["c"], f"{what}: `waiting` after the step")
    adapters.expect([(r.request_id, getattr(r.status, "name", r.status)) for r in group],
                    [("a", "RUNNING"), ("b", "RUNNING")], f"{what}: statuses in `group` after the step")
    group[0].status = RequestStatus.FINISHED
    what = f"static_schedule({_queues(group, waiting)}, max_num_seqs=2, budget 64)"
    rows = static_schedule(group, waiting, 2, 64)
    _expect_rows(rows, [("b", 1)], what, 2, 64, ["c"])
    adapters.expect(_names(group), ["a", "b"], f"{what}: `group` after the step (finished members included)")


def test_static_schedule_respects_the_token_budget_fcfs():
    """Contract: forming stops at the first request whose prompt does not fit what is left of the budget (FCFS)."""
    waiting = deque([_sreq("a", 6), _sreq("b", 6), _sreq("c", 1)])
    what = f"static_schedule({_queues([], waiting)}, max_num_seqs=4, budget 10)"
    rows = static_schedule([], waiting, 4, 10)
    _expect_rows(rows, [("a", 6)], what, 4, 10, ["a", "b", "c"])


def test_static_schedule_admits_a_prompt_that_fills_the_budget_exactly():
    """Contract: a request joins while its whole prompt fits what is left of max_num_batched_tokens (equal fits)."""
    waiting = deque([_sreq("a", 6), _sreq("b", 4), _sreq("c", 1)])
    what = f"static_schedule({_queues([], waiting)}, max_num_seqs=4, budget 10)"
    rows = static_schedule([], waiting, 4, 10)
    _expect_rows(rows, [("a", 6), ("b", 4)], what, 4, 10, ["a", "b", "c"])
    adapters.expect(_names(waiting), ["c"], f"{what}: `waiting` after the step")


def test_static_schedule_keeps_the_group_closed_while_a_member_runs():
    """Contract: while a member is unfinished, only unfinished members get rows (one decode token); nobody is admitted."""
    group = [_sreq("a", 3), _sreq("b", 2), _sreq("c", 4)]
    for r in group:
        r.status = RequestStatus.RUNNING
    group[0].status = RequestStatus.FINISHED
    group[2].status = RequestStatus.FINISHED
    waiting = deque([_sreq("d", 2), _sreq("e", 1)])
    what = f"static_schedule({_queues(group, waiting)}, max_num_seqs=3, budget 64)"
    rows = static_schedule(group, waiting, 3, 64)
    _expect_rows(rows, [("b", 1)], what, 3, 64, ["d", "e"])
    adapters.expect(_names(waiting), ["d", "e"], f"{what}: `waiting` after the step (nobody admitted)")
    adapters.expect(_names(group), ["a", "b", "c"], f"{what}: `group` after the step (finished members included)")


def test_static_schedule_empties_a_done_group_before_forming_the_next():
    """Contract: once every member has finished, `group` is emptied, then the next group forms from `waiting`."""
    group = [_sreq("a", 3), _sreq("b", 2)]
    for r in group:
        r.status = RequestStatus.FINISHED
    waiting = deque([_sreq("c", 2), _sreq("d", 1), _sreq("e", 1)])
    what = f"static_schedule({_queues(group, waiting)}, max_num_seqs=2, budget 64)"
    rows = static_schedule(group, waiting, 2, 64)
    _expect_rows(rows, [("c", 2), ("d", 1)], what, 2, 64, ["c", "d", "e"])
    adapters.expect(_names(group), ["c", "d"], f"{what}: `group` after the step")
    adapters.expect(_names(waiting), ["e"], f"{what}: `waiting` after the step")
    what = "static_schedule(group empty, waiting none, max_num_seqs=2, budget 64)"
    adapters.expect_all(_ids(static_schedule([], deque(), 2, 64)), [], f"{what}: rows (nothing runs, nothing waits)")


def test_static_schedule_drives_whole_runs():
    """Contract: step after step, groups form FCFS under both caps and decode out before the next one forms."""
    rng = random.Random(1)
    for i in range(20):
        n = rng.randint(1, 1 + i * 8 // 19)
        prompts = [rng.randint(1, 10) for _ in range(n)]
        outputs = [rng.randint(1, 8) for _ in range(n)]
        B, T = rng.randint(1, 4), rng.randint(10, 30)
        _drive(static_schedule, prompts, outputs, B, T, _static_ref(prompts, outputs, B, T))


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Contract: quiz_answers() holds the right answer to each of the chapter's questions."""
    answers = quiz_answers()
    adapters.expect_that(isinstance(answers, dict), "quiz_answers()", "a dict of answers", type(answers).__name__)
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:  # the right answer is kept secret (a digest): the line says what was given
        pytest.fail(why, pytrace=False)
