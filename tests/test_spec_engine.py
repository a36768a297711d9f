"""Speculative decoding in the paged engine: policies, KV roll-back, greedy exactness.

The equality that matters (design.md §4): with speculation on, greedy output is token
for token the output without it, whatever the drafter, k, batch, block size, budget or
preemption pattern. Most checks run on a tiny random Llama (seconds); the ones marked
``slow`` run the real SmolLM2 with the n-gram and the self-draft model drafters.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm import LLM, SamplingParams, loader
from minillm.block_manager import BlockManager, blocks_needed
from minillm.config import EngineConfig, ModelConfig, SpeculativeConfig
from minillm.engine import build_engine
from minillm.model import build_model
from minillm.spec_decode import policy
from minillm.spec_decode.drafters import build_drafter

TINY = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=8, max_position_embeddings=256, eos_token_id=2)




@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """The tiny model runs fastest on one thread, and then never waits for OpenMP workers
    spinning on a busy machine (which can make a millisecond op take a second)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_weights(cfg=TINY, seed=0, scale=10.0):
    """Seeded random weights, scaled so greedy text neither repeats one token nor looks like
    noise: prompt lookup then gets both accepted and rejected drafts."""
    return {k: v if "norm" in k else v * scale for k, v in loader.dummy_weights(cfg, seed).items()}


TINY_WEIGHTS = tiny_weights()


def tiny_engine(spec=None, **kwargs):
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4)
    return build_engine(EngineConfig(**(opts | kwargs), speculative=spec), weights=TINY_WEIGHTS, tokenizer=None,
                        model_config=TINY)


def tiny_prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Short prompts with a repeated motif, so prompt lookup has something to find.
    out = []
    for i in range(n):
        motif = torch.randint(3, TINY.vocab_size, (3 + i,), generator=g).tolist()
        out.append(motif * 2 + torch.randint(3, TINY.vocab_size, (2,), generator=g).tolist())
    return out


def run(engine, prompts, params):
    return [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]


def assert_all_free(engine):
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables, "blocks leaked"
    assert not engine.has_unfinished()
    if engine.speculator is not None:
        assert not engine.speculator.requests, "per-request speculation state leaked"
        assert not getattr(engine.speculator.drafter, "state", {}), "draft KV state leaked"


def assert_trailing_blocks_freed(engine):
    """After every step a request holds the blocks of its computed tokens only, as without
    speculation: the blocks taken for rejected drafts went back (at most block_size - 1
    empty slots per running request)."""
    per_token, bs = engine.kv_bytes_per_token, engine.runner.block_size
    for rec in engine.step_records:
        assert 0 <= rec.kv_reserved_bytes - rec.kv_used_bytes <= rec.num_running * (bs - 1) * per_token, (
            f"step {rec.step}: blocks of rejected drafts were not freed")


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SPECS = {
    "ngram": dict(method="ngram"),
    "self-draft": dict(method="model", draft_layers=[0, 2]),
}


# ------------------------------------------------------------------ policies (pure functions)


def test_num_drafts_allowed():
    # k, outputs so far, max_tokens, tokens so far, max_model_len, budget left
    assert policy.num_drafts_allowed(4, 0, 100, 10, 128, 1000) == 4
    assert policy.num_drafts_allowed(4, 8, 10, 10, 128, 1000) == 1, "a step emits drafts + 1: stop at max_tokens"
    assert policy.num_drafts_allowed(4, 9, 10, 10, 128, 1000) == 0, "one token left: nothing to draft"
    assert policy.num_drafts_allowed(4, 0, 100, 125, 128, 1000) == 2, "never past max_model_len"
    assert policy.num_drafts_allowed(4, 0, 100, 10, 128, 3) == 3, "each draft is a query token of the budget"
    assert policy.num_drafts_allowed(4, 0, 100, 10, 128, 0) == 0


def test_adaptive_k_moves_up_and_down_within_bounds():
    nxt = policy.next_num_speculative_tokens
    assert nxt(3, 0.9, k_max=4) == 4, "acceptance > 0.8: one more draft"
    assert nxt(4, 0.95, k_max=4) == 4, "never above k_max"
    assert nxt(3, 0.4, k_max=4) == 2, "acceptance < 0.5: one fewer"
    assert nxt(1, 0.0, k_max=4) == 1, "never below k_min"
    assert nxt(3, 0.6, k_max=4) == 3, "in between: unchanged"
    assert nxt(3, 0.8, k_max=4) == 3 and nxt(3, 0.5, k_max=4) == 3, "the thresholds are strict"
    assert nxt(3, None, k_max=4) == 3, "no drafts verified yet: unchanged"
    assert policy.recent_acceptance([]) is None
    assert policy.recent_acceptance([(4, 4), (4, 0)]) == 0.5
    assert policy.recent_acceptance([(0, 0)]) is None


