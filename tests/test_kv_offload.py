"""The host KV tier (``kv_offload``): evicted and idle prefix blocks kept in host memory, restored on a hit.

* options: bad values are ValueErrors that say what to change;
* the host pool's bookkeeping by hand: LRU reuse, pins, drops;
* a hypothesis state machine driving a caching ``BlockManager`` with a host tier on a
  simulated K/V store (device slots and host blocks), copies made in the order the model
  runner makes them (device -> host, then host -> device, before a forward writes): no
  block lost or held twice in either tier, every hit (device or host) reads its own
  prompt's tokens, every cached block in either tier holds what its hash names;
* the real model: greedy tokens identical with and without the host tier on multi-turn
  chat with a tight pool, also under preemption and with chunked prefill; a restored
  block's K/V equal bit for bit to the K/V computed when the block was first written.
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.block_manager import BlockManager, slots_for
from minillm.config import EngineConfig, check_kv_offload
from minillm.kv_offload import HostHit, HostTier

FAST = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -------------------------------------------------------------- options

@pytest.mark.parametrize("options, message", [
    ({"host_blocks": 0}, "host_blocks must be an integer >= 1"),
    ({"host_blocks": -4}, "host_blocks must be an integer >= 1"),
    ({"host_blocks": 2.5}, "host_blocks must be an integer >= 1"),
    ({}, "needs host_blocks"),
    ({"host_blocks": 8, "idle_s": -1}, "idle_s must be a finite number of seconds >= 0"),
    ({"host_blocks": 8, "idle_s": float("nan")}, "idle_s must be a finite number"),
    ({"host_blocks": 8, "idle": 2}, "unknown key"),
    (["host_blocks", 8], "kv_offload must be a dict"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        check_kv_offload(options)


def test_host_tier_needs_the_paged_engine_with_prefix_caching():
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        EngineConfig(engine="paged", kv_offload={"host_blocks": 8})
    with pytest.raises(ValueError, match="engine='paged'"):
        EngineConfig(engine="continuous", kv_offload={"host_blocks": 8})
    with pytest.raises(ValueError, match="kv_offload"):
        EngineConfig(engine="paged", enable_prefix_caching=True, kv_offload={"host_blocks": 8},
                     tensor_parallel_size=2)
    cfg = EngineConfig(engine="paged", enable_prefix_caching=True, kv_offload={"host_blocks": 8})
    assert cfg.kv_offload == {"host_blocks": 8, "idle_s": 2.0}
    with pytest.raises(ValueError, match="enable prefix caching"):
        BlockManager(8, 4).enable_host_tier(HostTier(4))


# -------------------------------------------------------------- the host pool by hand

def test_host_pool_reuses_its_least_recently_used_block_and_never_a_pinned_one():
    host = HostTier(2, idle_s=0)
    assert host.offload(10, 111, (1, 2)) and host.offload(11, 222, (3, 4))
    assert not host.offload(12, 111, (1, 2)), "a hash the host holds is not copied again"
    copies = host.take_copies()
    assert copies.outs == [(10, 0), (11, 1)] and not copies.ins
    host.offload(12, 111, (1, 2))  # touches 111: block 1 (hash 222) is now the least recently used
    assert host.offload(13, 333, (5, 6))
    assert host.lookup(222, (3, 4)) is None and host.lookup(111, (1, 2)) == 0 and host.lookup(333, (5, 6)) == 1
    assert host.lookup(111, (9, 9)) is None, "a hash collision is a miss"
    # Both blocks pinned (an offload and a restore pending): a third offload is dropped, not wrong.
    host.restore(0, 7)
    assert not host.offload(14, 444, (7, 8)) and host.dropped == 1
    host.check_invariants()
    copies = host.take_copies()
    assert copies.outs == [(13, 1)] and copies.ins == [(0, 7)]
    assert host.offload(14, 444, (7, 8)) and host.evictions == 2
    host.check_invariants()


def test_idle_blocks_are_copied_down_once_and_a_hit_restores_them():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm.enable_host_tier(HostTier(8, idle_s=2.0))
    now = [0.0]
    bm.allocator.clock = lambda: now[0]

    class Seq:
        def __init__(self, tokens):
            self.all_token_ids, self.block_ids, self.request_id = tokens, [], "s"

        @property
        def num_tokens(self):
            return len(self.all_token_ids)

    a = Seq([1, 2, 3, 4, 5])
    bm.grow(a, 5)
    bm.cache_blocks(a, 5)
    bm.free(a)  # blocks [0, 1] are evictable since t=0
    assert bm.offload_idle(1.0) == 0, "not idle long enough"
    assert bm.offload_idle(2.0) == 2 and bm.offload_idle(9.0) == 0, "copied once"
    bm.take_kv_copies()
    # Evict both device blocks: the host already holds them, nothing is copied again.
    b = Seq([7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7])
    bm.grow(b, 16)
    assert not bm.take_kv_copies() and bm.num_cached_blocks == 0
    bm.free(b)
    again = Seq([1, 2, 3, 4, 9])
    hit = bm.lookup_prefix(again)
    assert hit == [HostHit(0), HostHit(1)] or sorted(h.host_block for h in hit) == [0, 1]
    assert bm.can_share_prefix(again, hit, 5)
    bm.share_prefix(again, hit)
    copies = bm.take_kv_copies()
    assert [d for _, d in copies.ins] == again.block_ids[:2]
    bm.check_invariants()


# -------------------------------------------------------------- state machine: both tiers

_OPS = [0]
_SEEN = {"device_hits": 0, "host_hits": 0, "blocks_out": 0, "idle": 0}
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27],
            [30, 31, 32, 33, 34, 35]]


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


class HostTierMachine(RuleBasedStateMachine):
    """A caching BlockManager with a host tier, on a simulated K/V store.

    ``kv[slot]`` is the token whose K/V the device slot holds; ``host_kv[h]`` the tokens
    host block ``h`` holds. ``flush`` makes the pending copies as the model runner does
    (outs, then ins) and runs before every write, as the runner's copies run before the
    forward. A sequence reads its hit blocks after the flush: they must hold its tokens.
    """

    def __init__(self):
        super().__init__()
        self.bm = None
        self.kv: dict[int, int] = {}
        self.host_kv: dict[int, tuple] = {}
        self.live: list[_Seq] = []
        self.parked: list[_Seq] = []
        self.count = 0
        self.now = 0.0

    @initialize(bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(8, 14), host_blocks=st.integers(1, 12),
                idle_s=st.sampled_from([0.0, 1.0, 5.0]))
    def setup(self, bs, num_blocks, host_blocks, idle_s):
        self.bs = bs
        self.bm = BlockManager(num_blocks=num_blocks, block_size=bs, enable_prefix_caching=True)
        self.bm.enable_host_tier(HostTier(host_blocks, idle_s))
        self.bm.allocator.clock = lambda: self.now

    def _block(self, b: int) -> tuple:
        return tuple(self.kv.get(b * self.bs + j) for j in range(self.bs))

    def flush(self) -> None:
        copies = self.bm.take_kv_copies()
        for d, h in copies.outs:
            self.host_kv[h] = self._block(d)
        for h, d in copies.ins:
            for j, t in enumerate(self.host_kv[h]):
                self.kv[d * self.bs + j] = t
        _OPS[0] += len(copies.outs) + len(copies.ins)

    def _write(self, s: _Seq, start: int, end: int) -> None:
        self.flush()
        for p, slot in zip(range(start, end), slots_for(s.block_ids, self.bs, start, end)):
            self.kv[slot] = s.all_token_ids[p]

    def _admit(self, s: _Seq) -> bool:
        hit = self.bm.lookup_prefix(s)
        cached = len(hit) * self.bs
        assert cached <= s.num_tokens - 1, "a hit must leave the last token to compute"
        if not self.bm.can_share_prefix(s, hit, s.num_tokens):
            return False
        held_before = {b for t in self.bm.tables.values() for b in t}
        if hit:
            self.bm.share_prefix(s, hit)
        s.num_computed_tokens = cached
        new = self.bm.grow(s, s.num_tokens)
        restored = s.block_ids[:len(hit)]
        fresh = [b for b, h in zip(restored, hit) if isinstance(h, HostHit)] + new
        assert not set(fresh) & held_before, "an allocation took a block someone holds"
        assert len(set(s.block_ids)) == len(s.block_ids), "a block twice in one table"
        self.bm.cache_blocks(s, s.num_tokens)
        self._write(s, cached, s.num_tokens)  # flushes first: restores land before the forward
        for i, b in enumerate(restored):  # what the forward reads for the hit blocks: this prompt's tokens
            assert self._block(b) == tuple(s.all_token_ids[i * self.bs:(i + 1) * self.bs]), \
                f"hit {i} ({hit[i]!r} -> block {b}) holds other tokens"
        s.num_computed_tokens = s.num_tokens
        _OPS[0] += 1 + len(new) + len(hit)
        _SEEN["host_hits"] += sum(isinstance(h, HostHit) for h in hit)
        _SEEN["device_hits"] += sum(not isinstance(h, HostHit) for h in hit)
        return True

    @rule(which=st.integers(0, len(PREFIXES) - 1), extra=st.lists(st.integers(40, 43), min_size=1, max_size=5))
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
        s.out.extend(50 + (start + j) % 3 for j in range(k))
        self.bm.grow(s, s.num_tokens)
        self.bm.cache_blocks(s, s.num_tokens)
        self._write(s, start, s.num_tokens)
        s.num_computed_tokens = s.num_tokens
        _OPS[0] += 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        s = self.live.pop(i % len(self.live))
        self.bm.free(s)
        _OPS[0] += 1

    @precondition(lambda self: self.live)
    @rule()
    def preempt_newest(self):
        s = self.live.pop()
        self.bm.free(s)
        s.num_computed_tokens = 0
        self.parked.append(s)

    @precondition(lambda self: self.parked)
    @rule()
    def resume(self):
        s = self.parked[0]
        if self._admit(s):
            self.parked.pop(0)
            self.live.append(s)

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0]))
    def time_passes(self, dt):
        self.now += dt
        _SEEN["idle"] += self.bm.offload_idle(self.now)

    @rule()
    def copies_made(self):
        self.flush()

    @invariant()
    def consistent(self):
        if self.bm is None:
            return
        bm, a, host = self.bm, self.bm.allocator, self.bm.host
        bm.check_invariants()  # both tiers: free lists, LRUs, hash tables, pins
        held = [b for s in self.live for b in s.block_ids]
        assert len(set(held)) + a.num_free == a.num_blocks, "a device block leaked"
        assert len(host.free_ids) + len(host.lru) == host.num_blocks, "a host block leaked"
        restoring = {d for _, d in host.pending().ins}
        for s in self.live:
            got = [self.kv.get(slot) for slot in slots_for(s.block_ids, self.bs, 0, s.num_tokens)]
            assert got == s.all_token_ids, f"{s.request_id}: a held block was overwritten"
        for b, h in enumerate(a.block_hash):  # a cached device block holds what its hash names
            if h is not None and b not in restoring:
                assert self._block(b) == a.block_tokens[b]
        writing = {h for _, h in host.pending().outs}
        for hb in host.lru:  # and so does a cached host block, once its copy has run
            if hb not in writing:
                assert self.host_kv[hb] == host.block_tokens[hb], f"host block {hb} holds other tokens"

    def teardown(self):
        if self.bm is None:
            return
        for s in self.live:
            self.bm.free(s)
        self.flush()
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks
        _SEEN["blocks_out"] += self.bm.host.blocks_out


TestHostTier = HostTierMachine.TestCase
TestHostTier.settings = settings(FAST, max_examples=700, stateful_step_count=50)


def test_state_machine_exercised_both_tiers():
    if _OPS[0] == 0:
        pytest.skip("run together with TestHostTier")
    assert _OPS[0] >= 10_000, f"only {_OPS[0]} operations: raise max_examples"
    assert _SEEN["host_hits"] >= 200 and _SEEN["device_hits"] >= 200 and _SEEN["blocks_out"] >= 500 \
        and _SEEN["idle"] >= 100, f"too few hits, offloads or idle copies: {_SEEN}"


# -------------------------------------------------------------- the real model (fp32, CPU)

GREEDY_TOKENS = 6


@pytest.fixture(scope="module")
def real():
    from minillm import loader
    return loader.load_weights(None), loader.load_tokenizer(None)


def _engine(real, **kwargs):
    from minillm.engine import build_engine
    weights, tok = real
    opts = dict(device="cpu", dtype="float32", engine="paged", block_size=16, max_model_len=256,
                max_num_seqs=2, num_blocks=18, enable_prefix_caching=True) | kwargs
    return build_engine(EngineConfig(**opts), weights=weights, tokenizer=tok)


def _multi_turn(engine, conversations=5, turns=3, batch=1, seed=0, max_tokens=GREEDY_TOKENS, vocab=(1000, 20000)):
    """Conversations taking turns; each turn resends the whole history plus a new question
    (token ids drawn from ``vocab``)."""
    from minillm import SamplingParams
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    history = [[rng.randrange(*vocab) for _ in range(40)] for _ in range(conversations)]
    outs = []
    for _ in range(turns):
        for i in range(0, conversations, batch):
            group = range(i, min(i + batch, conversations))
            got = [o.token_ids for o in engine.run([engine.make_request(history[j], params) for j in group])]
            for j, o in zip(group, got):
                outs.append(o)
                history[j] = history[j] + o + [rng.randrange(*vocab) for _ in range(17)]
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 24, "enable_chunked_prefill": True},
                                    {"num_blocks": 16, "max_num_seqs": 5}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_real_model_greedy_tokens_identical_with_the_host_tier(real, kwargs):
    # Preemption: five conversations at once in 16 blocks, each growing past 4 blocks.
    run = dict(batch=5, max_tokens=24) if "max_num_seqs" in kwargs else {}
    off = _engine(real, **kwargs)
    on = _engine(real, kv_offload={"host_blocks": 64, "idle_s": 0.0}, **kwargs)
    want, got = _multi_turn(off, **run), _multi_turn(on, **run)
    assert got == want
    s, host = on.scheduler, on.scheduler.block_manager.host
    assert s.host_hit_tokens > 0 and host.blocks_in > 0, "the host tier was never hit: the test shows nothing"
    assert s.prefill_tokens_requested - s.prefix_hit_tokens < \
        off.scheduler.prefill_tokens_requested - off.scheduler.prefix_hit_tokens
    if "max_num_seqs" in kwargs:
        assert s.num_preemptions > 0, "no preemption happened"
    for e in (on, off):
        bm = e.scheduler.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    assert on.runner.host_kv.blocks_in == host.blocks_in and on.runner.host_kv.blocks_out == host.blocks_out


@pytest.mark.slow
def test_real_model_restored_kv_is_bit_for_bit_the_computed_kv(real):
    from minillm import SamplingParams
    engine = _engine(real, kv_offload={"host_blocks": 64, "idle_s": 60.0})  # offloads on eviction only
    bm, caches = engine.scheduler.block_manager, engine.runner.kv_caches
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = random.Random(3)
    first = [rng.randrange(1000, 20000) for _ in range(100)]
    engine.run([engine.make_request(first, params)])
    a = bm.allocator
    computed = {h: [(k[b].clone(), v[b].clone()) for k, v in caches] for h, b in a.cached.items()}
    assert len(computed) == 6
    for _ in range(3):  # other prompts push every block of the first one out of the device pool
        engine.run([engine.make_request([rng.randrange(1000, 20000) for _ in range(200)], params)])
    assert not set(computed) & set(a.cached), "the first prompt's blocks are still on the device"
    assert all(bm.host.holds(h) for h in computed)
    engine.run([engine.make_request(first + [5, 6, 7], params)])
    assert engine.scheduler.host_hit_tokens == 6 * 16
    for h, kv in computed.items():
        b = a.cached[h]
        for (k, v), (k0, v0) in zip(caches, kv):
            assert torch.equal(k[b], k0) and torch.equal(v[b], v0), "a restored block differs from its K/V"


@pytest.mark.slow
def test_real_model_offload_metrics_reach_the_snapshot_steps_and_prometheus(real):
    from minillm.serving import prometheus as names
    engine = _engine(real, kv_offload={"host_blocks": 64, "idle_s": 0.0})
    _multi_turn(engine)
    snap = engine.snapshot().kv_offload
    pool, s = engine.runner.host_kv, engine.scheduler
    assert snap.blocks_out == pool.blocks_out > 0 and snap.blocks_in == pool.blocks_in > 0
    assert snap.bytes_out == snap.blocks_out * pool.block_bytes and snap.copy_seconds > 0
    assert snap.host_hit_tokens == s.host_hit_tokens > 0
    assert snap.device_hit_tokens + snap.host_hit_tokens == s.prefix_hit_tokens
    recs = engine.step_records
    assert sum(r.kv_blocks_restored for r in recs) == snap.blocks_in
    assert sum(r.kv_blocks_offloaded for r in recs) == snap.blocks_out
    assert sum(r.host_hit_tokens for r in recs) == snap.host_hit_tokens
    assert _engine(real).snapshot().kv_offload is None

    class _LLM:  # what the collector reads: the engine's snapshot and the abort count
        stats, counts = engine.snapshot(), {}
    text = "\n".join(f"{m.name} {[(x.labels, x.value) for x in m.samples]}"
                     for m in names._EngineCollector(_LLM(), {"model_name": "m"}).collect())
    for name in (names.KV_OFFLOAD_BLOCKS, names.KV_OFFLOAD_BYTES, names.KV_OFFLOAD_SECONDS,
                 names.KV_HOST_BLOCKS_USED, names.PREFIX_HIT_TOKENS):
        assert name in text
    assert "'tier': 'host'" in text and "'direction': 'in'" in text


# -------------------------------------------------------------- on a GPU (make gpu-check)

TINY_CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=512)


def _cuda_engine(dtype: str, **kwargs):
    from minillm.config import ModelConfig
    from minillm.engine import build_engine
    opts = dict(device="cuda", dtype=dtype, engine="paged", attention_backend="triton", block_size=16,
                max_model_len=256, max_num_seqs=2, num_blocks=18, enable_prefix_caching=True) | kwargs
    return build_engine(EngineConfig(**opts), model_config=ModelConfig(**TINY_CFG), tokenizer=None)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 24, "enable_chunked_prefill": True},
                                    {"num_blocks": 16, "max_num_seqs": 5}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_cuda_host_tier_in_pinned_memory_gives_the_same_greedy_tokens(dtype, kwargs):
    run = dict(batch=5, max_tokens=24) if "max_num_seqs" in kwargs else {}
    run["vocab"] = (3, 128)  # the tiny model's
    off = _cuda_engine(dtype, **kwargs)
    on = _cuda_engine(dtype, kv_offload={"host_blocks": 64, "idle_s": 0.0}, **kwargs)
    assert on.runner.host_kv.caches[0][0].is_pinned()
    want, got = _multi_turn(off, **run), _multi_turn(on, **run)
    assert got == want
    assert on.scheduler.host_hit_tokens > 0 and on.runner.host_kv.blocks_in > 0, "the host tier was never hit"
    bm = on.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_restored_kv_is_bit_for_bit_the_computed_kv(dtype):
    from minillm import SamplingParams
    engine = _cuda_engine(dtype, kv_offload={"host_blocks": 64, "idle_s": 60.0})  # offloads on eviction only
    bm, caches = engine.scheduler.block_manager, engine.runner.kv_caches
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rng = random.Random(3)
    first = [rng.randrange(3, 128) for _ in range(100)]
    engine.run([engine.make_request(first, params)])
    a = bm.allocator
    computed = {h: [(k[b].clone(), v[b].clone()) for k, v in caches] for h, b in a.cached.items()}
    assert len(computed) == 6
    for _ in range(3):
        engine.run([engine.make_request([rng.randrange(3, 128) for _ in range(200)], params)])
    assert not set(computed) & set(a.cached), "the first prompt's blocks are still on the device"
    engine.run([engine.make_request(first + [5, 6, 7], params)])
    torch.cuda.synchronize()
    assert engine.scheduler.host_hit_tokens == 6 * 16
    for h, kv in computed.items():
        b = a.cached[h]
        for (k, v), (k0, v0) in zip(caches, kv):
            assert torch.equal(k[b], k0) and torch.equal(v[b], v0), "a restored block differs from its K/V"
