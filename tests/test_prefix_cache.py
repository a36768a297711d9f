"""Prefix caching: hash-chained full blocks, shared on admission, kept while free, evicted LRU.

Three layers of checks:

* the hash chain and the allocator's evictable pool, by hand;
* a hypothesis state machine driving ``BlockManager`` with caching through random
  allocate / append / free / preempt / rollback operations (evictions happen when an
  allocation needs blocks) on a simulated KV cache: no block leaked or freed twice, no
  cached block evicted while held, every hit's stored tokens equal to the prompt's;
* the paged scheduler with caching against a fake model that reads its context back
  through the block tables, and then the real model: greedy outputs token-identical
  with caching on and off, with preemption, chunked prefill and speculative decoding.
"""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.block_manager import (ROOT_HASH, BlockAllocator, BlockManager, block_hashes, blocks_needed,
                                   hash_block_tokens, longest_cached_prefix, lru_victim, slots_for)
from minillm.config import EngineConfig
from minillm.request import FinishReason, Request, RequestStatus
from minillm.sampling_params import SamplingParams
from minillm.scheduler import PagedScheduler

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -------------------------------------------------------------- the hash chain


def test_hash_chain_names_prefixes_not_blocks():
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    b = [1, 2, 3, 4, 5, 6, 0, 8, 9]
    c = [9, 9, 3, 4, 5, 6, 7, 8]
    ha, hb, hc = block_hashes(a, 2), block_hashes(b, 2), block_hashes(c, 2)
    assert len(ha) == 4, "only full blocks are hashed (9 tokens, blocks of 2: 4 full blocks)"
    assert ha[:3] == hb[:3] and ha[3] != hb[3], "equal prefixes give equal hashes, up to the first difference"
    assert ha[1] != hc[1], "block 1 holds the same tokens [3, 4] but a different prefix: a different hash"
    assert ha[0] == hash_block_tokens(ROOT_HASH, [1, 2]) and ha[1] == hash_block_tokens(ha[0], [3, 4])
    assert block_hashes(a, 2, 2) == ha[:2]


def test_longest_cached_prefix_stops_at_the_first_miss():
    toks = list(range(12))
    h = block_hashes(toks, 4)  # 3 blocks
    assert longest_cached_prefix(toks, 4, {h[0]: 7, h[1]: 3, h[2]: 5}) == [7, 3, 5]
    assert longest_cached_prefix(toks, 4, {h[0]: 7, h[2]: 5}) == [7], "block 2 is useless without block 1"
    assert longest_cached_prefix(toks, 4, {h[1]: 3}) == []
    assert longest_cached_prefix(toks, 4, {h[0]: 7, h[1]: 3, h[2]: 5}, max_blocks=2) == [7, 3]


# -------------------------------------------------------------- the evictable pool


def test_free_cached_blocks_are_evictable_and_evicted_lru_only_when_needed():
    a = BlockAllocator(4)
    x = a.allocate(3)
    for i, b in enumerate(x):
        assert a.register(b, 100 + i, [i])
    a.free(x[1])
    a.free(x[0])
    assert list(a.evictable) == [x[1], x[0]] and a.num_free == 3 and a.num_cached == 3
    a.check_invariants()
    y = a.allocate(1)
    assert y == [3], "a never-cached free block is used before any eviction"
    assert a.num_evictions == 0 and a.num_cached == 3
    z = a.allocate(1)
    assert z == [x[1]], "then the least recently freed cached block is evicted"
    assert a.num_evictions == 1 and a.block_hash[x[1]] is None and 101 not in a.cached
    a.touch(x[0])  # a hit takes it back out of the pool
    assert a.ref_counts[x[0]] == 1 and not a.evictable
    with pytest.raises(ValueError, match="no cached prefix"):
        a.touch(y[0])
    a.check_invariants()


