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
    return [(r.request_id, n) for r, n in rows]


# ---------------------------------------------------------------- schedule_step


def test_decodes_then_admissions():
    running = [_running("a"), _running("b")]
    waiting = deque([_req("c", 5), _req("d", 3)])
    rows = schedule_step(running, waiting, 4, 64)
    assert _ids(rows) == [("a", 1), ("b", 1), ("c", 5), ("d", 3)], (
        "every running request decodes one token, then waiting ones are admitted with their whole prompt")
    assert [r.request_id for r in running] == ["a", "b", "c", "d"], "admitted requests join `running` in place"
    assert not waiting, "admitted requests leave `waiting`"
    assert all(r.status is RequestStatus.RUNNING for r in running)


def test_finished_requests_leave_and_free_their_slot():
    done = _running("a")
    done.status = RequestStatus.FINISHED
    running = [done, _running("b")]
    waiting = deque([_req("c", 4)])
    rows = schedule_step(running, waiting, 2, 64)
    assert _ids(rows) == [("b", 1), ("c", 4)], "a finished request frees its slot for a waiting one at once"
    assert [r.request_id for r in running] == ["b", "c"]


def test_max_num_seqs_caps_the_batch():
    running = [_running("a")]
    waiting = deque([_req("b", 2), _req("c", 2), _req("d", 2)])
    rows = schedule_step(running, waiting, 3, 64)
    assert _ids(rows) == [("a", 1), ("b", 2), ("c", 2)], "never more than max_num_seqs requests run"
    assert [r.request_id for r in waiting] == ["d"]


def test_budget_and_fcfs():
    running = [_running("a"), _running("b")]
    waiting = deque([_req("c", 7), _req("d", 9), _req("e", 1)])
    rows = schedule_step(running, waiting, 8, 10)
    # 2 decode tokens + 7 = 9 of 10; "d" (9) does not fit and "e" must not overtake it
    assert _ids(rows) == [("a", 1), ("b", 1), ("c", 7)], (
        "admission stops at the first request that does not fit the token budget (FCFS: no overtaking)")
    assert [r.request_id for r in waiting] == ["d", "e"]


def test_empty_queues():
    assert list(schedule_step([], deque(), 4, 16)) == [], "nothing running, nothing waiting: no rows"


def _simulate_ref(prompts, outputs, B, T):
    """Step counter written from the contract: per request (prompt, wanted, generated)."""
    waiting = list(range(len(prompts)))
    running: list[int] = []
    generated = [0] * len(prompts)
    steps = 0
    while waiting or running:
        budget = T - len(running)
        for i in running:
            generated[i] += 1
        while waiting and len(running) < B and prompts[waiting[0]] <= budget:
            i = waiting.pop(0)
            budget -= prompts[i]
            generated[i] += 1
            running.append(i)
        steps += 1
        running = [i for i in running if generated[i] < outputs[i]]
    return steps


def test_schedule_step_drives_a_whole_run():
    rng = random.Random(0)
    for _ in range(15):
        n = rng.randint(1, 10)
        prompts = [rng.randint(1, 12) for _ in range(n)]
        outputs = [rng.randint(1, 12) for _ in range(n)]
        B, T = rng.randint(1, 5), rng.randint(12, 40)
        reqs = [_req(str(i), p, o) for i, (p, o) in enumerate(zip(prompts, outputs))]
        waiting, running, steps = deque(reqs), [], 0
        while waiting or any(not r.is_finished for r in running):
            rows = schedule_step(running, waiting, B, T)
            assert rows, "a step with queued requests and free room must schedule something"
            assert len(running) <= B and sum(n for _, n in rows) <= T
            for r, k in rows:  # a fake forward: the sampled token is always 7
                r.num_computed_tokens += k
                r.output_token_ids.append(7)
                if r.num_output_tokens == r.sampling_params.max_tokens:
                    r.status = RequestStatus.FINISHED
            steps += 1
        assert steps == _simulate_ref(prompts, outputs, B, T), f"prompts {prompts}, outputs {outputs}, B={B}, T={T}"


# ---------------------------------------------------------------- continuous_num_steps


def test_continuous_num_steps_example():
    assert continuous_num_steps([4] * 4, [20, 20, 800, 20], 2, 64) == 820
    assert continuous_num_steps([4] * 4, [20, 20, 800, 20], 4, 64) == 800


def test_continuous_num_steps_random():
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 14)
        prompts = [rng.randint(1, 16) for _ in range(n)]
        outputs = [rng.randint(1, 30) for _ in range(n)]
        B, T = rng.randint(1, 6), rng.randint(16, 48)
        assert continuous_num_steps(prompts, outputs, B, T) == _simulate_ref(prompts, outputs, B, T), (
            f"prompts {prompts}, outputs {outputs}, B = {B}, T = {T}")


def test_continuous_beats_static_on_skewed_lengths():
    outputs = [20] * 7 + [800]
    steps = continuous_num_steps([8] * 32, outputs * 4, 8, 256)
    static_steps = 4 * 800
    assert steps < static_steps / 3, f"continuous batching should need far fewer steps than static ({steps})"


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
    prompt_lens, output_lens, B = CASES[case]
    for cost in _cost_models():
        want = _simulated(prompt_lens, output_lens, B, engine, cost)
        got = predict_makespan(list(prompt_lens), list(output_lens), B, engine, cost.step_time)
        assert abs(got - want) <= 1e-6 * want, (
            f"{engine}, prompts {prompt_lens}, outputs {output_lens}, B={B}: predicted {got:.6f} s, "
            f"the engine on a virtual clock took {want:.6f} s")


def test_predict_makespan_random_workloads():
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
            assert abs(got - want) <= 1e-6 * want, (prompt_lens, output_lens, B, engine, got, want)


def test_pick_engine_agrees_with_the_simulated_engines():
    rng = random.Random(11)
    cost = _cost_models()[0]
    picked = set()
    for case in CASES + [([rng.randint(4, 30) for _ in range(8)], [rng.choice([2, 3, 40]) for _ in range(8)], 4)]:
        prompt_lens, output_lens, B = case
        s = _simulated(prompt_lens, output_lens, B, "static", cost)
        c = _simulated(prompt_lens, output_lens, B, "continuous", cost)
        want = "continuous" if c < s * 0.999 else "static"
        got = pick_engine(list(prompt_lens), list(output_lens), B, cost.step_time)
        assert got == want, f"prompts {prompt_lens}, outputs {output_lens}, B={B}: static {s:.3f} s, " \
                            f"continuous {c:.3f} s, so {want!r}; got {got!r}"
        picked.add(want)
    assert picked == {"static", "continuous"}, "the cases must exercise both answers"


# ---------------------------------------------------------------- questions


@pytest.mark.parametrize("qid", [q.qid for q in quiz.questions(CHAPTER)])
def test_quiz(qid):
    answers = quiz_answers()
    assert isinstance(answers, dict), f"quiz_answers() must return a dict of answers, got {type(answers).__name__}"
    ok, why = quiz.check(CHAPTER, qid, answers.get(qid))
    assert ok, why