def test_off_switch():
    assert policy.speculation_enabled(3, 4) and not policy.speculation_enabled(4, 4)
    assert policy.speculation_enabled(1000, None), "None: never switched off"


def test_expected_speedup():
    assert policy.expected_speedup(0.0, 4, verify_cost=1.0) == 1.0, "nothing accepted, free verify: break even"
    assert policy.expected_speedup(1.0, 4, verify_cost=1.0) == 5.0
    assert policy.expected_speedup(0.0, 4, verify_cost=2.0) == 0.5, "a poor draft on a costly verify: slower"
    assert policy.expected_speedup(0.5, 2, verify_cost=1.0, draft_cost=0.25) == pytest.approx(1.75 / 1.5)
    assert policy.expected_speedup(1.0, 4, verify_cost=2.0, fraction=0.0) == 1.0, "never drafting: plain decoding"
    assert policy.expected_speedup(1.0, 4, verify_cost=2.0, fraction=0.5) == pytest.approx(3.0 / 1.5)


# ------------------------------------------------------------------ roll-back: BlockManager.shrink

OPS = st.lists(st.tuples(st.sampled_from(["grow", "shrink", "free"]), st.integers(0, 3), st.integers(0, 40)),
               max_size=60)


class _Req:
    def __init__(self, i):
        self.request_id = str(i)
        self.block_ids = []


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_shrink_property(ops):
    """Random grow / shrink / free over 4 requests: no block leaked, counts match the tables,
    a table covers exactly what it was last grown or shrunk to (never less)."""
    bm = BlockManager(num_blocks=24, block_size=4)
    reqs = [_Req(i) for i in range(4)]
    for op, i, n in ops:
        r = reqs[i]
        if op == "grow":
            if bm.can_grow(r, n):
                bm.grow(r, n)
                assert len(r.block_ids) >= blocks_needed(n, 4)
        elif op == "shrink" and bm.holds(r):
            before = list(r.block_ids)
            freed = bm.shrink(r, n)
            keep = min(len(before), blocks_needed(n, 4))
            assert r.block_ids == before[:keep] and freed == before[keep:], "shrink drops the trailing blocks only"
        elif op == "free" and bm.holds(r):
            bm.free(r)
            assert r.block_ids == []
        bm.check_invariants()
    for r in reqs:
        if bm.holds(r):
            bm.free(r)
    assert bm.num_free_blocks == 24