def test_register_keeps_one_block_per_hash():
    a = BlockAllocator(3)
    x = a.allocate(2)
    assert a.register(x[0], 5, [1]) and not a.register(x[1], 5, [1]), "a second block with the same hash stays uncached"
    a.free(x[1])
    assert a.free_ids[-1] == x[1], "an uncached block goes back to the plain free list"
    with pytest.raises(ValueError, match="free"):
        a.register(x[1], 6, [2])


def test_lru_victim():
    pool = OrderedDict.fromkeys([4, 1, 9])
    assert lru_victim(pool) == 4


def test_prefix_caching_needs_the_paged_engine():
    with pytest.raises(ValueError, match="enable_prefix_caching.*engine='paged'"):
        EngineConfig(engine="continuous", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineConfig(engine="paged", enable_prefix_caching="yes")
    assert EngineConfig(engine="paged", enable_prefix_caching=True).enable_prefix_caching


# -------------------------------------------------------------- block manager state machine

_OPS = [0]  # block-level operations run by the state machine, over all examples
_SEEN = {"hit_blocks": 0, "evictions": 0}  # so the test cannot pass without exercising the cache
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]


class _Seq:
    def __init__(self, name: str, tokens: list[int]):
        self.request_id = name
        self.prompt = tokens
        self.out: list[int] = []
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0

    @property
    def all_token_ids(self):
        return self.prompt + self.out

    @property
    def num_tokens(self):
        return len(self.prompt) + len(self.out)


class CachingBlockManagerMachine(RuleBasedStateMachine):
    """Random operations on a caching BlockManager with a simulated KV cache.

    ``kv[slot]`` is the token written there. A sequence that shares a hit reads the
    hit blocks' slots: they must hold its own prompt's tokens.
    """

    def __init__(self):
        super().__init__()
        self.bm = None
        self.kv: dict[int, int] = {}
        self.live: list[_Seq] = []
        self.parked: list[_Seq] = []  # preempted: hold no blocks, come back with a lookup
        self.count = 0

    @initialize(bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 16))
    def setup(self, bs, num_blocks):
        self.bs = bs
        self.bm = BlockManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=True)

    def _write(self, s: _Seq, start: int, end: int) -> None:
        for p, slot in zip(range(start, end), slots_for(s.block_ids, self.bs, start, end)):
            self.kv[slot] = s.all_token_ids[p]

    def _admit(self, s: _Seq) -> bool:
        hit = self.bm.lookup_prefix(s)
        cached = len(hit) * self.bs
        assert cached <= s.num_tokens - 1, "a hit must leave the last token to compute"
        for i, b in enumerate(hit):  # the hit blocks hold exactly this prompt's tokens
            got = [self.kv.get(b * self.bs + j) for j in range(self.bs)]
            assert got == s.all_token_ids[i * self.bs:(i + 1) * self.bs], "a hit returned other tokens"
        if not self.bm.can_share_prefix(s, hit, s.num_tokens):
            return False
        held_before = {b for t in self.bm.tables.values() for b in t}
        if hit:
            self.bm.share_prefix(s, hit)
        else:
            self.bm.tables.pop(s, None)
        s.num_computed_tokens = cached
        new = self.bm.grow(s, s.num_tokens)
        assert not set(new) & held_before, "an allocation evicted or reused a block someone holds"
        self.bm.cache_blocks(s, s.num_tokens)
        self._write(s, cached, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        _OPS[0] += 1 + len(new) + len(hit)
        _SEEN["hit_blocks"] += len(hit)
        return True

    @rule(which=st.integers(0, len(PREFIXES) - 1), extra=st.lists(st.integers(30, 33), min_size=1, max_size=5))
    def allocate(self, which, extra):
        self.count += 1
        s = _Seq(f"s{self.count}", PREFIXES[which] + extra)
        if self._admit(s):
            self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), k=st.integers(1, 3))
    def append(self, i, k):
        s = self.live[i % len(self.live)]
        if not self.bm.can_grow(s, s.num_tokens + k):
            return
        start = s.num_tokens
        s.out.extend(40 + (start + j) % 3 for j in range(k))
        held_before = {b for t in self.bm.tables.values() for b in t}
        new = self.bm.grow(s, s.num_tokens)
        assert not set(new) & held_before
        self.bm.cache_blocks(s, s.num_tokens)
        self._write(s, start, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        _OPS[0] += 1 + len(new)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), k=st.integers(1, 3))
    def lookahead_and_rollback(self, i, k):
        """Speculative decoding: grow for k drafts, write them, keep none (shrink back)."""
        s = self.live[i % len(self.live)]
        if not self.bm.can_grow(s, s.num_tokens + k):
            return
        self.bm.grow(s, s.num_tokens + k)
        for p, slot in zip(range(k), slots_for(s.block_ids, self.bs, s.num_tokens, s.num_tokens + k)):
            self.kv[slot] = -1  # a rejected draft's K/V
        freed = self.bm.shrink(s, s.num_tokens)
        assert all(self.bm.allocator.block_hash[b] is None for b in freed), "a rolled-back block was cached"
        _OPS[0] += 2

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        s = self.live.pop(i % len(self.live))
        n = len(s.block_ids)
        self.bm.free(s)
        _OPS[0] += 1 + n

    @precondition(lambda self: self.live)
    @rule()
    def preempt_newest(self):
        s = self.live.pop()
        n = len(s.block_ids)
        self.bm.free(s)
        s.num_computed_tokens = 0
        self.parked.append(s)
        _OPS[0] += 1 + n

    @precondition(lambda self: self.parked)
    @rule()
    def resume(self):
        s = self.parked[0]
        if self._admit(s):
            self.parked.pop(0)
            self.live.append(s)

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        bm, a = self.bm, self.bm.allocator
        bm.check_invariants()
        held = [b for s in self.live for b in s.block_ids]
        assert len(set(held)) + a.num_free == a.num_blocks, "a block leaked"
        for s in self.live:
            assert all(a.ref_counts[b] > 0 for b in s.block_ids)
            # every block of a live sequence still holds what the sequence wrote there
            got = [self.kv.get(slot) for slot in slots_for(s.block_ids, self.bs, 0, s.num_tokens)]
            assert got == s.all_token_ids, f"{s.request_id}: a held block was overwritten (evicted while in use?)"
        for b, h in enumerate(a.block_hash):  # a cached block's K/V is what its hash names
            if h is not None:
                assert tuple(self.kv.get(b * self.bs + j) for j in range(self.bs)) == a.block_tokens[b]

    def teardown(self):
        if self.bm is None:
            return
        for s in self.live:
            self.bm.free(s)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        _SEEN["evictions"] += self.bm.num_evictions


