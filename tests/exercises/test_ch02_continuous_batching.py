"""Grades exercises/ch02_continuous_batching.py (or solutions/, with MINILLM_IMPL=solutions).

The oracles are written here from the exercise docstrings, never taken from minillm.
"""
from __future__ import annotations

import random
from collections import deque

import pytest

import adapters
from minillm.course import quiz
from minillm.request import Request, RequestStatus
from minillm.sampling_params import SamplingParams

pytestmark = pytest.mark.exercises

CHAPTER = "ch02_continuous_batching"
schedule_step = adapters.function(CHAPTER, "schedule_step")
continuous_num_steps = adapters.function(CHAPTER, "continuous_num_steps")
predict_makespan = adapters.function(CHAPTER, "predict_makespan")
pick_engine = adapters.function(CHAPTER, "pick_engine")
quiz_answers = adapters.function(CHAPTER, "quiz_answers")


def _req(rid: str, prompt: int, max_tokens: int = 8, computed: int = 0, outputs: int = 0) -> Request:
    r = Request(rid, [5] * prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                arrival_time=0.0)
    r.output_token_ids = [7] * outputs
    r.num_computed_tokens = computed
    return r


def _running(rid, prompt=4, outputs=2):
    r = _req(rid, prompt, outputs=outputs, computed=prompt + outputs - 1)  # decoding: last token not in cache yet
    r.status = RequestStatus.RUNNING
    return r


def _ids(rows):
    try:
        return [(r.request_id, n) for r, n in rows]
    except (TypeError, ValueError, AttributeError):
        return f"{rows!r:.120} (not a list of (request, tokens) rows)"


def _names(requests) -> list[str]:
    return [r.request_id for r in requests]


def _queues(running, waiting) -> str:
    """The state a step starts from, e.g. "running a b, waiting c:5 d:3" (id:prompt tokens)."""
    run = " ".join(f"{r.request_id}{' (finished)' if r.is_finished else ''}" for r in running) or "none"
    wait = " ".join(f"{r.request_id}:{r.num_tokens - r.num_computed_tokens}" for r in waiting) or "none"
    return f"running {run}, waiting {wait}"


def _expect_rows(rows, want, what, max_num_seqs, budget, waiting_before) -> None:
    """The rows of one step against the contract's rows, as "<what>: rows: expected [..], got [..]".
    A cap or the queue order is named only when the rows break it."""
    __tracebackhide__ = True
    got = _ids(rows)
    what = f"{what}: rows"
    if isinstance(got, str):
        adapters.expect_all(got, want, what)
    adapters.expect_that(len(got) <= max_num_seqs, what, want,
                         f"{got} ({len(got)} rows: more than max_num_seqs={max_num_seqs})")
    tokens = sum(n for _, n in got)
    adapters.expect_that(tokens <= budget, what, want,
                         f"{got} ({tokens} tokens: more than max_num_batched_tokens={budget})")
    admitted = [rid for rid, _ in got if rid in waiting_before]
    skipped = [rid for rid in waiting_before[:waiting_before.index(admitted[-1])] if rid not in admitted] \
        if admitted else []
    verb = "wait" if len(skipped) > 1 else "waits"
    adapters.expect_that(not skipped, what, want, f"{got} (admits {admitted[-1] if admitted else ''} while "
                         f"{', '.join(skipped)} {verb} ahead of it: out of queue order)")
    adapters.expect_all(got, want, what)


# ---------------------------------------------------------------- schedule_step


def _step(running, waiting, B, T):
    """Run schedule_step; returns its rows and the description of the step it was given."""
    what = f"schedule_step({_queues(running, waiting)}, max_num_seqs={B}, budget {T})"
    before = _names(waiting)
    return schedule_step(running, waiting, B, T), what, before


