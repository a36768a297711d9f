"""The block allocator, the block manager and the paged scheduler, without a model.

Property tests (hypothesis) drive them with random operation sequences and check the
invariants that make paging safe: no block leaked or freed twice, reference counts
equal to the block tables, every request finishes, at most ``max_num_seqs`` running,
the token budget respected. The paged scheduler runs against a fake model whose
"next token" is a function of the tokens it reads back *through the block table*: a
block shared by mistake, freed too early or mapped wrong changes the output, so
comparing with a solo run of the same function checks the KV bookkeeping end to end.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from minillm.block_manager import (BlockAllocator, BlockManager, NoFreeBlocksError, blocks_needed,
                                   min_num_blocks, num_blocks_from_budget, slots_for)
from minillm.request import FinishReason, Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import PagedScheduler

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -------------------------------------------------------------- allocator


def test_allocator_basics():
    a = BlockAllocator(4)
    x = a.allocate(3)
    assert sorted(x) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(NoFreeBlocksError):
        a.allocate(2)
    assert a.num_free == 1, "a failed allocation must take nothing (all or nothing)"
    shared = a.fork([x[0]])
    assert a.ref_counts[x[0]] == 2
    a.free(x[0])
    assert a.num_free == 1, "a shared block stays allocated while a holder remains"
    a.free(shared[0])
    assert a.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(x[0])
    with pytest.raises(ValueError, match="free"):
        a.incref(3)
    with pytest.raises(ValueError, match="block id"):
        a.free(7)
    a.check_invariants()


def test_allocator_reuses_freed_blocks_last():
    a = BlockAllocator(3)
    b = a.allocate(1)[0]
    a.free(b)
    assert a.allocate(2) == [1, 2], "a just-freed block goes to the back of the free list"


def test_allocator_long_random_sequence():
    """10,000 random allocate / incref / free operations against a plain-dict model."""
    rng = random.Random(0)
    a = BlockAllocator(32)
    held: list[int] = []  # one entry per reference: a block appears once per holder
    for _ in range(10_000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(1, 4)
            if a.can_allocate(n):
                held += a.allocate(n)
            else:
                with pytest.raises(NoFreeBlocksError):
                    a.allocate(n)
        elif op < 0.55 and held:
            b = rng.choice(held)
            a.incref(b)
            held.append(b)
        elif held:
            b = held.pop(rng.randrange(len(held)))
            a.free(b)
        else:
            with pytest.raises(ValueError):
                a.free(rng.randrange(32))  # nothing is held: every free is a double free
        counts = [0] * 32
        for b in held:
            counts[b] += 1
        assert a.ref_counts == counts
        assert a.num_free == counts.count(0)
    a.check_invariants()
    for b in list(held):
        a.free(b)
    assert a.num_free == 32


def test_blocks_needed_and_slots():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    table = [7, 2, 5]
    assert slots_for(table, 4, 2, 10) == [30, 31, 8, 9, 10, 11, 20, 21]


def test_num_blocks_from_budget():
    common = dict(block_size=16, max_model_len=256, max_num_seqs=8, kv_bytes_per_token=100)
    assert num_blocks_from_budget(**common) == 8 * 256 // 16, "default: the contiguous engine's bytes"
    assert num_blocks_from_budget(**common, num_blocks=20) == 20
    assert num_blocks_from_budget(**common, kv_cache_bytes=16 * 100 * 17 + 99) == 17
    with pytest.raises(ValueError, match="at least 16 blocks"):
        num_blocks_from_budget(**common, num_blocks=15)
    with pytest.raises(ValueError, match="at least 16 blocks"):
        num_blocks_from_budget(**common, kv_cache_bytes=16 * 100 * 15)
    with pytest.raises(ValueError, match="not both"):
        num_blocks_from_budget(**common, num_blocks=20, kv_cache_bytes=10**6)
    assert min_num_blocks(257, 16) == 17


# -------------------------------------------------------------- block manager (stateful)


class _Seq:
    """What the block manager needs of a request: a block table."""

    def __init__(self, name: str):
        self.request_id = name
        self.block_ids: list[int] = []


class BlockManagerMachine(RuleBasedStateMachine):
    """Random grow / free / re-grow of sequences; the manager must agree with a model."""

    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=24, block_size=4, watermark=0.1)
        self.tokens: dict[_Seq, int] = {}  # tokens each live sequence covers
        self.count = 0

    @rule(target=seqs, n=st.integers(1, 40))
    def new_seq(self, n):
        s = _Seq(f"s{self.count}")
        self.count += 1
        if self.bm.can_grow(s, n, admit=True):
            self.bm.grow(s, n)
            self.tokens[s] = n
        else:
            assert self.bm.blocks_to_grow(s, n) + (self.bm.watermark_blocks if self.bm.tables else 0) \
                > self.bm.num_free_blocks
        return s

    @rule(s=seqs, k=st.integers(1, 9))
    def append(self, s, k):
        if s not in self.tokens:
            return
        n = self.tokens[s] + k
        if self.bm.can_grow(s, n):
            new = self.bm.grow(s, n)
            assert len(new) == blocks_needed(n, 4) - blocks_needed(self.tokens[s], 4)
            self.tokens[s] = n
        else:
            free = self.bm.num_free_blocks
            with pytest.raises(NoFreeBlocksError):
                self.bm.grow(s, n)
            assert self.bm.num_free_blocks == free and len(s.block_ids) == blocks_needed(self.tokens[s], 4)

    @rule(s=consumes(seqs))
    def free(self, s):
        if s in self.tokens:
            self.bm.free(s)
            del self.tokens[s]
            assert s.block_ids == []
        with pytest.raises(ValueError, match="freed twice"):
            self.bm.free(s)

    @precondition(lambda self: self.tokens)
    @rule()
    def preempt_newest(self):
        s = max(self.tokens, key=lambda q: int(q.request_id[1:]))
        self.bm.free(s)
        del self.tokens[s]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        used = sum(len(s.block_ids) for s in self.tokens)
        assert used + self.bm.num_free_blocks == self.bm.num_blocks, "a block leaked"
        for s, n in self.tokens.items():
            assert len(s.block_ids) == blocks_needed(n, 4)
        assert set(self.bm.tables) == set(self.tokens)

    def teardown(self):
        for s in list(self.tokens):
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(FAST, max_examples=60, stateful_step_count=60)
TestBlockManager = BlockManagerMachine.TestCase


# -------------------------------------------------------------- paged scheduler + fake model

VOCAB = 40
EOS = 0


def fake_next_token(tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on every token and its position."""
    h = len(tokens)
    for i, t in enumerate(tokens):
        h = (h * 1_000_003 + (i + 1) * (t + 7)) % 2_147_483_647
    return h % VOCAB