TestCachingBlockManager = CachingBlockManagerMachine.TestCase
TestCachingBlockManager.settings = settings(FAST, max_examples=250, stateful_step_count=50)


def test_state_machine_ran_enough_operations():
    """The state machine above must have run >= 10,000 block operations in total."""
    if _OPS[0] == 0:
        pytest.skip("run together with TestCachingBlockManager")
    assert _OPS[0] >= 10_000, f"only {_OPS[0]} operations: raise max_examples"
    assert _SEEN["hit_blocks"] >= 500 and _SEEN["evictions"] >= 500, f"too few cache hits or evictions: {_SEEN}"


# -------------------------------------------------------------- the scheduler, a fake model

VOCAB, EOS = 40, 0


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


class ContentEngine:
    """Drives a PagedScheduler with a simulated KV cache whose slot p holds what real K/V
    depends on: the position and every token up to it. A request that reads, through its
    block table, a slot written for another prefix (a wrong hit, a block evicted or reused
    while held) sees different content and fails; a shared block is fine when its content
    is the same. Returns nothing; ``step`` checks the invariants."""

    def __init__(self, sched: PagedScheduler):
        self.sched = sched
        self.now = 0.0
        sched.clock = lambda: self.now
        self.cache: dict[int, tuple[int, int]] = {}
        self.steps = 0
        self.fed = 0  # tokens fed (computed) in all steps

    @staticmethod
    def content(tokens: list[int], p: int) -> tuple[int, int]:
        return p, hash(tuple(tokens[:p + 1]))

    def step(self):
        s, bm = self.sched, self.sched.block_manager
        out = s.schedule()
        self.steps += 1
        assert len(s.running) <= s.max_num_seqs
        assert out.num_tokens <= s.max_num_batched_tokens, "token budget exceeded"
        assert all(row.num_new_tokens >= 1 for row in out.rows)
        assert len({id(row.request) for row in out.rows}) == len(out.rows), "a request scheduled twice"
        for victim in out.preempted:
            assert victim.status is RequestStatus.PREEMPTED and not victim.block_ids and victim in s.waiting
        bm.check_invariants()
        held = {b for r in s.running for b in r.block_ids}
        assert len(held) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
        assert all(not r.block_ids for r in s.waiting), "a waiting request holds blocks"
        if s.running or any(r.arrival_time <= self.now for r in s.waiting):
            assert out.rows, "stall: work is ready but nothing was scheduled"
        for row in out.rows:  # write first (every row), as the forward does layer by layer
            r, n = row.request, row.num_new_tokens
            self.fed += n
            toks = r.all_token_ids
            for p, slot in zip(range(r.num_computed_tokens, r.num_computed_tokens + n),
                               bm.slot_mapping(r, r.num_computed_tokens, r.num_computed_tokens + n)):
                self.cache[slot] = self.content(toks, p)
        sampled = {}
        for i, row in enumerate(out.rows):  # then read every row's context back
            r = row.request
            end = r.num_computed_tokens + row.num_new_tokens
            seen = [self.cache.get(slot) for slot in slots_for(r.block_ids, bm.block_size, 0, end)]
            assert seen == [self.content(r.all_token_ids, p) for p in range(end)], \
                f"request {r.request_id} reads K/V of another prefix"
            if row.samples:
                sampled[i] = [fake_next_token(r.all_token_ids[:end])]
        s.update(out, sampled, now=self.now)
        self.now += 1.0
        return out


