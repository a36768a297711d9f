"""Priority classes and queue timeouts (chapter 6).

Pure Python first: the validation of priorities, timeouts and the policy; the admission
order and the choice of victim as plain functions; the priority scheduler on a virtual
clock; FCFS unchanged (step for step the scheduler as it was before priorities, kept
here as an oracle); random workloads under the priority policy with a fake model that
reads its context through the block tables. Then the real model: greedy outputs under
the priority policy (reordering, preemption) equal FCFS's token for token.
"""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.config import DEFAULT_QUEUE_TIMEOUTS, EngineConfig, check_queue_timeouts, queue_timeout
from minillm.bench.summary import class_metrics
from minillm.request import Request, RequestMetrics, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import PagedScheduler, SchedulerOutput
from minillm.scheduler.priority import admission_order, is_timed_out, pick_victim
from tests.test_prefix_cache import FAST, EOS, ContentEngine, caching_setups, run_fake, shared_prompts

# -------------------------------------------------------------- validation


def test_priority_classes_and_levels():
    assert SamplingParams().priority == "standard"
    assert [SamplingParams(priority=p).priority_level for p in ("interactive", "standard", "batch")] == [0, 1, 2]
    assert SamplingParams(priority=-3).priority_level == -3 and SamplingParams(priority=7).priority_class == "7"
    assert SamplingParams(priority=0).priority_class == "interactive"
    for bad in ("urgent", "Interactive", True, 1.5, None):
        with pytest.raises(ValueError, match="priority"):
            SamplingParams(priority=bad)
    with pytest.raises(ValueError, match="valid classes: interactive, standard, batch"):
        SamplingParams(priority="realtime")


def test_queue_timeouts_validated():
    assert DEFAULT_QUEUE_TIMEOUTS == {"interactive": 0.05, "standard": 0.2, "batch": 1.0}
    assert EngineConfig(engine="paged").queue_timeouts == DEFAULT_QUEUE_TIMEOUTS
    cfg = EngineConfig(engine="paged", scheduling_policy="priority", queue_timeouts={"batch": 5, "interactive": 0})
    assert cfg.queue_timeouts == {"interactive": 0.0, "standard": 0.2, "batch": 5.0}
    for bad, msg in [({"interactive": -0.01}, r"queue_timeouts\['interactive'\] must be a number of seconds >= 0"),
                     ({"batch": float("nan")}, "must be a number"), ({"batch": "1s"}, "must be a number"),
                     ({"urgent": 1.0}, "unknown priority class 'urgent'"), ([0.05], "must be a dict")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig(engine="paged", queue_timeouts=bad)
    assert check_queue_timeouts({"batch": math.inf})["batch"] == math.inf
    t = check_queue_timeouts(None)
    assert [queue_timeout(t, lv) for lv in (-5, 0, 1, 2, 9)] == [0.05, 0.05, 0.2, 1.0, 1.0]


def test_scheduling_policy_validated():
    with pytest.raises(ValueError, match="unknown scheduling_policy 'lifo'; valid policies: fcfs, priority"):
        EngineConfig(engine="paged", scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy='priority' is a policy of the paged scheduler"):
        EngineConfig(engine="continuous", scheduling_policy="priority")
    with pytest.raises(ValueError, match="unknown scheduling_policy"):
        PagedScheduler(2, 64, 64, EOS, 16, 4, scheduling_policy="edf")


# -------------------------------------------------------------- the plain functions


def _req(rid, prio="standard", arrival=0.0, n=8, max_tokens=4):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                              priority=prio), arrival_time=arrival)


TIMEOUTS = check_queue_timeouts(None)


def timeout_of(level):
    return queue_timeout(TIMEOUTS, level)


def test_admission_order_classes_then_queue_order():
    w = [_req("b1", "batch", 0.0), _req("s1", "standard", 0.0), _req("i1", "interactive", 0.0),
         _req("b2", "batch", 0.0), _req("i2", "interactive", 0.0), _req("late", "interactive", 5.0)]
    got = [r.request_id for r in admission_order(w, now=0.01, timeout_of=timeout_of)]
    assert got == ["i1", "i2", "s1", "b1", "b2"], "higher class first, queue order within a class; not arrived: left out"