def solo_run(prompt: list[int], params: SamplingParams, max_model_len: int) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    while True:
        out.append(fake_next_token(prompt + out))
        if not params.ignore_eos and out[-1] == EOS:
            return out, FinishReason.STOP
        if len(out) >= params.max_tokens or len(prompt) + len(out) >= max_model_len:
            return out, FinishReason.LENGTH


class FakeEngine:
    """Drives a PagedScheduler with a simulated KV cache: slot -> (request, position, token)."""

    def __init__(self, sched: PagedScheduler):
        self.sched = sched
        self.now = 0.0
        sched.clock = lambda: self.now
        self.cache: dict[int, tuple[str, int, int]] = {}
        self.steps = 0
        self.ops = 0  # block-level operations seen (grow, free, preempt), for the size of the test
        self.log: list[tuple[str, int, int]] = []  # (request id, tokens fed, tokens it had to feed)

    def step(self):
        s, bm = self.sched, self.sched.block_manager
        running_before = list(s.running)
        free_before = bm.num_free_blocks
        out = s.schedule()
        self.steps += 1
        self.ops += len(out.rows) + len(out.preempted) + abs(free_before - bm.num_free_blocks)
        # -- scheduler invariants
        assert len(s.running) <= s.max_num_seqs
        assert out.num_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert all(row.num_new_tokens >= 1 for row in out.rows)
        assert len({id(row.request) for row in out.rows}) == len(out.rows), "a request scheduled twice"
        # Whatever the policy (decodes first, or a prefill-only step: test_chunked_prefill.py),
        # the running requests that get a row keep their order and come before admissions.
        kept = [r for r in running_before if r.status is RequestStatus.RUNNING]
        ran = [row.request for row in out.rows if row.request in kept]
        assert [row.request for row in out.rows[:len(ran)]] == ran == [r for r in kept if r in ran], \
            "running requests come first, oldest first"
        for victim in out.preempted:
            assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert not victim.block_ids and victim in s.waiting
        arrived = s.waiting and s.waiting[0].arrival_time <= self.now
        if s.running or arrived:
            assert out.rows, "stall: work is ready but nothing was scheduled"
        bm.check_invariants()
        held = [b for r in s.running for b in r.block_ids]
        assert len(held) == len(set(held)), "two running requests share a block"
        assert len(held) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
        assert all(not r.block_ids for r in s.waiting), "a waiting request holds blocks"
        # -- the fake forward: write this step's K/V, then read every row's context back
        for row in out.rows:
            r, n = row.request, row.num_new_tokens
            self.log.append((r.request_id, n, r.num_tokens - r.num_computed_tokens))
            assert len(r.block_ids) * bm.block_size >= r.num_computed_tokens + n, "blocks do not cover the step"
            toks = r.all_token_ids
            for p, slot in zip(range(r.num_computed_tokens, r.num_computed_tokens + n),
                               bm.slot_mapping(r, r.num_computed_tokens, r.num_computed_tokens + n)):
                self.cache[slot] = (r.request_id, p, toks[p])
        sampled = {}
        for i, row in enumerate(out.rows):
            r = row.request
            end = r.num_computed_tokens + row.num_new_tokens
            seen = [self.cache.get(slot) for slot in slots_for(r.block_ids, bm.block_size, 0, end)]
            expect = [(r.request_id, p, t) for p, t in enumerate(r.all_token_ids[:end])]
            assert seen == expect, f"request {r.request_id} reads K/V that is not its own"
            if row.samples:
                sampled[i] = [fake_next_token([t for _, _, t in seen])]
        finished = s.update(out, sampled, now=self.now)
        for r in finished:
            assert not r.block_ids and not bm.holds(r)
        self.now += 1.0
        return out