def test_decodes_then_admissions():
    """Contract 2-3: running requests decode first, then waiting ones are admitted, popped from `waiting` and marked RUNNING."""
    running = [_running("a"), _running("b")]
    waiting = deque([_req("c", 5), _req("d", 3)])
    rows, what, before = _step(running, waiting, 4, 64)
    _expect_rows(rows, [("a", 1), ("b", 1), ("c", 5), ("d", 3)], what, 4, 64, before)
    adapters.expect(_names(running), ["a", "b", "c", "d"], f"{what}: `running` after the step")
    adapters.expect(_names(waiting), [], f"{what}: `waiting` after the step")
    adapters.expect([(r.request_id, getattr(r.status, "name", r.status)) for r in running],
                    [(x, "RUNNING") for x in "abcd"], f"{what}: statuses in `running` after the step")


def test_finished_requests_leave_and_free_their_slot():
    """Contract 1: finished requests leave `running` first, and their slot is free in the same step."""
    done = _running("a")
    done.status = RequestStatus.FINISHED
    running = [done, _running("b")]
    waiting = deque([_req("c", 4)])
    rows, what, before = _step(running, waiting, 2, 64)
    _expect_rows(rows, [("b", 1), ("c", 4)], what, 2, 64, before)
    adapters.expect(_names(running), ["b", "c"], f"{what}: `running` after the step")


def test_max_num_seqs_caps_the_batch():
    """Contract 3: admission stops once max_num_seqs requests run."""
    running = [_running("a")]
    waiting = deque([_req("b", 2), _req("c", 2), _req("d", 2)])
    rows, what, before = _step(running, waiting, 3, 64)
    _expect_rows(rows, [("a", 1), ("b", 2), ("c", 2)], what, 3, 64, before)
    adapters.expect(_names(waiting), ["d"], f"{what}: `waiting` after the step")


def test_budget_and_fcfs():
    """Contract 3-4: a prompt is admitted only if it fits what is left of the budget; nobody overtakes the head of the queue."""
    running = [_running("a"), _running("b")]
    waiting = deque([_req("c", 7), _req("d", 9), _req("e", 1)])
    rows, what, before = _step(running, waiting, 8, 10)
    # 2 decode tokens + 7 = 9 of 10; "d" (9) does not fit and "e" must not overtake it
    _expect_rows(rows, [("a", 1), ("b", 1), ("c", 7)], what, 8, 10, before)
    adapters.expect(_names(waiting), ["d", "e"], f"{what}: `waiting` after the step")


def test_decodes_are_charged_to_the_budget():
    """Contract 2-3: each running request's decode takes one token of the budget before any admission."""
    running = [_running("a"), _running("b"), _running("c")]
    waiting = deque([_req("d", 8)])
    rows, what, before = _step(running, waiting, 8, 10)
    # 3 decode tokens + 8 = 11 > 10: "d" waits, although its 8 tokens alone would fit
    _expect_rows(rows, [("a", 1), ("b", 1), ("c", 1)], what, 8, 10, before)
    adapters.expect(_names(waiting), ["d"], f"{what}: `waiting` after the step")


def test_empty_queues():
    """Nothing running and nothing waiting: a step with no rows."""
    adapters.expect(_ids(schedule_step([], deque(), 4, 16)), [],
                    "schedule_step(nothing running, nothing waiting, max_num_seqs=4, budget 16): rows")


def _continuous_ref(prompts, outputs, B, T):
    """The rows of every step, written from the contract: [[(request id, tokens), ...], ...]."""
    waiting = list(range(len(prompts)))
    running: list[int] = []
    generated = [0] * len(prompts)
    steps = []
    while waiting or running:
        rows = [(str(i), 1) for i in running]
        budget = T - len(running)
        for i in running:
            generated[i] += 1
        while waiting and len(running) < B and prompts[waiting[0]] <= budget:
            i = waiting.pop(0)
            budget -= prompts[i]
            generated[i] += 1
            running.append(i)
            rows.append((str(i), prompts[i]))
        steps.append(rows)
        running = [i for i in running if generated[i] < outputs[i]]
    return steps


def _simulate_ref(prompts, outputs, B, T):
    """Step count written from the contract."""
    return len(_continuous_ref(prompts, outputs, B, T))