def test_admission_order_timed_out_first():
    w = [_req("i_new", "interactive", 1.98), _req("b_old", "batch", 0.0), _req("s_old", "standard", 1.7),
         _req("i_old", "interactive", 1.9)]
    # at t=2.0: b_old waited 2 s > 1 s, s_old 0.3 s > 0.2 s, i_old 0.1 s > 50 ms: timed out; i_new is not
    assert [is_timed_out(r, 2.0, timeout_of) for r in w] == [False, True, True, True]
    got = [r.request_id for r in admission_order(w, now=2.0, timeout_of=timeout_of)]
    assert got == ["i_old", "s_old", "b_old", "i_new"]


def test_pick_victim_lowest_class_newest():
    run = [_req("b1", "batch"), _req("i1", "interactive"), _req("b2", "batch"), _req("s1", "standard")]
    assert pick_victim(run).request_id == "b2", "lowest class; the newest of the batch requests"
    assert pick_victim(run, exclude=[run[2]]).request_id == "b1", "a request with a row this step is not a victim"
    assert pick_victim(run, below_level=1).request_id == "b2"
    assert pick_victim(run[1:2] + run[3:], below_level=1) is None, "never preempt an equal or higher class"
    assert pick_victim([]) is None


# -------------------------------------------------------------- the priority scheduler, virtual clock


def _sched(policy="priority", **kw):
    opts = dict(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, eos_token_id=EOS, num_blocks=32,
                block_size=4, scheduling_policy=policy) | kw
    return PagedScheduler(**opts)


def _step(sched, now):
    sched.clock = lambda: now
    out = sched.schedule()
    sched.update(out, {i: [7] for i, row in enumerate(out.rows) if row.samples}, now=now)
    return out


def test_interactive_overtakes_waiting_batch_jobs():
    sched = _sched(max_num_seqs=1)
    for r in [_req("b1", "batch"), _req("b2", "batch"), _req("i1", "interactive")]:
        sched.add(r)
    assert sched.num_waiting_by_class() == {"batch": 2, "interactive": 1}
    out = _step(sched, 0.0)
    assert [row.request.request_id for row in out.rows] == ["i1"]
    fcfs = _sched("fcfs", max_num_seqs=1)
    for r in [_req("b1", "batch"), _req("b2", "batch"), _req("i1", "interactive")]:
        fcfs.add(r)
    assert [row.request.request_id for row in _step(fcfs, 0.0).rows] == ["b1"], "FCFS ignores the class"


@pytest.mark.parametrize("chunked", [False, True])
def test_timed_out_request_preempts_the_lowest_class(chunked):
    # With chunked prefill every running request has its decode row before admission:
    # the room is made before any row is planned.
    sched = _sched(max_num_seqs=2, enable_chunked_prefill=chunked)
    b, s = _req("b", "batch", max_tokens=50), _req("s", "standard", max_tokens=50)
    sched.add(b)
    sched.add(s)
    _step(sched, 0.0)
    assert sched.running == [s, b], "the higher class is admitted first"
    i = _req("i", "interactive", arrival=1.0)
    sched.add(i)
    out = _step(sched, 1.02)  # waited 20 ms < 50 ms: no slot, no preemption, it waits
    assert i in sched.waiting and not out.preempted
    out = _step(sched, 1.06)  # 60 ms: past its timeout, the batch request makes room
    assert out.preempted == [b] and i in sched.running and s in sched.running
    assert b.status is RequestStatus.PREEMPTED and b.metrics.num_preemptions == 1
    # the batch request comes back when a slot frees, with its outputs kept
    while sched.has_unfinished():
        _step(sched, 2.0)
    assert b.is_finished and b.num_output_tokens == 50


def test_no_preemption_of_an_equal_class():
    sched = _sched(max_num_seqs=1)
    a = _req("a", "interactive", max_tokens=30)
    sched.add(a)
    _step(sched, 0.0)
    sched.add(_req("b", "interactive", arrival=0.0))
    out = _step(sched, 5.0)  # b is long past its timeout, but a is of its own class
    assert not out.preempted and sched.running == [a]


def test_memory_pressure_preempts_the_lowest_class_first():
    # 16 blocks of 4 tokens; three requests grow until one must go: the batch one, though it is not the newest.
    sched = _sched(max_num_seqs=3, num_blocks=16, max_model_len=64)
    b, s, i = _req("b", "batch", n=12, max_tokens=40), _req("s", "standard", n=12, max_tokens=40), \
        _req("i", "interactive", n=12, max_tokens=40)
    for r in (b, s, i):
        sched.add(r)
    t = 0.0
    while not sched.num_preemptions:
        _step(sched, t)
        t += 0.001
    assert b.metrics.num_preemptions == 1 and s.metrics.num_preemptions == 0 and i.metrics.num_preemptions == 0