request_specs = st.lists(
    # (prompt length, max_tokens, ignore_eos, arrival step)
    st.tuples(st.integers(1, 40), st.integers(1, 40), st.booleans(), st.integers(0, 6)),
    min_size=2, max_size=12)


@st.composite
def paged_setups(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    max_model_len = draw(st.integers(8, 48))
    need = min_num_blocks(max_model_len, block_size)
    num_blocks = need + draw(st.integers(0, need) | st.integers(0, 2))  # often tight: preemptions
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_model_len // 2, 2 * max_model_len))
    max_num_seqs = draw(st.integers(1, 8))
    watermark = draw(st.sampled_from([0.0, 0.0, 0.2]))
    specs = draw(request_specs)
    aborts = draw(st.lists(st.tuples(st.integers(0, len(specs) - 1), st.integers(0, 40)), max_size=2))
    return block_size, max_model_len, num_blocks, chunked, budget, max_num_seqs, watermark, specs, aborts


_TOTAL_OPS = [0]


@settings(FAST, max_examples=150)
@given(setup=paged_setups(), seed=st.integers(0, 2**16))
def test_paged_scheduler_random_workloads(setup, seed):
    block_size, max_model_len, num_blocks, chunked, budget, max_num_seqs, watermark, specs, aborts = setup
    rng = random.Random(seed)
    sched = PagedScheduler(max_num_seqs, budget, max_model_len, EOS, num_blocks, block_size,
                           watermark=watermark, enable_chunked_prefill=chunked)
    engine = FakeEngine(sched)
    requests = []
    for i, (plen, max_tokens, ignore_eos, arrival) in sorted(enumerate(specs), key=lambda x: x[1][3]):
        plen = min(plen, max_model_len - 1, budget if not chunked else plen)  # what add-time checks allow
        sched.check_fits(plen)
        prompt = [rng.randrange(1, VOCAB) for _ in range(plen)]
        r = Request(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos),
                    arrival_time=float(arrival))
        sched.add(r)
        requests.append(r)
    abort_at = {step: requests[j] for j, step in aborts}
    limit = 20 + sum(r.max_total_tokens for r in requests) * (len(requests) + 1) * 4
    while sched.has_unfinished():
        if engine.steps in abort_at:
            sched.abort(abort_at.pop(engine.steps))
        engine.step()
        assert engine.steps < limit, "no progress: the scheduler is stuck (deadlock or livelock)"
    assert sched.block_manager.num_free_blocks == num_blocks, "blocks leaked after every request finished"
    assert not sched.block_manager.tables
    sched.block_manager.check_invariants()
    assert sched.num_preemptions == sum(r.metrics.num_preemptions for r in requests)
    for r in requests:
        assert r.is_finished
        if r.finish_reason is FinishReason.ABORT:
            continue
        ref, reason = solo_run(r.prompt_token_ids, r.sampling_params, max_model_len)
        assert (r.output_token_ids, r.finish_reason) == (ref, reason), (
            f"request {r.request_id} (preempted {r.metrics.num_preemptions}x) differs from its solo run")
    _TOTAL_OPS[0] += engine.ops


