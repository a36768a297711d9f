"""Chapter 3's preemption choice and chapter 4's budget split are seams of the priority policy
too, so the assembled engine (``capstone --all``: priority classes, chunked prefill) runs them.

With the reference answers plugged, the priority scheduler's schedule is the library's; a wrong
victim or split changes it; a victim that is not one of the candidates is a clear error.
"""
from __future__ import annotations

import math

import pytest

from minillm import seams
from minillm.sampling_params import SamplingParams
from test_seams_ch06 import OUT_LENS, conversations
from test_spec_engine import assert_all_free, tiny_engine

import solutions.ch03_paged_attention as s03  # noqa: E402
import solutions.ch04_chunked_prefill as s04  # noqa: E402

# A tight pool (preemptions), chunked prefill with a small budget (splits), three classes whose
# timeouts are out of reach or already past (the order does not depend on the machine's speed).
# Most requests are of the batch class, so a preemption has several candidates to choose from.
LEVELS = ("batch", "interactive", "batch", "batch", "standard", "batch", "batch", "interactive")
OPTS = dict(scheduling_policy="priority", enable_chunked_prefill=True, max_num_batched_tokens=12,
            max_num_seqs=4, num_blocks=14, block_size=4, max_model_len=48,
            queue_timeouts={"interactive": math.inf, "standard": 0.0, "batch": math.inf})


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """These tests time nothing: one thread keeps them quick on a shared machine."""


def run(impls: dict | None = None):
    eng = tiny_engine(**OPTS)
    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        return call

    params = [SamplingParams(temperature=0.0, max_tokens=n + 6, ignore_eos=True, priority=lv)
              for n, lv in zip(OUT_LENS, LEVELS)]
    with seams.plug(**{n: counted(n, f) for n, f in (impls or {}).items()}):
        reqs = [eng.make_request(p, sp, arrival_time=0.0) for p, sp in zip(conversations(), params)]
        tokens = [o.token_ids for o in eng.run(reqs)]
    schedule = [(tuple(s.request_ids), tuple(s.num_new_tokens), s.kv_reserved_bytes) for s in eng.step_records]
    preempted = sum(r.metrics.num_preemptions for r in reqs)
    return tokens, schedule, preempted, calls, eng


@pytest.fixture(scope="module")
def library():
    return run()


def test_the_workload_preempts_and_splits(library):
    _, schedule, preempted, _, eng = library
    assert preempted > 0
    assert any(n not in (1,) and 0 < n < 12 for _, ns, _ in schedule for n in ns), "some prompt goes in chunks"
    assert_all_free(eng)


def test_reference_victim_and_split_keep_the_priority_schedule(library):
    tokens, schedule, preempted, calls, eng = run(dict(choose_victim=s03.choose_victim,
                                                      split_budget=s04.split_budget))
    assert tokens == library[0] and schedule == library[1] and preempted == library[2]
    assert calls.get("choose_victim", 0) > 0 and calls.get("split_budget", 0) > 0, calls
    assert_all_free(eng)


def test_a_wrong_victim_changes_the_schedule(library):
    oldest = lambda running: running[0]  # noqa: E731  (the oldest of the lowest class)
    tokens, schedule, _, calls, eng = run(dict(choose_victim=oldest))
    assert calls.get("choose_victim", 0) > 0
    assert schedule != library[1]
    assert tokens == library[0]  # greedy tokens do not depend on the schedule
    assert_all_free(eng)


def test_a_wrong_split_changes_the_schedule(library):
    def half(num_decodes, lefts, budget):  # gives each prefill at most half of what it could take
        out, left = [], budget - num_decodes
        for n in lefts:
            take = min(n, max(left // 2, 1) if left > 0 else 0)
            out.append(take)
            left -= take
        return out

    _, schedule, _, calls, eng = run(dict(split_budget=half))
    assert calls.get("split_budget", 0) > 0 and schedule != library[1]
    assert_all_free(eng)


def test_a_victim_outside_the_candidates_is_a_clear_error():
    eng = tiny_engine(**OPTS)
    outsider = object()
    params = [SamplingParams(temperature=0.0, max_tokens=n + 6, ignore_eos=True, priority=lv)
              for n, lv in zip(OUT_LENS, LEVELS)]
    with seams.plug(choose_victim=lambda running: outsider):
        reqs = [eng.make_request(p, sp, arrival_time=0.0) for p, sp in zip(conversations(), params)]
        with pytest.raises(ValueError, match="choose_victim .*the victim is one of the running requests"):
            eng.run(reqs)