# -------------------------------------------------------------- FCFS is what it was


class FrozenFCFS(PagedScheduler):
    """The paged scheduler's step as it was before chapter 6 (priorities, prefix caching), as an oracle."""

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            budget = self._old_decodes(out, budget)
            budget = self._old_prefills(out, budget)
        else:
            budget = self._old_prefills(out, budget)
            if not out.rows:
                budget = self._old_decodes(out, budget)
        return out

    def _old_make_room(self, r, num_tokens, out):
        while not self.block_manager.can_grow(r, num_tokens):
            victim = self.running[-1]
            if any(row.request is victim for row in out.rows):
                return False
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is r:
                return False
        return True

    def _old_decodes(self, out, budget):
        scheduled = {row.request for row in out.rows}
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r not in scheduled and not r.is_prefill:
                if not self._old_make_room(r, r.num_computed_tokens + 1, out):
                    if r.status is not RequestStatus.RUNNING:
                        break
                    i += 1
                    continue
                self.add_row(r, 1, out)
                budget -= 1
            i += 1
        return budget

    def _old_prefills(self, out, budget):
        scheduled = {row.request for row in out.rows}
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if r in scheduled or not r.is_prefill:
                i += 1
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if not self._old_make_room(r, r.num_computed_tokens + n, out):
                if r.status is not RequestStatus.RUNNING:
                    break
                room = (len(r.block_ids) + self.block_manager.num_free_blocks) * self.block_size
                n = max(min(n, room - r.num_computed_tokens), 0)
            if n:
                self.add_row(r, n, out)
                budget -= n
            i += 1
        now = self.clock()
        while not (self.overcommitted and self.running) and budget > 0 and self.waiting and \
                self.arrived(self.waiting[0], now):
            r = self.waiting[0]
            left = r.num_tokens - r.num_computed_tokens
            may_chunk = self.enable_chunked_prefill or left > self.max_num_batched_tokens
            n = left if left <= budget else (budget if may_chunk else 0)
            if n == 0 or not self.can_admit(r, n):
                break
            self.admit(r, n, out, now)
            budget -= n
        return budget


def _trace(sched_cls, setup, seed, policy_kw):
    block_size, max_model_len, num_blocks, chunked, budget, max_num_seqs, outs, aborts = setup
    rng = random.Random(seed)
    prompts = shared_prompts(rng, len(outs), min(max_model_len - 1, budget if not chunked else max_model_len))
    classes = [rng.choice(["interactive", "standard", "batch", 5]) for _ in outs]
    specs = [(p, m, ig, a, c) for p, (m, ig, a), c in zip(prompts, outs, classes)]
    sched = sched_cls(max_num_seqs, budget, max_model_len, EOS, num_blocks, block_size,
                      enable_chunked_prefill=chunked, **policy_kw)
    trace = []
    orig = sched.schedule

    def traced():
        out = orig()
        trace.append(([(row.request.request_id, row.num_new_tokens) for row in out.rows],
                      [r.request_id for r in out.preempted]))
        return out

    sched.schedule = traced
    reqs, _ = run_fake(sched, specs, random.Random(seed), aborts)
    return trace, reqs, sched


@settings(FAST, max_examples=80)
@given(setup=caching_setups(), seed=st.integers(0, 2**16))
def test_fcfs_is_step_for_step_the_scheduler_before_priorities(setup, seed):
    new, _, _ = _trace(PagedScheduler, setup, seed, {})
    old, _, _ = _trace(FrozenFCFS, setup, seed, {})
    assert new == old, "the default policy changed: FCFS must stay what it was, whatever the requests' classes"


_RANDOM_WORKLOADS = dict(setup=caching_setups(), seed=st.integers(0, 2**16), caching=st.booleans(),
                        zero_timeouts=st.booleans())


def _priority_run(setup, seed, caching, zero_timeouts):
    """One random workload under the priority policy (the checks are in `_trace`'s run); returns
    how many times the scheduler preempted."""
    timeouts = ({"interactive": 0, "standard": 0, "batch": 0} if zero_timeouts
                else {"interactive": math.inf, "standard": math.inf, "batch": math.inf})
    _, _, sched = _trace(PagedScheduler, setup, seed,
                         dict(scheduling_policy="priority", queue_timeouts=timeouts,
                              enable_prefix_caching=caching))
    return sched.num_preemptions