def test_shrink_rejects_unknown_request_and_bad_length():
    bm = BlockManager(num_blocks=4, block_size=4)
    r = _Req(0)
    with pytest.raises(ValueError, match="holds no blocks"):
        bm.shrink(r, 0)
    bm.grow(r, 8)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.shrink(r, -1)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("spec, message", [
    (dict(method="ngram", num_speculative_tokens=0), r"num_speculative_tokens must be an integer in \[1, 16\]"),
    (dict(method="ngram", num_speculative_tokens=17), r"in \[1, 16\]"),
    (dict(method="ngram", num_speculative_tokens=2.0), r"in \[1, 16\]"),
    (dict(method="eagle"), "unknown speculative method 'eagle'; valid methods: ngram, model, medusa"),
    (dict(num_speculative_tokens=2), "needs a method"),
    (dict(method="ngram", lookahead=3), "unknown speculative option"),
    (dict(method="model"), "exactly one of draft_layers"),
    (dict(method="model", draft_layers=[3, 1]), "increasing"),
    (dict(method="ngram", draft_layers=[0]), "options of the 'model' method"),
    (dict(method="ngram", disable_by_batch_size=0), "disable_by_batch_size"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config(spec, message):
    with pytest.raises(ValueError, match=message):
        LLM(engine="paged", speculative=spec)


def test_speculation_needs_the_paged_engine():
    with pytest.raises(ValueError, match="paged engine"):
        LLM(engine="continuous", speculative=dict(method="ngram"))


def test_draft_vocabulary_must_match_the_target():
    other = ModelConfig(**{**{f: getattr(TINY, f) for f in TINY.__slots__}, "vocab_size": 80})
    draft = build_model(other, loader.dummy_weights(other), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="vocabulary has 80 tokens but the target's has 64"):
        tiny_engine(dict(method="model", model=draft))


def test_draft_layers_must_exist():
    with pytest.raises(ValueError, match=r"draft_layers \[3\] are not layers of the target"):
        tiny_engine(dict(method="model", draft_layers=[0, 3]))


# ------------------------------------------------------------------ the engine, tiny model


@pytest.fixture(scope="module")
def tiny_ref():
    """Greedy outputs of each tiny prompt run alone without speculation."""
    engine = tiny_engine()
    return [run(engine, [p], GREEDY)[0] for p in tiny_prompts()]


@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("name", SPECS)
def test_tiny_greedy_equals_no_speculation(tiny_ref, name, k):
    engine = tiny_engine(SPECS[name] | dict(num_speculative_tokens=k, disable_by_batch_size=None))
    assert run(engine, tiny_prompts(), GREEDY) == tiny_ref, f"{name}, k={k}: batched speculative output differs"
    stats = engine.spec_stats
    assert stats.num_drafts > 0 and stats.spec_steps > 0, "the test must actually speculate"
    assert stats.target_forwards == len(engine.step_records)
    if name == "ngram":
        assert stats.draft_forwards == 0, "prompt lookup runs no model"
    else:
        assert stats.draft_forwards >= stats.spec_steps, "a model drafter runs at least one forward per draft step"
    # every decode row emits 1 + its accepted drafts; the first token of each request comes from its prefill
    assert stats.decode_tokens == sum(len(t) for t in tiny_ref) - len(tiny_ref)
    assert stats.decode_tokens == stats.decode_rows + stats.num_accepted
    assert_trailing_blocks_freed(engine)
    assert_all_free(engine)
    solo = tiny_engine(SPECS[name] | dict(num_speculative_tokens=k))
    assert run(solo, tiny_prompts()[:1], GREEDY) == tiny_ref[:1], f"{name}, k={k}: solo speculative output differs"


@pytest.mark.parametrize("preempt", [False, True])
def test_tiny_draft_with_every_layer_accepts_everything(tiny_ref, preempt):
    """A "draft" made of all the target's layers IS the target: q == p, so every draft must be
    accepted. Anything less means the draft KV cache was not rolled back (or not reset after a
    preemption) correctly: greedy output cannot show that, the acceptance rate does."""
    opts = dict(max_model_len=40, num_blocks=12, max_num_batched_tokens=8, enable_chunked_prefill=True) if preempt else {}
    engine = tiny_engine(dict(method="model", draft_layers=[0, 1, 2], num_speculative_tokens=3,
                              disable_by_batch_size=None), **opts)
    assert run(engine, tiny_prompts(), GREEDY) == tiny_ref
    assert engine.scheduler.num_preemptions > 0 if preempt else True
    assert engine.spec_stats.acceptance_rate == 1.0
    assert_all_free(engine)


def test_tiny_draft_model_from_another_llama(tiny_ref):
    # A different (smaller) architecture with the same vocabulary drafts with its own KV cache.
    small = ModelConfig(**{**{f: getattr(TINY, f) for f in TINY.__slots__}, "num_layers": 1, "num_kv_heads": 1,
                           "hidden_size": 16, "num_heads": 2})
    draft = build_model(small, tiny_weights(small, seed=3), torch.device("cpu"), torch.float32)
    engine = tiny_engine(dict(method="model", model=draft, num_speculative_tokens=3, disable_by_batch_size=None))
    assert run(engine, tiny_prompts(), GREEDY) == tiny_ref
    assert engine.spec_stats.draft_forwards > 0
    assert_all_free(engine)


@pytest.mark.parametrize("name", SPECS)
def test_tiny_stops_inside_an_accepted_run(tiny_ref, name):
    """EOS-like stop tokens and max_tokens in the middle of a run of accepted drafts cut the rest."""
    plain = tiny_engine()
    spec = tiny_engine(SPECS[name] | dict(num_speculative_tokens=4, disable_by_batch_size=None))
    for i, ref in enumerate(tiny_ref):
        stop = ref[7]  # a token the request emits mid-way
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop])
        want = run(plain, [tiny_prompts()[i]], params)
        assert run(spec, [tiny_prompts()[i]], params) == want, f"prompt {i}: stop token {stop}"
        assert want[0][-1] == stop and len(want[0]) <= 8
    for m in (1, 2, 3, 5, 6):
        params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        assert run(spec, tiny_prompts(), params) == [t[:m] for t in tiny_ref], f"max_tokens={m}"
    assert_all_free(spec)


@pytest.mark.parametrize("name", SPECS)
def test_tiny_preemption_and_small_budget(tiny_ref, name):
    """A cache that forces preemptions, a token budget that caps the drafts, chunked prefill."""
    engine = tiny_engine(SPECS[name] | dict(num_speculative_tokens=4, disable_by_batch_size=None),
                         max_model_len=40, num_blocks=12, max_num_batched_tokens=8, enable_chunked_prefill=True)
    out = run(engine, tiny_prompts(), GREEDY)
    assert out == tiny_ref
    assert engine.scheduler.num_preemptions > 0, "the cache was sized to force preemptions"
    assert max(rec.num_tokens for rec in engine.step_records) <= 8, "drafts must fit the token budget"
    assert engine.spec_stats.num_drafts > 0
    assert_trailing_blocks_freed(engine)
    assert_all_free(engine)


@pytest.mark.parametrize("name", SPECS)
def test_tiny_abort_frees_everything(name):
    engine = tiny_engine(SPECS[name] | dict(num_speculative_tokens=4, disable_by_batch_size=None))
    reqs = [engine.add_request(p, GREEDY) for p in tiny_prompts()]
    for _ in range(4):
        engine.step()
    assert engine.spec_stats.spec_steps > 0
    for r in reqs:
        engine.abort(r)
    assert_all_free(engine)


@pytest.mark.parametrize("name", SPECS)
def test_tiny_seeded_sampling_is_reproducible_and_batch_independent(name):
    """The noise of each token position comes from (request seed, position), and verification
    emits the target's own samples: a seeded request gives the same tokens twice, alone or in a
    batch, and the same as without speculation (tests/test_seeded_speculation.py varies more)."""
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=20, ignore_eos=True, seed=s) for s in range(4)]
    engine = tiny_engine(SPECS[name] | dict(num_speculative_tokens=3, disable_by_batch_size=None))
    batched = [o.token_ids for o in engine.run([engine.make_request(p, sp) for p, sp in zip(tiny_prompts(), params)])]
    again = [o.token_ids for o in engine.run([engine.make_request(p, sp) for p, sp in zip(tiny_prompts(), params)])]
    assert batched == again
    solo = [engine.run([engine.make_request(p, sp)])[0].token_ids for p, sp in zip(tiny_prompts(), params)]
    assert solo == batched
    plain = tiny_engine()
    assert [o.token_ids for o in plain.run([plain.make_request(p, sp) for p, sp in zip(tiny_prompts(), params)])] \
        == batched, "speculation must not change a seeded request's tokens"
    assert engine.spec_stats.num_drafts > 0
    assert_all_free(engine)