def test_paged_scheduler_preempts_newest_and_resumes_first():
    # 4 blocks of 4 tokens: two 7-token prompts fit (2 blocks each) until both cross into a
    # third block; then the newer one is preempted and goes back to the head of the queue.
    sched = PagedScheduler(4, 64, 16, EOS, num_blocks=4, block_size=4)
    engine = FakeEngine(sched)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b, c = (Request(x, [5] * 7, params, arrival_time=0.0) for x in "abc")
    for r in (a, b, c):
        sched.add(r)
    engine.step()
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    engine.step()
    out = engine.step()  # a and b hold 8 tokens each: a's next token needs a third block
    assert out.preempted == [b] and b.status is RequestStatus.PREEMPTED
    assert list(sched.waiting) == [b, c], "a preempted request goes back to the FRONT of waiting"
    assert b.num_computed_tokens == 0 and b.num_output_tokens == 2, "outputs are kept for the recompute"
    assert [row.request for row in out.rows] == [a], "no admission in a step that had to preempt"
    assert sched.num_preemptions == 1 == b.metrics.num_preemptions
    while sched.has_unfinished():
        engine.step()
    for r in (a, b, c):
        assert r.output_token_ids == solo_run(r.prompt_token_ids, params, 16)[0]
    assert sched.block_manager.num_free_blocks == 4


def test_paged_scheduler_chunks_a_recompute_longer_than_the_budget():
    # The prompts fit the budget of 9, but prompt + outputs do not: the recompute is chunked.
    sched = PagedScheduler(2, 9, 32, EOS, num_blocks=8, block_size=4)
    engine = FakeEngine(sched)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = Request("a", [3] * 8, params, arrival_time=0.0)
    b = Request("b", [4] * 8, params, arrival_time=0.0)
    sched.add(a)
    sched.add(b)
    while sched.has_unfinished():
        engine.step()
    assert b.metrics.num_preemptions >= 1
    chunks = [(n, todo) for rid, n, todo in engine.log if rid == "b" and n < todo]
    assert chunks, "the recompute of b should have been split into budget-sized chunks"
    for r in (a, b):
        assert r.output_token_ids == solo_run(r.prompt_token_ids, params, 32)[0]


def test_paged_scheduler_abort_frees_blocks():
    sched = PagedScheduler(3, 64, 32, EOS, num_blocks=16, block_size=4)
    engine = FakeEngine(sched)
    reqs = [Request(str(i), [1 + i] * (5 + i), SamplingParams(temperature=0, max_tokens=20), arrival_time=0.0)
            for i in range(5)]
    for r in reqs:
        sched.add(r)
    engine.step()
    engine.step()
    assert sched.block_manager.num_free_blocks < 16
    for r in reqs:
        sched.abort(r)
    assert all(r.finish_reason is FinishReason.ABORT for r in reqs)
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()
    sched.block_manager.check_invariants()


def test_paged_scheduler_bad_sizes():
    with pytest.raises(ValueError, match="at least 8 blocks"):
        PagedScheduler(2, 64, 64, EOS, num_blocks=7, block_size=8)
    sched = PagedScheduler(2, 64, 64, EOS, num_blocks=8, block_size=8)
    sched.check_fits(63)
    with pytest.raises(ValueError, match="needs 9 blocks"):
        sched.check_fits(64)


def test_random_workloads_covered_enough_operations():
    """The property test above must have exercised >= 10,000 block-level operations."""
    if _TOTAL_OPS[0] == 0:
        pytest.skip("run together with test_paged_scheduler_random_workloads")
    assert _TOTAL_OPS[0] >= 10_000, f"only {_TOTAL_OPS[0]} operations: raise max_examples"