@settings(FAST, max_examples=80)
@given(**_RANDOM_WORKLOADS)
def test_priority_policy_random_workloads(setup, seed, caching, zero_timeouts):
    """Solo-run outputs, no leak or deadlock, every row reads its own K/V, with classes mixed,
    timeouts that fire at once or never, with and without prefix caching."""
    _priority_run(setup, seed, caching, zero_timeouts)


def test_priority_random_workloads_preempt_often():
    """The workloads above must exercise preemption under priorities. Counted over a fixed draw
    (derandomized), so the threshold is checked on the same examples in every run: counted over
    the random draw it once fell to 49."""
    preempted = [0]

    @settings(FAST, max_examples=80, derandomize=True, database=None)
    @given(**_RANDOM_WORKLOADS)
    def run(setup, seed, caching, zero_timeouts):
        preempted[0] += _priority_run(setup, seed, caching, zero_timeouts)

    run()
    assert preempted[0] >= 50, f"only {preempted[0]} preemptions in 80 workloads: they should preempt often"


# -------------------------------------------------------------- per-class metrics


def test_class_metrics():
    def m(cls, arrival, sched, first):
        return RequestMetrics(arrival, first_scheduled_time=sched, first_token_time=first, token_times=[first],
                              finish_time=first, priority_class=cls)

    ms = [m("interactive", 0.0, 0.01, 0.2), m("interactive", 0.0, 0.08, 0.3), m("batch", 0.0, 2.0, 3.0),
          m("batch", 0.0, 0.5, 0.9), m("batch", 1.0, 1.2, 9.0)]
    c = class_metrics(ms)
    assert list(c) == ["interactive", "batch"], "classes in priority order"
    assert c["interactive"]["timeouts_hit"] == 1 and c["interactive"]["slo_attainment"] == 0.5
    assert c["batch"]["timeouts_hit"] == 1 and c["batch"]["slo_attainment"] == pytest.approx(2 / 3)
    assert c["interactive"]["ttft_s"]["p50"] == pytest.approx(0.25)
    assert c["batch"]["queue_wait_s"]["p50"] == pytest.approx(0.5)
    c = class_metrics(ms, queue_timeouts={"batch": 5.0}, ttft_slo_s={"interactive": 0.25})
    assert c["batch"]["timeouts_hit"] == 0 and c["interactive"]["slo_attainment"] == 0.5


# -------------------------------------------------------------- the real model (fp32, CPU)

from tests.test_prefix_cache import real, real_engine, run_real  # noqa: E402,F401  (real: a fixture)


@pytest.mark.slow
def test_real_model_priority_outputs_equal_fcfs(real):
    """Reordered and preempted by class, with timeouts that fire at once: the same greedy tokens."""
    from tests.prompts import SHORT, long_prompt

    _, tok = real
    prompts = [long_prompt(tok, 40)[:40]] + [tok(p).input_ids for p in SHORT[:4]]
    classes = ["batch", "batch", "interactive", "standard", "interactive"]
    delays = [0.0, 0.0, 0.3, 0.0, 0.6]  # the interactive requests arrive while batch jobs run

    def params(c):
        return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, priority=c)

    def go(**kw):
        engine = real_engine(real, max_model_len=64, num_blocks=9, max_num_seqs=2, **kw)
        # A clock that moves 0.1 s per forward pass, not with the wall: the arrivals land 3 and 6
        # steps in on any machine (on the wall clock a fast CPU had finished the batch jobs first).
        from minillm.clock import VirtualClock

        clock, execute = VirtualClock(), engine.runner.execute

        def execute_and_tick(out):
            clock.advance(0.1)
            return execute(out)

        engine.clock, engine.scheduler.clock, engine.runner.execute = clock, clock.now, execute_and_tick
        t0 = engine.clock.now()
        outs = [o.token_ids for o in engine.run([engine.make_request(p, params(c), arrival_time=t0 + d)
                                                 for p, c, d in zip(prompts, classes, delays)])]
        bm = engine.scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and not bm.tables
        return outs, engine

    ref, _ = go()
    zero = {"interactive": 0, "standard": 0, "batch": 0}
    got, engine = go(scheduling_policy="priority", queue_timeouts=zero)
    assert got == ref, "the priority policy changed a greedy token"
    assert engine.scheduler.num_preemptions > 0, "sized to preempt"
    got_cached, engine = go(scheduling_policy="priority", queue_timeouts=zero, enable_prefix_caching=True)
    assert got_cached == ref, "priority + prefix caching changed a greedy token"