BASES = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]]


def shared_prompts(rng: random.Random, n: int, max_len: int) -> list[list[int]]:
    out = []
    for _ in range(n):
        base = rng.choice(BASES + [[]])[:rng.randint(0, 20)]
        p = (base + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 8))])[:max_len]
        out.append(p)
    return out


def run_fake(sched: PagedScheduler, specs, rng: random.Random, aborts=()):
    """Add the requests of ``specs`` (prompt, max_tokens, ignore_eos, arrival step[, priority]) and
    step until all finish. Returns (requests, engine)."""
    engine = ContentEngine(sched)
    requests = []
    # Added in arrival order, as an engine receives them (ids keep the order of ``specs``).
    for i, (prompt, max_tokens, ignore_eos, arrival, *prio) in sorted(enumerate(specs), key=lambda x: x[1][3]):
        sched.check_fits(len(prompt))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                priority=prio[0] if prio else "standard")
        r = Request(str(i), list(prompt), params, arrival_time=float(arrival))
        sched.add(r)
        requests.append(r)
    by_id = {r.request_id: r for r in requests}
    abort_at = {step: by_id[str(j)] for j, step in aborts}
    limit = 50 + sum(r.max_total_tokens for r in requests) * (len(requests) + 1) * 4
    while sched.has_unfinished():
        if engine.steps in abort_at:
            sched.abort(abort_at.pop(engine.steps))
        engine.step()
        assert engine.steps < limit, "no progress: the scheduler is stuck"
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables, "blocks leaked after every request finished"
    bm.check_invariants()
    for r in requests:
        assert r.is_finished
        if r.finish_reason is not FinishReason.ABORT:
            ref = solo_run(r.prompt_token_ids, r.sampling_params, sched.max_model_len)
            assert (r.output_token_ids, r.finish_reason) == ref, \
                f"request {r.request_id} (preempted {r.metrics.num_preemptions}x) differs from its solo run"
    return sorted(requests, key=lambda r: int(r.request_id)), engine


