"""The paged engine on the real model (fp32, CPU): greedy outputs equal the solo run.

Whatever the block size, the attention backend, or how often requests are preempted
and recomputed, each request's greedy tokens must be exactly those it gets when it runs
alone on the simple engine. Engines share one set of preloaded weights; workloads are
small (the CPU runs ~0.1-0.5 s per step, the Triton interpreter seconds).
"""
from __future__ import annotations

import pytest

from minillm import SamplingParams, loader
from minillm.config import EngineConfig, ModelConfig
from minillm.engine import LLM, build_engine
from tests.prompts import SHORT, long_prompt

pytestmark = pytest.mark.slow

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def weights():
    return loader.load_weights(None)


@pytest.fixture(scope="module")
def tok():
    return loader.load_tokenizer(None)


def make_engine(weights, tok, **kwargs):
    opts = dict(device="cpu", dtype="float32", max_model_len=256) | kwargs
    return build_engine(EngineConfig(**opts), weights=weights, tokenizer=tok)


@pytest.fixture(scope="module")
def prompts(tok):
    # Four short prompts and one of 40 tokens, which spans several blocks of every size tested.
    return [tok(p).input_ids for p in SHORT[:4]] + [long_prompt(tok, 40)[:40]]


@pytest.fixture(scope="module")
def solo(weights, tok, prompts):
    """Each prompt run alone on the simple engine: the reference token ids."""
    engine = make_engine(weights, tok, engine="simple")
    return [engine.run([engine.make_request(p, GREEDY)])[0].token_ids for p in prompts]


@pytest.fixture(scope="module")
def paged16(weights, tok):
    return make_engine(weights, tok, engine="paged", block_size=16, max_num_seqs=4)


def run_all(engine, prompts, params=GREEDY):
    return [o.token_ids for o in engine.run([engine.make_request(p, params) for p in prompts])]


def assert_all_free(engine):
    bm = engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.tables, "blocks leaked"
    assert not engine.has_unfinished()


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_equals_solo(weights, tok, prompts, solo, paged16, block_size):
    engine = paged16 if block_size == 16 else make_engine(
        weights, tok, engine="paged", block_size=block_size, max_num_seqs=4)
    assert engine.runner.kv_caches[0][0].shape[:2] == (4 * 256 // block_size, block_size), (
        "by default the paged cache gets the bytes of the contiguous engine: max_num_seqs * max_model_len tokens")
    out = run_all(engine, prompts)
    for i, (got, ref) in enumerate(zip(out, solo)):
        assert got == ref, f"prompt {i}, block_size {block_size}: paged batch output differs from the solo run"
    assert engine.scheduler.num_preemptions == 0
    assert_all_free(engine)
    # What the metrics see: requests reserve whole blocks, so at most block_size - 1 slots
    # of each running request's KV reservation are empty.
    per_token = engine.kv_bytes_per_token
    for rec in engine.step_records:
        assert 0 <= rec.kv_reserved_bytes - rec.kv_used_bytes <= rec.num_running * (block_size - 1) * per_token


def test_paged_preemption_equals_solo(weights, tok, prompts, solo):
    # max_model_len 64 in blocks of 8: one full request needs 8 blocks; the cache gets 9,
    # sized through kv_cache_bytes. The 40-token prompt goes first and takes 5 blocks, the
    # short ones fill the rest, and as they all grow the newest ones are preempted.
    per_block = 8 * ModelConfig().kv_bytes_per_token(4)  # 8 tokens of K and V, 30 layers, fp32
    engine = make_engine(weights, tok, engine="paged", block_size=8, max_num_seqs=5, max_model_len=64,
                         kv_cache_bytes=9 * per_block + per_block // 2)
    assert engine.scheduler.block_manager.num_blocks == 9, "kv_cache_bytes buys whole blocks only"
    order = [4, 0, 1, 2, 3]
    out = run_all(engine, [prompts[i] for i in order])
    assert engine.scheduler.num_preemptions > 0, "the workload was sized to force preemptions"
    for i, got in zip(order, out):
        assert got == solo[i], f"prompt {i}: output after preemption and recompute differs from the solo run"
    assert_all_free(engine)


def test_paged_preemption_with_chunked_prefill_equals_solo(weights, tok, prompts, solo):
    # A 16-token budget: the 40-token prompt goes in three chunks, and so do the recomputes
    # of the short requests it pushes out when it grows to 6, then 7 of the 8 blocks.
    engine = make_engine(weights, tok, engine="paged", block_size=8, max_num_seqs=3, max_model_len=64,
                         num_blocks=8, max_num_batched_tokens=16, enable_chunked_prefill=True)
    order = [4, 1, 2]
    out = run_all(engine, [prompts[i] for i in order])
    assert engine.scheduler.num_preemptions > 0
    assert max(rec.num_tokens for rec in engine.step_records) <= 16, "token budget exceeded"
    for i, got in zip(order, out):
        assert got == solo[i], f"prompt {i}: chunked prefill under preemption differs from the solo run"
    assert_all_free(engine)


def test_paged_triton_backend_equals_solo(weights, tok, prompts, solo):
    # The Triton interpreter runs the kernels on the CPU at seconds per step: two prompts,
    # a few tokens, blocks of 8 so the 40-token prompt spans five of them.
    engine = make_engine(weights, tok, engine="paged", block_size=8, max_num_seqs=2, attention_backend="triton")
    n = 6
    out = run_all(engine, [prompts[0], prompts[4]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert out == [solo[0][:n], solo[4][:n]], "Triton paged kernels: output differs from the solo run"
    assert_all_free(engine)


def test_abort_frees_every_block(paged16, prompts):
    engine = paged16
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks < bm.num_blocks
    for r in reqs:
        engine.abort(r)
    assert all(r.finish_reason == "abort" for r in reqs)
    assert_all_free(engine)


# ------------------------------------------------------------------ bad input


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        LLM(engine="paged", block_size=12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=7), "at least 8 blocks"),
    (dict(kv_cache_bytes=7 * 8 * ModelConfig().kv_bytes_per_token(4)), "at least 8 blocks"),
])
def test_cache_too_small_for_one_request(weights, kwargs, message):
    # (Both options at once, and the arithmetic, are checked without a model in test_block_manager.py.)
    with pytest.raises(ValueError, match=message):
        make_engine(weights, None, engine="paged", block_size=8, max_model_len=64, **kwargs)


def test_prompt_that_cannot_fit_is_rejected_at_add_time(paged16):
    too_long = [1] * 256  # max_model_len tokens: no room for even one generated token
    with pytest.raises(ValueError, match="max_model_len"):
        paged16.add_request(too_long, GREEDY)
    assert not paged16.has_unfinished()