def test_tiny_off_switch_and_adaptive_k(tiny_ref):
    # Four requests of equal length run together: with the switch at 2 running requests,
    # no step speculates, and the output is the plain one.
    off = tiny_engine(dict(method="ngram", num_speculative_tokens=4, disable_by_batch_size=2))
    assert run(off, tiny_prompts(), GREEDY) == tiny_ref
    assert off.spec_stats.spec_steps == 0 and off.spec_stats.num_drafts == 0
    assert off.spec_stats.tokens_per_target_forward == 1.0
    # Adaptive k with a poor drafter (one random layer): k falls, fewer drafts are wasted.
    spec = dict(method="model", draft_layers=[1], num_speculative_tokens=4, disable_by_batch_size=None)
    fixed, adaptive = tiny_engine(spec), tiny_engine(spec | dict(adaptive=True))
    assert run(fixed, tiny_prompts(), GREEDY) == run(adaptive, tiny_prompts(), GREEDY) == tiny_ref
    f, a = fixed.spec_stats, adaptive.spec_stats
    assert f.acceptance_rate < 0.5, "the test needs a poor drafter"
    assert a.num_drafts < f.num_drafts, "adaptive k should draft less when acceptance is low"


def test_build_drafter_rejects_a_module_that_is_not_a_llama():
    spec = SpeculativeConfig(method="model", model=torch.nn.Linear(2, 2))
    target = build_model(TINY, loader.dummy_weights(TINY), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="minillm Llama"):
        build_drafter(spec, target, 8, 4, torch.device("cpu"), torch.float32)


