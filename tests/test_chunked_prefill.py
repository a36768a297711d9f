"""Chunked prefill in the paged engine: the token budget, decodes first, one forward.

Two policies share ``PagedScheduler`` (``enable_chunked_prefill``):

* on: every running decode gets its token, then prefill chunks fill what is left of
  ``max_num_batched_tokens``; a long prompt spans several steps;
* off: a step is all-prefill or all-decode (the early design).

Fast tests drive the scheduler with the fake model of test_block_manager.py (its
"next token" is read back through the block table, so a chunk that writes to the wrong
slot changes the output) and check, step by step: the budget, decodes first, every
prompt fed exactly once and in order, one row per request. Slow tests run the real
model: greedy outputs are the same with chunking on (budgets 16, 64, 512) and off.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minillm.block_manager import blocks_needed, min_num_blocks
from minillm.config import EngineConfig
from minillm.request import FinishReason, Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import PagedScheduler
from tests.test_block_manager import EOS, FAST, VOCAB, FakeEngine, solo_run


def _params(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


class Recorder:
    """A FakeEngine that also checks the chunked-prefill contract of every step."""

    def __init__(self, sched: PagedScheduler, ample_blocks: bool):
        self.sched = sched
        self.engine = FakeEngine(sched)
        self.ample = ample_blocks  # no preemption possible: stronger checks apply
        self.fed: dict[str, list[int]] = {}  # positions fed since the last (re)start
        self.kinds: list[str] = []  # per step: "decode", "prefill" or "mixed"
        self.decode_stalls = 0

    def step(self):
        s = self.sched
        budget = s.max_num_batched_tokens
        now = self.engine.now
        running = list(s.running)
        decoding = {r for r in running if not r.is_prefill}
        remaining = {r: r.num_tokens - r.num_computed_tokens for r in [*running, *s.waiting]}
        head = s.waiting[0] if s.waiting else None
        head_ready = (head is not None and head.arrival_time <= now and len(running) < s.max_num_seqs
                      and remaining[head] <= budget)

        out = self.engine.step()  # budget, one row per request, K/V read back: FakeEngine asserts them

        rows = [(row.request, row.num_new_tokens) for row in out.rows]
        assert out.num_tokens <= budget, "token budget exceeded"
        for r in out.preempted:
            self.fed[r.request_id] = []
        for r, n in rows:
            start = r.num_computed_tokens - n  # update() has advanced the counter
            fed = self.fed.setdefault(r.request_id, [])
            assert start == len(fed), (
                f"request {r.request_id} fed positions {start}..{start + n - 1} after {len(fed)}: "
                "a prompt is fed once, in order, chunk after chunk")
            fed.extend(range(start, start + n))
            if r in decoding:
                assert n == 1, f"a decoding request feeds exactly one token, {r.request_id} fed {n}"
        dec_rows = [r for r, _ in rows if r in decoding]
        pre_rows = [r for r, _ in rows if r not in decoding]
        self.kinds.append("mixed" if dec_rows and pre_rows else "decode" if dec_rows else "prefill")
        stalled = [r for r in decoding if r not in dec_rows]
        self.decode_stalls += bool(stalled)

        if s.enable_chunked_prefill:
            # Decodes first: only a preemption can keep a decoding request from its token.
            assert all(r in out.preempted for r in stalled), (
                f"chunked prefill: decoding requests {[r.request_id for r in stalled]} got no token")
            if self.ample and any(n < remaining[r] for r, n in rows):
                assert out.num_tokens == budget, "a prompt was cut although budget was left"
        else:
            assert not (dec_rows and pre_rows), "chunking off: a step is all-prefill or all-decode"
            for r, n in rows:
                if r not in decoding and r.metrics.num_preemptions == 0:
                    assert n == remaining[r], "chunking off: a prompt is prefilled whole"
            if self.ample and head_ready:
                assert pre_rows, "chunking off: a prompt could start, so the step must be a prefill step"
        return out


@st.composite
def setups(draw):
    chunked = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 64))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 2 * max_model_len))  # >= max_num_seqs: EngineConfig enforces it
    # (prompt length, max_tokens, arrival step)
    specs = draw(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 24), st.integers(0, 8)),
                          min_size=1, max_size=10))
    ample = draw(st.booleans())
    need = min_num_blocks(max_model_len, block_size)
    if ample:  # every request at full length at once: no preemption can happen
        num_blocks = max(need, len(specs) * need)
    else:
        num_blocks = need + draw(st.integers(0, 2))
    return chunked, block_size, max_model_len, max_num_seqs, budget, specs, ample, num_blocks


@settings(FAST, max_examples=200)
@given(setup=setups(), seed=st.integers(0, 2**16))
def test_budget_order_and_outputs_on_random_workloads(setup, seed):
    chunked, block_size, max_model_len, max_num_seqs, budget, specs, ample, num_blocks = setup
    rng = random.Random(seed)
    sched = PagedScheduler(max_num_seqs, budget, max_model_len, EOS, num_blocks, block_size,
                           enable_chunked_prefill=chunked)
    rec = Recorder(sched, ample)
    requests = []
    for i, (plen, max_tokens, arrival) in sorted(enumerate(specs), key=lambda x: x[1][2]):
        plen = min(plen, max_model_len - 1, plen if chunked else budget)  # what add-time checks allow
        prompt = [rng.randrange(1, VOCAB) for _ in range(plen)]
        r = Request(str(i), prompt, _params(max_tokens, ignore_eos=bool(i % 2)), arrival_time=float(arrival))
        sched.add(r)
        requests.append(r)
    limit = 50 + sum(r.max_total_tokens for r in requests) * (len(requests) + 1) * 4
    while sched.has_unfinished():
        rec.step()
        assert rec.engine.steps < limit, "no progress"
    assert sched.block_manager.num_free_blocks == num_blocks and not sched.block_manager.tables
    for r in requests:
        ref, reason = solo_run(r.prompt_token_ids, r.sampling_params, max_model_len)
        assert (r.output_token_ids, r.finish_reason) == (ref, reason), f"request {r.request_id} differs from solo"
        # Every position but the last sampled token was fed exactly once, in order, since the last restart.
        assert rec.fed[r.request_id] == list(range(r.num_tokens - 1))
    if ample:
        assert sched.num_preemptions == 0
        if chunked:
            assert rec.decode_stalls == 0
        else:
            assert "mixed" not in rec.kinds


# ------------------------------------------------------------------ the policy, step by step


def _decoding_then_long_prompt(chunked: bool, budget: int, block_size: int = 4):
    """Three requests decoding, then a 30-token prompt arrives: (scheduler, driver, long request)."""
    sched = PagedScheduler(4, budget, 64, EOS, num_blocks=64, block_size=block_size,
                           enable_chunked_prefill=chunked)
    rec = Recorder(sched, ample_blocks=True)
    short = [Request(f"s{i}", [3 + i] * 5, _params(20), arrival_time=0.0) for i in range(3)]
    long = Request("long", [9] * 30, _params(4), arrival_time=1.0)
    for r in (*short, long):
        sched.add(r)
    rec.step()  # t=0: the three short prompts, whole
    assert [len(r.output_token_ids) for r in short] == [1, 1, 1]
    return sched, rec, long


def test_chunked_decodes_first_then_chunks_that_end_mid_block():
    sched, rec, long = _decoding_then_long_prompt(chunked=True, budget=16)
    plans = []
    while long.num_output_tokens == 0:
        out = rec.step()
        plans.append([(row.request.request_id, row.num_new_tokens) for row in out.rows])
    decodes = [("s0", 1), ("s1", 1), ("s2", 1)]
    # 16 tokens a step: 3 decodes, then 13 of the 30-token prompt; 13 + 13 + 4 = 30.
    assert plans == [decodes + [("long", 13)], decodes + [("long", 13)], decodes + [("long", 4)]]
    assert 13 % 4 != 0, "the first chunk ends in the middle of a block of 4"
    assert rec.decode_stalls == 0 and rec.kinds[1:] == ["mixed"] * 3
    while sched.has_unfinished():
        rec.step()
    assert long.output_token_ids == solo_run(long.prompt_token_ids, long.sampling_params, 64)[0]


def test_chunked_short_prompt_goes_whole_with_the_decodes():
    sched = PagedScheduler(4, 16, 64, EOS, num_blocks=64, block_size=4, enable_chunked_prefill=True)
    rec = Recorder(sched, ample_blocks=True)
    a = Request("a", [5] * 6, _params(8), arrival_time=0.0)
    b = Request("b", [6] * 7, _params(8), arrival_time=1.0)
    sched.add(a)
    sched.add(b)
    rec.step()
    out = rec.step()
    assert [(row.request.request_id, row.num_new_tokens) for row in out.rows] == [("a", 1), ("b", 7)]


def test_unchunked_step_is_all_prefill_then_all_decode():
    sched, rec, long = _decoding_then_long_prompt(chunked=False, budget=64)
    out = rec.step()  # the long prompt has arrived: a prefill-only step, the decodes stall
    assert [(row.request.request_id, row.num_new_tokens) for row in out.rows] == [("long", 30)]
    out = rec.step()
    assert [(row.request.request_id, row.num_new_tokens) for row in out.rows] == [
        ("s0", 1), ("s1", 1), ("s2", 1), ("long", 1)]
    assert rec.decode_stalls == 1 and rec.kinds[1:] == ["prefill", "decode"]


def test_recompute_longer_than_the_budget_is_chunked_even_when_chunking_is_off():
    # The prompts fit the budget of 9; prompt + outputs do not, after a preemption.
    sched = PagedScheduler(2, 9, 32, EOS, num_blocks=8, block_size=4)
    rec = Recorder(sched, ample_blocks=False)
    a = Request("a", [3] * 8, _params(12), arrival_time=0.0)
    b = Request("b", [4] * 8, _params(12), arrival_time=0.0)
    sched.add(a)
    sched.add(b)
    while sched.has_unfinished():
        rec.step()
    assert b.metrics.num_preemptions >= 1
    assert "mixed" not in rec.kinds
    for r in (a, b):
        assert r.output_token_ids == solo_run(r.prompt_token_ids, r.sampling_params, 32)[0]


def test_budget_equal_to_max_num_seqs_still_decodes_everyone():
    sched = PagedScheduler(3, 3, 64, EOS, num_blocks=64, block_size=4, enable_chunked_prefill=True)
    rec = Recorder(sched, ample_blocks=True)
    reqs = [Request(str(i), [7 + i] * (2 + 5 * i), _params(6), arrival_time=0.0) for i in range(3)]
    for r in reqs:
        sched.add(r)
    while sched.has_unfinished():
        out = rec.step()
        assert out.num_tokens <= 3
    assert rec.decode_stalls == 0
    for r in reqs:
        assert r.output_token_ids == solo_run(r.prompt_token_ids, r.sampling_params, 64)[0]


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1"),
    (dict(max_num_batched_tokens=-5), "max_num_batched_tokens must be an integer >= 1"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "decodes alone would not fit"),
    (dict(max_num_batched_tokens=7, max_num_seqs=8), "at least 8"),
])
@pytest.mark.parametrize("engine", ["paged", "continuous", "static"])
def test_budget_too_small_is_rejected_with_the_reason(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(engine=engine, **kwargs)
    if engine == "paged":
        with pytest.raises(ValueError, match=message):
            EngineConfig(engine=engine, enable_chunked_prefill=True, **kwargs)


@pytest.mark.parametrize("engine", ["simple", "static", "continuous"])
def test_chunked_prefill_is_a_paged_engine_option(engine):
    with pytest.raises(ValueError, match="engine='paged'"):
        EngineConfig(engine=engine, enable_chunked_prefill=True)


def test_budget_checks_use_the_engines_batch_size():
    EngineConfig(engine="paged", max_num_seqs=8, max_num_batched_tokens=8, enable_chunked_prefill=True)
    EngineConfig(engine="simple", max_num_batched_tokens=4)  # the simple engine runs one request at a time
    from minillm import LLM

    with pytest.raises(ValueError, match="smaller than max_num_seqs=4"):
        LLM(engine="paged", enable_chunked_prefill=True, max_num_seqs=4, max_num_batched_tokens=2)


# ------------------------------------------------------------------ the real model


def _stall_steps(engine, requests) -> int:
    """Steps in which a request that had its first token, and was not finished, got no token."""
    count = 0
    for s in engine.step_records:
        for r in requests:
            m = r.metrics
            if (m.first_token_time is not None and m.first_token_time <= s.start < m.finish_time
                    and s.end not in m.token_times):
                count += 1
                break
    return count


@pytest.fixture(scope="module")
def model_files():
    from minillm import loader

    return loader.load_weights(None), loader.load_tokenizer(None)


def _run_staggered(model_files, **kwargs):
    """Three short prompts decode; after two steps a ~100-token prompt arrives; then one more."""
    from minillm.engine import build_engine
    from tests.prompts import SHORT, long_prompt

    weights, tok = model_files
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
                block_size=16) | kwargs
    engine = build_engine(EngineConfig(**opts), weights=weights, tokenizer=tok)
    params = _params(16)
    reqs = [engine.add_request(p, params) for p in SHORT[:3]]
    for _ in range(2):
        engine.step()
    reqs.append(engine.add_request(long_prompt(tok, 100)[:100], params))
    engine.step()
    reqs.append(engine.add_request(SHORT[3], params))
    while engine.has_unfinished():
        engine.step()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables
    return engine, reqs


@pytest.fixture(scope="module")
def unchunked(model_files):
    return _run_staggered(model_files)


@pytest.mark.slow
def test_unchunked_real_model_stalls_the_decodes(unchunked):
    engine, reqs = unchunked
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert _stall_steps(engine, reqs) > 0, "the long prompt's prefill step should stall the running requests"
    for s in engine.step_records:  # every prompt here has several tokens: a row of 1 is a decode
        assert len({n == 1 for n in s.num_new_tokens}) == 1, "chunking off: a step is all-prefill or all-decode"


@pytest.mark.slow
@pytest.mark.parametrize("budget", [16, 64, 512])
def test_chunked_real_model_equals_unchunked(model_files, unchunked, budget):
    ref_engine, ref = unchunked
    engine, reqs = _run_staggered(model_files, enable_chunked_prefill=True, max_num_batched_tokens=budget)
    for i, (got, want) in enumerate(zip(reqs, ref)):
        assert got.output_token_ids == want.output_token_ids, (
            f"request {i}: greedy output with chunked prefill (budget {budget}) differs from chunking off")
    steps = engine.step_records
    assert max(s.num_tokens for s in steps) <= budget, "token budget exceeded"
    assert _stall_steps(engine, reqs) == 0, "with chunked prefill no decoding request may wait for a prompt"
    if budget < 100:  # the long prompt spans several steps, each shared with the decodes
        mixed = [s for s in steps if len(s.num_new_tokens) > 1 and max(s.num_new_tokens) > 1
                 and min(s.num_new_tokens) == 1]
        assert len(mixed) >= 100 // budget, "prefill chunks and decodes should share forwards"


# ------------------------------------------------------------------ metrics, workload, bench


def _step(k: int, end: float, new: list[int]):
    from minillm.metrics import StepRecord

    return StepRecord(k, end - 1.0, end, [str(i) for i in range(len(new))], new, len(new), len(new), 0)


def test_decode_stall_steps_and_summary_fields():
    from minillm.bench.summary import RunResult, decode_stall_steps, summarize
    from minillm.request import RequestMetrics

    steps = [_step(k, float(k + 1), n) for k, n in enumerate([[5, 4], [1, 1], [30], [1, 1, 1], [1, 1, 1]])]
    a = RequestMetrics(arrival_time=0.0, first_token_time=1.0, token_times=[1.0, 2.0, 4.0, 5.0], finish_time=5.0)
    b = RequestMetrics(arrival_time=0.0, first_token_time=1.0, token_times=[1.0, 2.0, 4.0], finish_time=4.0)
    c = RequestMetrics(arrival_time=2.0, first_token_time=3.0, token_times=[3.0, 4.0, 5.0], finish_time=5.0)
    assert decode_stall_steps(steps, [a, b, c]) == 1, "only step 2 (ending at 3.0) left a decoding request waiting"
    assert decode_stall_steps(steps, [c]) == 0, "the prefill of a request is not a stall of that request"
    res = RunResult("paged", [a, b, c], [[1] * 4, [1] * 3, [1] * 3], steps, 0.0, 5.0, 4, 0, [5, 4, 30])
    s = summarize(res)
    assert s["decode_stall_steps"] == 1 and s["max_step_tokens"] == 30
    assert s["itl_s"]["max"] == 2.0 and set(s["itl_s"]) == {"p50", "p95", "p99", "max"}


def test_long_prompt_arrival_workload():
    from minillm.bench.workload import make_workload

    w = make_workload("long-prompt-arrival", 8, seed=0)
    assert w == make_workload("long-prompt-arrival", 8, seed=0), "same name and seed, same requests"
    short, long = w.requests[:5], w.requests[5:]
    assert all(r.arrival_time == 0.0 and len(r.prompt_token_ids) < 64 and r.max_tokens > 80 for r in short)
    assert [r.arrival_time for r in long] == [1.0, 4.0, 7.0], "long prompts arrive after the others started"
    assert all(len(r.prompt_token_ids) > 1400 for r in long)
    assert w.arrival == "scripted" and "scripted" in w.describe()
    w = make_workload("long-prompt-arrival", 3, num_long=1, long_prompt=300, first_arrival_s=0.5,
                      arrival_gap_s=0.0)
    assert [r.arrival_time for r in w] == [0.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="num_long"):
        make_workload("long-prompt-arrival", 3, num_long=3)
    with pytest.raises(ValueError, match="own arrival times"):
        make_workload("long-prompt-arrival", 8, arrival="poisson", rate=2.0)


@pytest.mark.parametrize("argv, needle", [
    (["--engine", "continuous", "--enable-chunked-prefill"], "--engine paged"),
    (["--engine", "paged", "--max-num-batched-tokens", "4"], "smaller than max_num_seqs=8"),
    (["--engine", "paged", "--max-num-batched-tokens", "0"], "at least one token"),
])
def test_bench_bad_chunked_settings(argv, needle, capsys):
    from minillm.bench import compare

    with pytest.raises(SystemExit) as e:
        compare.main(["--workload", "long-prompt-arrival", "--num-requests", "4", "--dummy-weights", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.slow
def test_bench_cli_chunked_prefill_json(tmp_path):
    # Dummy weights (no tokenizer): a few tiny requests, just to check the flags and the JSON.
    import json

    from minillm.bench import compare

    common = ["--engine", "paged", "--workload", "long-prompt-arrival", "--num-requests", "3", "--dummy-weights",
              "--no-progress", "--max-num-seqs", "4", "--workload-param", "long_prompt=120",
              "--workload-param", "short_output=12", "--workload-param", "num_long=1",
              "--workload-param", "first_arrival_s=0.2"]
    with pytest.raises(SystemExit):  # the 120-token prompt does not fit a budget of 32 without chunking
        compare.main(common + ["--max-num-batched-tokens", "32"])
    path = tmp_path / "on.json"
    assert compare.main(common + ["--enable-chunked-prefill", "--max-num-batched-tokens", "32",
                                "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert s["enable_chunked_prefill"] is True and s["max_num_batched_tokens"] == 32
    assert s["max_step_tokens"] <= 32 and s["decode_stall_steps"] == 0
    assert s["itl_s"]["max"] >= s["itl_s"]["p99"] > 0
