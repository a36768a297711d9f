"""Scheduler invariants, on the schedulers alone (no model): hypothesis draws workloads.

For the static and the continuous scheduler, whatever the prompts, output lengths,
arrival times, batch size and token budget:
  - every request finishes, with exactly its max_tokens (or max_model_len) tokens;
  - never more than max_num_seqs requests run (or hold a slot);
  - no step feeds more tokens than the budget;
  - requests are admitted in arrival order (FCFS);
  - all KV slots are free at the end.
Static batching additionally never admits while a group is in flight.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.metrics import record_step
from minillm.bench.summary import slot_utilization
from minillm.request import Request
from minillm.sampling_params import SamplingParams
from minillm.scheduler import ContinuousScheduler, StaticScheduler

ENGINES = {"static": StaticScheduler, "continuous": ContinuousScheduler}


@st.composite
def workloads(draw):
    budget = draw(st.integers(1, 64))
    n = draw(st.integers(1, 12))
    prompts = draw(st.lists(st.integers(1, budget), min_size=n, max_size=n))
    outputs = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    offline = draw(st.booleans())
    gaps = draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    arrivals, t = [], 0.0
    for g in gaps:
        arrivals.append(0.0 if offline else t)
        t += g
    return dict(budget=budget, prompts=prompts, outputs=outputs, arrivals=arrivals,
                max_num_seqs=draw(st.integers(1, 8)), max_model_len=draw(st.integers(65, 96)))


def run_scheduler(kind: str, w: dict, step_time: float = 1.0):
    """Drive the scheduler with a fake forward: every sampling row samples token 7."""
    sched = ENGINES[kind](w["max_num_seqs"], w["budget"], w["max_model_len"], eos_token_id=2)
    clock = [0.0]
    sched.clock = lambda: clock[0]
    reqs = []
    for i, (p, o, a) in enumerate(zip(w["prompts"], w["outputs"], w["arrivals"])):
        r = Request(str(i), [5] * p, SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True), arrival_time=a)
        reqs.append(r)
        sched.add(r)
    admitted: list[str] = []
    steps = []
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        before = {r.request_id for r in sched.running}
        in_flight_group = kind == "static" and bool(sched.group) and bool(sched.running)
        out = sched.schedule()
        if not out.rows:
            pending = [r.arrival_time for r in sched.waiting if r.arrival_time > clock[0]]
            assert pending, "nothing scheduled although a request has arrived and slots are free"
            clock[0] = min(pending)
            continue
        ids = [row.request.request_id for row in out.rows]
        assert len(ids) == len(set(ids)), "a request appears twice in one step"
        assert len(sched.running) <= w["max_num_seqs"], "more requests running than max_num_seqs"
        assert out.num_tokens <= w["budget"], "a step feeds more tokens than the token budget"
        assert all(row.num_new_tokens >= 1 for row in out.rows)
        assert all(row.request.arrival_time <= clock[0] for row in out.rows), "scheduled before it arrived"
        new = [i for i in ids if i not in before]
        if in_flight_group:
            assert not new, "static batching admitted a request while its group was still running"
        admitted.extend(new)
        if kind == "static":
            assert len(sched.group) <= w["max_num_seqs"]
        sampled = {i: [7] for i, row in enumerate(out.rows) if row.samples}
        start = clock[0]
        clock[0] += step_time
        sched.update(out, sampled, now=clock[0])
        steps.append(record_step(len(steps), start, clock[0], out, len(sampled), sched, sched.max_model_len, 1))
    else:
        pytest.fail("the scheduler did not finish the workload in 10000 steps")
    return sched, reqs, admitted, steps


@pytest.mark.parametrize("kind", list(ENGINES))
@settings(max_examples=150, deadline=None)
@given(w=workloads())
def test_invariants(kind, w):
    sched, reqs, admitted, steps = run_scheduler(kind, w)
    for r in reqs:
        assert r.is_finished, f"request {r.request_id} never finished"
        want = min(r.sampling_params.max_tokens, w["max_model_len"] - r.num_prompt_tokens)
        assert r.num_output_tokens == want, f"request {r.request_id}: {r.num_output_tokens} tokens, want {want}"
    assert admitted == [r.request_id for r in reqs], "requests were not admitted in arrival order (FCFS)"
    assert sched.block_manager.num_free_blocks == w["max_num_seqs"] and not sched.block_manager.tables, \
        "KV slots leaked"
    sched.block_manager.check_invariants()
    for s in steps:
        assert s.num_tokens <= s.token_slots
        assert s.kv_used_bytes <= s.kv_reserved_bytes
    assert 0 < slot_utilization(steps) <= 1


@settings(max_examples=100, deadline=None)
@given(w=workloads())
def test_continuous_never_needs_more_steps_than_static(w):
    w = dict(w, arrivals=[0.0] * len(w["prompts"]))  # offline: the comparison is about lengths only
    *_, static_steps = run_scheduler("static", w)
    *_, cont_steps = run_scheduler("continuous", w)
    assert len(cont_steps) <= len(static_steps)
    assert slot_utilization(cont_steps) >= slot_utilization(static_steps) - 1e-9


def test_static_waits_for_the_longest_member():
    w = dict(budget=64, prompts=[4] * 4, outputs=[2, 2, 2, 10], arrivals=[0.0] * 4, max_num_seqs=4,
             max_model_len=96)
    _, reqs, _, steps = run_scheduler("static", w)
    assert len(steps) == 10  # one group: it lasts as long as its 10-token member
    assert steps[5].held_ids == ["0", "1", "2"] and steps[5].idle_slots == 3
    assert steps[5].kv_reserved_bytes == 4 * 96  # the whole group keeps its regions
    w2 = dict(w, prompts=[4] * 8, outputs=[2, 2, 2, 10] * 2, arrivals=[0.0] * 8)
    _, reqs, _, steps = run_scheduler("static", w2)
    first_of_second_group = min(r.metrics.first_scheduled_time for r in reqs[4:])
    assert first_of_second_group >= max(r.metrics.finish_time for r in reqs[:4])


def test_continuous_admits_into_a_freed_slot_next_step():
    w = dict(budget=64, prompts=[4] * 3, outputs=[2, 10, 3], arrivals=[0.0] * 3, max_num_seqs=2, max_model_len=96)
    _, reqs, _, steps = run_scheduler("continuous", w)
    # request 0 finishes at the end of step 1 (2 tokens); request 2 prefills in step 2
    assert steps[2].request_ids == ["1", "2"] and steps[2].num_new_tokens == [1, 4]


def test_fcfs_head_of_line_waits_for_budget():
    # The head (40 tokens) does not fit beside the running decode; a later short prompt
    # must not overtake it.
    w = dict(budget=40, prompts=[30, 40, 2], outputs=[3, 2, 2], arrivals=[0.0, 0.0, 0.0], max_num_seqs=4,
             max_model_len=96)
    _, _, admitted, steps = run_scheduler("continuous", w)
    assert admitted == ["0", "1", "2"]