# ------------------------------------------------------------------ the real model (slow)

REAL_TOKENS = 24


@pytest.fixture(scope="module")
def real():
    """(weights, tokenizer, prompts, solo greedy outputs without speculation)."""
    from tests.prompts import SHORT

    weights, tok = loader.load_weights(None), loader.load_tokenizer(None)
    # Prompts that repeat themselves (code, a list) and ones that do not.
    prompts = [tok(p).input_ids for p in SHORT[:3]]
    prompts.append(tok("Repeat after me: the quick brown fox jumps over the lazy dog. "
                       "Repeat after me: the quick brown fox").input_ids)
    engine = real_engine(weights, tok)
    params = SamplingParams(temperature=0, max_tokens=REAL_TOKENS, ignore_eos=True)
    solo = [run(engine, [p], params)[0] for p in prompts]
    return weights, tok, prompts, solo


def real_engine(weights, tok, spec=None, **kwargs):
    opts = dict(engine="paged", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4) | kwargs
    return build_engine(EngineConfig(**opts, speculative=spec), weights=weights, tokenizer=tok)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("spec", [dict(method="ngram"), dict(method="model", draft_layers=list(range(24)))],
                         ids=["ngram", "self-draft"])
def test_real_greedy_equals_solo(real, spec, k):
    weights, tok, prompts, solo = real
    params = SamplingParams(temperature=0, max_tokens=REAL_TOKENS, ignore_eos=True)
    engine = real_engine(weights, tok, spec | dict(num_speculative_tokens=k, disable_by_batch_size=None))
    out = run(engine, prompts, params)
    for i, (got, ref) in enumerate(zip(out, solo)):
        assert got == ref, f"{spec['method']}, k={k}, prompt {i}: batched speculative greedy output differs from solo"
    assert engine.spec_stats.num_accepted > 0, "the workload should accept some drafts"
    assert_all_free(engine)
    # Solo speculative: the prompt that copies itself (the longest accepted runs).
    assert run(engine, prompts[-1:], params) == solo[-1:], "solo speculative greedy output differs"
    assert_all_free(engine)


@pytest.mark.slow
def test_real_draft_layers_out_of_range(real):
    weights, tok, _, _ = real
    with pytest.raises(ValueError, match=r"draft_layers \[30\] are not layers of the target, which has layers 0..29"):
        real_engine(weights, tok, dict(method="model", draft_layers=[0, 30]))


# ------------------------------------------------------------------ the benchmark CLI


@pytest.mark.slow
def test_bench_cli_speculative_json(tmp_path):
    """--speculative / --num-speculative-tokens reach the paged engine; the JSON has the counters."""
    import json

    from minillm.bench import compare

    common = ["--engine", "paged", "--workload", "grounded", "--num-requests", "2", "--max-num-seqs", "1",
              "--no-progress", "--workload-param", "output_len=12"]
    for bad in (["--num-speculative-tokens", "17"], ["--engine", "continuous"]):
        with pytest.raises(SystemExit):  # k out of range; speculation outside the paged engine
            compare.main(common + ["--speculative", "ngram"] + bad)
    path = tmp_path / "spec.json"
    assert compare.main(common + ["--speculative", "ngram", "--num-speculative-tokens", "3", "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert s["speculative"]["method"] == "ngram" and s["speculative"]["num_speculative_tokens"] == 3
    for key in ("acceptance_rate", "mean_accepted_tokens", "tokens_per_target_forward", "target_forwards",
                "draft_forwards"):
        assert key in s, f"bench JSON lacks {key}"
    assert s["target_forwards"] == s["forward_passes"] and s["draft_forwards"] == 0
    assert s["tokens_per_target_forward"] >= 1.0
    path = tmp_path / "model.json"
    assert compare.main(common + ["--speculative", "model", "--draft-layers", "0-1", "--num-speculative-tokens", "2",
                                "--json", str(path)]) == 0
    s = json.loads(path.read_text())
    assert s["speculative"]["draft_layers"] == [0, 1] and s["draft_forwards"] > 0