@st.composite
def caching_setups(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(16, 48))
    need = blocks_needed(max_model_len, block_size)
    num_blocks = need + draw(st.integers(0, need) | st.integers(0, 2))  # often tight: preemptions, evictions
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else max_model_len // 2, 2 * max_model_len))
    max_num_seqs = draw(st.integers(1, 6))
    n = draw(st.integers(2, 10))
    outs = draw(st.lists(st.tuples(st.integers(1, 20), st.booleans(), st.integers(0, 5)), min_size=n, max_size=n))
    aborts = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, 30)), max_size=1))
    return block_size, max_model_len, num_blocks, chunked, budget, max_num_seqs, outs, aborts


_SCHED_HITS = [0]


@settings(FAST, max_examples=120)
@given(setup=caching_setups(), seed=st.integers(0, 2**16))
def test_paged_scheduler_with_caching_random_workloads(setup, seed):
    """Caching on: solo-run outputs, no leak, every row reads its own prefix's K/V; and the
    same outputs and never more computed tokens than with caching off."""
    block_size, max_model_len, num_blocks, chunked, budget, max_num_seqs, outs, aborts = setup
    rng = random.Random(seed)
    prompts = shared_prompts(rng, len(outs), min(max_model_len - 1, budget if not chunked else max_model_len))
    specs = [(p, m, ig, a) for p, (m, ig, a) in zip(prompts, outs)]
    runs = {}
    for caching in (False, True):
        sched = PagedScheduler(max_num_seqs, budget, max_model_len, EOS, num_blocks, block_size,
                               enable_chunked_prefill=chunked, enable_prefix_caching=caching)
        reqs, eng = run_fake(sched, specs, random.Random(seed), aborts)
        runs[caching] = ([(r.output_token_ids, r.finish_reason) for r in reqs], sched)
    # (an abort lands at a step number: it may catch a request in one run and not the other)
    for (a, ra), (b, rb) in zip(runs[True][0], runs[False][0]):
        if FinishReason.ABORT not in (ra, rb):
            assert (a, ra) == (b, rb), "caching changed an output"
    on, off = runs[True][1], runs[False][1]
    assert off.prefix_hit_tokens == 0
    assert on.prefix_hit_tokens <= on.prefill_tokens_requested
    _SCHED_HITS[0] += on.prefix_hit_tokens


def test_scheduler_property_test_hit_the_cache():
    if _SCHED_HITS[0] == 0:
        pytest.skip("run together with test_paged_scheduler_with_caching_random_workloads")
    assert _SCHED_HITS[0] >= 200, f"only {_SCHED_HITS[0]} tokens hit the cache: the test exercises too little"


def _sched(**kw):
    opts = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, eos_token_id=EOS, num_blocks=32,
                block_size=4, enable_prefix_caching=True) | kw
    return PagedScheduler(**opts)


def test_admission_shares_the_cached_prefix_and_computes_the_rest():
    sched = _sched()
    prefix = list(range(1, 13))  # 3 full blocks of 4
    specs = [(prefix + [20, 21], 3, True, 0), (prefix + [30], 3, True, 1), (prefix, 2, True, 2)]
    reqs, eng = run_fake(sched, specs, random.Random(0))
    a, b, c = reqs
    assert a.metrics.num_cached_tokens == 0
    assert b.metrics.num_cached_tokens == 12, "the second request shares the three blocks of the prefix"
    assert c.metrics.num_cached_tokens == 8, "a prompt that is all cached still computes its last token"
    assert sched.prefill_tokens_requested == 14 + 13 + 12 and sched.prefix_hit_tokens == 20
    assert sched.block_manager.num_evictable_blocks == sched.block_manager.num_cached_blocks > 0, \
        "finished requests' blocks stay cached while free"