def test_schedule_step_drives_a_whole_run():
    """The contract, step after step over a whole run: every step's rows are the rule's rows."""
    rng = random.Random(0)
    for _ in range(15):
        n = rng.randint(1, 10)
        prompts = [rng.randint(1, 12) for _ in range(n)]
        outputs = [rng.randint(1, 12) for _ in range(n)]
        B, T = rng.randint(1, 5), rng.randint(12, 40)
        workload = f"prompts {prompts}, outputs {outputs}, max_num_seqs={B}, budget {T}"
        want = _continuous_ref(prompts, outputs, B, T)
        reqs = [_req(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
        waiting, running, steps = deque(reqs), [], 0
        while waiting or any(not r.is_finished for r in running):
            before = _names(waiting)
            rows = schedule_step(running, waiting, B, T)
            expected = want[steps] if steps < len(want) else "the end of the run (all requests finished)"
            what = f"step {steps + 1} ({workload})"
            _expect_rows(rows, expected, what, B, T, before)
            adapters.expect_that(len(running) <= B, f"{what}: `running` after the step",
                                 f"at most max_num_seqs={B} requests",
                                 f"{_names(running)} ({len(running)} requests: more than max_num_seqs)")
            for r, k in rows:  # a fake forward: the sampled token is always 7
                r.num_computed_tokens += k
                r.output_token_ids.append(7)
                if r.num_output_tokens == r.sampling_params.max_tokens:
                    r.status = RequestStatus.FINISHED
            steps += 1
        adapters.expect_that(steps == len(want), f"step {steps + 1} ({workload}): rows",
                             want[steps] if steps < len(want) else "", "no step: no request left in the queues")


# ---------------------------------------------------------------- continuous_num_steps


def test_continuous_num_steps_example():
    """The docstring's example: a finished request frees its slot for the next step."""
    for B, want in ((2, 820), (4, 800)):
        adapters.expect(continuous_num_steps([4] * 4, [20, 20, 800, 20], B, 64), want,
                        f"continuous_num_steps(prompts [4, 4, 4, 4], outputs [20, 20, 800, 20], max_num_seqs={B}, "
                        f"budget 64)")


def test_continuous_num_steps_random():
    """Steps of a whole offline run under schedule_step's rule, on random workloads."""
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 14)
        prompts = [rng.randint(1, 16) for _ in range(n)]
        outputs = [rng.randint(1, 30) for _ in range(n)]
        B, T = rng.randint(1, 6), rng.randint(16, 48)
        adapters.expect(continuous_num_steps(prompts, outputs, B, T), _simulate_ref(prompts, outputs, B, T),
                        f"continuous_num_steps(prompts {prompts}, outputs {outputs}, max_num_seqs={B}, budget {T})")


def test_continuous_beats_static_on_skewed_lengths():
    """With one long output in every eight, continuous batching needs far fewer steps than static groups."""
    outputs = [20] * 7 + [800]
    steps = continuous_num_steps([8] * 32, outputs * 4, 8, 256)
    static_steps = 4 * 800
    adapters.expect_that(steps < static_steps / 3,
                         "continuous_num_steps(32 prompts of 8, outputs [20] * 7 + [800] four times, max_num_seqs=8, "
                         "budget 256)", f"fewer than {static_steps / 3:.0f} steps (a third of static batching's "
                         f"{static_steps})", steps)


# ---------------------------------------------------------------- predict_makespan / pick_engine
# The oracle is the simulator: minillm's real schedulers on a virtual clock, each step
# costing what the cost model says. Two cost models: one where a step's fixed cost
# dominates (batching pays), one where per-token work dominates.

def _cost_models():
    from minillm.bench.cost_model import CostModel

    return [CostModel(overhead=0.03, per_token=0.0006, per_context=0.0, per_padded_context=2e-5, per_sample=0.004),
            CostModel(overhead=0.002, per_token=0.004, per_context=1e-5, per_padded_context=0.0, per_sample=0.001)]


def _simulated(prompt_lens, output_lens, B, engine, cost) -> float:
    from minillm.bench.cost_model import simulate
    from minillm.bench.workload import workload_from_lengths

    wl = workload_from_lengths(prompt_lens, output_lens)
    res = simulate(wl, engine, max_num_seqs=B, max_num_batched_tokens=sum(prompt_lens) + B, cost=cost)
    return res.end - res.start


CASES = [
    ([8, 8, 8, 8], [5, 5, 5, 5], 2),
    ([12, 30, 7, 19, 25], [40, 3, 3, 9, 2], 2),
    ([16] * 8, [4, 4, 4, 60, 4, 4, 4, 4], 4),
    ([50, 5], [1, 1], 1),
]


@pytest.mark.parametrize("engine", ["static", "continuous"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_predict_makespan_matches_the_simulated_engine(engine, case):
    """The makespan is the sum of the step times of the engine's rules, static and continuous."""
    prompt_lens, output_lens, B = CASES[case]
    for k, cost in enumerate(_cost_models()):
        want = _simulated(prompt_lens, output_lens, B, engine, cost)
        got = predict_makespan(list(prompt_lens), list(output_lens), B, engine, cost.step_time)
        adapters.expect_approx(got, want, f"predict_makespan(prompts {prompt_lens}, outputs {output_lens}, "
                               f"max_num_seqs={B}, {engine!r}, cost model {k}) against the engine on a virtual clock",
                               rel=1e-6, unit=" s")


def test_predict_makespan_random_workloads():
    """The makespan of random workloads, static and continuous, equals the engine's on a virtual clock."""
    rng = random.Random(7)
    cost = _cost_models()[0]
    for _ in range(6):
        n = rng.randint(1, 9)
        prompt_lens = [rng.randint(1, 40) for _ in range(n)]
        output_lens = [rng.choice([1, 2, 3, 5, 30]) for _ in range(n)]
        B = rng.randint(1, 4)
        for engine in ("static", "continuous"):
            want = _simulated(prompt_lens, output_lens, B, engine, cost)
            got = predict_makespan(list(prompt_lens), list(output_lens), B, engine, cost.step_time)
            adapters.expect_approx(got, want, f"predict_makespan(prompts {prompt_lens}, outputs {output_lens}, "
                                   f"max_num_seqs={B}, {engine!r}) against the engine on a virtual clock",
                                   rel=1e-6, unit=" s")


def test_pick_engine_agrees_with_the_simulated_engines():
    """The engine that finishes first by predict_makespan; a tie within 0.1% goes to static."""
    rng = random.Random(11)
    cost = _cost_models()[0]
    cases = CASES + [([rng.randint(4, 30) for _ in range(8)], [rng.choice([2, 3, 40]) for _ in range(8)], 4)]
    graded = []  # (case, static s, continuous s, the right answer)
    for prompt_lens, output_lens, B in cases:
        s = _simulated(prompt_lens, output_lens, B, "static", cost)
        c = _simulated(prompt_lens, output_lens, B, "continuous", cost)
        # no case sits on the tie line, where rounding could flip the answer
        assert abs(c - s * 0.999) > 1e-9 * s, f"prompts {prompt_lens}, outputs {output_lens}: a near-tie case"
        graded.append(((prompt_lens, output_lens, B), s, c, "continuous" if c < s * 0.999 else "static"))
    # Every answer is the right one in some case: a pick_engine that always says one thing fails.
    right = {want for *_, want in graded}
    assert right == {"static", "continuous"}, f"the graded cases must make each answer right once, got only {right}"
    for (prompt_lens, output_lens, B), s, c, want in graded:
        got = pick_engine(list(prompt_lens), list(output_lens), B, cost.step_time)
        adapters.expect(got, want, f"pick_engine(prompts {prompt_lens}, outputs {output_lens}, max_num_seqs={B}) "
                                   f"(simulated: static {s:.3f} s, continuous {c:.3f} s)")


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    """Each question's answer, checked against its digest."""
    answers = quiz_answers()
    adapters.expect_that(isinstance(answers, dict), "quiz_answers()", "a dict of answers", type(answers).__name__)
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    if not ok:  # the right answer is kept secret (a digest): the line says what was given
        pytest.fail(why, pytrace=False)