def test_same_step_admissions_share_blocks_being_written():
    """Offline arrivals: the second prompt is admitted in the step that writes the first one's
    blocks, and already shares them (every row's K/V is written before any row reads)."""
    sched = _sched()
    prefix = list(range(1, 17))
    sched.add(Request("a", prefix + [1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), arrival_time=0.0))
    sched.add(Request("b", prefix + [2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), arrival_time=0.0))
    out = ContentEngine(sched).step()
    assert [row.num_new_tokens for row in out.rows] == [17, 1]
    assert out.prefix_hit_tokens == 16 and out.prefill_tokens_requested == 34


def test_preempted_request_recomputes_from_the_cache():
    """A preempted request's blocks stay cached while free (its prompt's longest, the tail is
    evicted first), so its recompute starts with hits, and its output is unchanged."""
    sched = _sched(max_num_seqs=2, num_blocks=18, max_model_len=64)
    specs = [(list(range(1, 21)), 40, True, 0), (list(range(21, 41)), 30, True, 0)]
    engine_hits = []
    orig = sched._admit

    def spy(r, hit, n, out, now):
        engine_hits.append((r.request_id, r.metrics.num_preemptions, len(hit)))
        orig(r, hit, n, out, now)

    sched._admit = spy
    reqs, _ = run_fake(sched, specs, random.Random(0))
    assert reqs[1].metrics.num_preemptions >= 1, "the setup must preempt the second request"
    resumed = [h for rid, p, h in engine_hits if rid == "1" and p >= 1]
    assert resumed and resumed[0] >= 2, f"the recompute should find its first blocks cached: {engine_hits}"


def test_fcfs_without_caching_registers_nothing():
    sched = _sched(enable_prefix_caching=False)
    run_fake(sched, [(list(range(1, 13)), 3, True, 0), (list(range(1, 13)), 3, True, 0)], random.Random(0))
    assert sched.block_manager.num_cached_blocks == 0 and sched.prefix_hit_tokens == 0


# -------------------------------------------------------------- the real model (fp32, CPU)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def real():
    from minillm import loader

    return loader.load_weights(None), loader.load_tokenizer(None)


@pytest.fixture(scope="module")
def shared_prompts_real(real):
    """A 40-token shared prefix with five endings: four questions, and the prefix alone."""
    from tests.prompts import SHORT, long_prompt

    _, tok = real
    prefix = long_prompt(tok, 40)[:40]
    return [prefix + tok(q, add_special_tokens=False).input_ids for q in SHORT[:4]] + [prefix]


def real_engine(real, **kw):
    from minillm.engine import build_engine

    weights, tok = real
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=128, block_size=8,
                max_num_seqs=4) | kw
    return build_engine(EngineConfig(**opts), weights=weights, tokenizer=tok)


def run_real(engine, prompts, params=GREEDY):
    outs = [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables, "blocks leaked"
    return outs


@pytest.fixture(scope="module")
def reference(real, shared_prompts_real):
    """Caching off: the outputs every caching run must reproduce token for token."""
    return run_real(real_engine(real), shared_prompts_real)


@pytest.mark.slow
def test_real_model_caching_on_equals_off(real, shared_prompts_real, reference):
    engine = real_engine(real, enable_prefix_caching=True)
    assert run_real(engine, shared_prompts_real) == reference, "prefix caching changed a greedy token"
    recs = list(engine.step_records)
    hits, requested = sum(r.prefix_hit_tokens for r in recs), sum(r.prefill_tokens_requested for r in recs)
    # 5 prompts share 5 blocks of 8: the 4 after the first find 40 tokens, the prefix alone
    # finds 32 (its last token is computed).
    assert hits == 3 * 40 + 32 and requested == sum(len(p) for p in shared_prompts_real)
    assert recs[-1].num_cached_blocks > 0 and recs[-1].num_evictable_blocks == recs[-1].num_cached_blocks
    # A second run of the same prompts: every prompt is a hit up to its last block.
    again = run_real(engine, shared_prompts_real)
    assert again == reference
    hits2 = sum(r.prefix_hit_tokens for r in engine.step_records[len(recs):])
    assert hits2 == sum((len(p) - 1) // 8 * 8 for p in shared_prompts_real)


@pytest.mark.slow
def test_real_model_caching_under_preemption(real, shared_prompts_real, reference):
    # 9 blocks of 8 for 5 requests of up to ~58 tokens, sharing 5 blocks: newest requests
    # are preempted, freed cached blocks are evicted when the others grow, and recomputes
    # hit what is left.
    engine = real_engine(real, enable_prefix_caching=True, num_blocks=9, max_num_seqs=5, max_model_len=64)
    assert max(len(p) for p in shared_prompts_real) + GREEDY.max_tokens <= 64
    assert run_real(engine, shared_prompts_real) == reference, "caching + preemption changed a greedy token"
    assert engine.scheduler.num_preemptions > 0, "the cache was sized to force preemptions"
    assert engine.scheduler.block_manager.num_evictions > 0, "the cache was sized to force evictions"


@pytest.mark.slow
def test_real_model_caching_with_chunked_prefill(real, shared_prompts_real, reference):
    engine = real_engine(real, enable_prefix_caching=True, enable_chunked_prefill=True,
                         max_num_batched_tokens=12)  # chunks end mid-block
    assert run_real(engine, shared_prompts_real) == reference, "caching + chunked prefill changed a greedy token"
    assert max(r.num_tokens for r in engine.step_records) <= 12
    assert engine.scheduler.prefix_hit_tokens > 0


@pytest.mark.slow
def test_real_model_caching_with_speculative_decoding(real, shared_prompts_real, reference):
    engine = real_engine(real, enable_prefix_caching=True, num_blocks=24,
                         speculative={"method": "ngram", "num_speculative_tokens": 3,
                                      "disable_by_batch_size": None})
    assert run_real(engine, shared_prompts_real) == reference, "caching + speculation changed a greedy token"
    assert engine.spec_stats.num_drafts > 0 and engine.scheduler.prefix_hit_tokens > 0


# -------------------------------------------------------------- the chapter's workloads


def test_shared_prefix_workload():
    from minillm.bench.workload import make_workload

    w = make_workload("shared-prefix", 8, seed=0, system_len=64, question_len=6)
    first = w.requests[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == first for r in w), "every prompt starts with the same system prompt"
    assert len({tuple(r.prompt_token_ids) for r in w}) == 8, "the questions are distinct"


def test_multi_turn_workload_resends_the_history():
    from minillm.bench.workload import make_workload

    w = make_workload("multi-turn", 9, seed=0, turns=3)
    p = [r.prompt_token_ids for r in w]  # 3 conversations x 3 turns, turn-major
    for c in range(3):
        assert p[c] == p[3 + c][:len(p[c])] and p[3 + c] == p[6 + c][:len(p[3 + c])], \
            "each turn's prompt starts with the previous turn's"
    assert p[0][:64] == p[1][:64], "conversations share the system prompt"
    assert [r.arrival_time for r in make_workload("multi-turn", 4, turns=2, turn_gap_s=1.5)] == [0, 0, 1.5, 1.5]


def test_mixed_priority_workload():
    from minillm.bench.workload import make_workload

    w = make_workload("mixed-priority", 16, seed=1)
    classes = [r.priority for r in w]
    assert classes.count("batch") == 4 and classes.count("interactive") == 12
    assert [r.arrival_time for r in w] == sorted(r.arrival_time for r in w)
    assert all(r.arrival_time == 0 for r in w if r.priority == "batch"), "the batch jobs are the background"
    assert all(r.sampling_params().priority == r.priority for r in w)
    batch = [len(r.prompt_token_ids) for r in w if r.priority == "batch"]
    chat = [len(r.prompt_token_ids) for r in w if r.priority == "interactive"]
    assert min(batch) > 4 * max(chat)
    with pytest.raises(ValueError, match="batch_fraction must be in"):
        make_workload("mixed-priority", 4, batch_fraction=1.5)
